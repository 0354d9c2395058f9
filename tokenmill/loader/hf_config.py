"""Reads a Hugging Face ``config.json`` into the engine's own ModelConfig.

The engine never looks at the raw dict again: everything the models and the
KV cache need is normalised here once (rope parameters old and new style,
per-layer sliding windows, explicit or derived head_dim).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded, with a message that says why."""


@dataclass(frozen=True)
class ModelConfig:
    """What the model code and the KV cache need to know about a checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]
    checkpoint_dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of every layer for one token, in bytes of ``dtype``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Rope theta and scaling, from transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` pair."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {}) or None
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    if scaling is None and params:
        scaling = params
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling.pop("rope_theta", None)
        if kind == "default":
            return theta, None
        if kind != "llama3":
            raise ModelLoadError(f"rope type {kind!r} is not supported (supported: default, llama3)")
        scaling["rope_type"] = kind
    return theta, scaling


def _sliding_windows(raw: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window", False):
        window = None
    layer_types = raw.get("layer_types")
    if window is None:
        return (None,) * num_layers
    if layer_types is None:
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            first = int(raw.get("max_window_layers", num_layers))
            return tuple(int(window) if i >= first else None for i in range(num_layers))
        return (int(window),) * num_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse ``config.json`` (and ``generation_config.json`` for eos ids) of a model directory."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json: is it a Hugging Face model directory?")
    raw = _read_json(config_path)
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"architecture {archs or 'missing'} in {config_path} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_layers = int(raw["num_hidden_layers"])
        vocab = int(raw["vocab_size"])
        intermediate = int(raw["intermediate_size"])
    except KeyError as exc:
        raise ModelLoadError(f"{config_path} lacks the field {exc.args[0]!r}") from exc
    head_dim = raw.get("head_dim") or hidden // num_heads
    dtype_name = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    theta, scaling = _rope(raw)
    eos = _as_id_list(raw.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos = _as_id_list(_read_json(gen_path).get("eos_token_id")) or eos
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        o_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_windows=_sliding_windows(raw, arch, num_layers),
        checkpoint_dtype=_DTYPES.get(dtype_name, torch.float32),
        eos_token_ids=tuple(eos),
    )


def resolve_dtype(name: str | torch.dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto`` keeps the checkpoint's dtype on GPU; on CPU half types become float32,
    since CPU matmuls in bf16/fp16 are slow and less exact."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        if device.type == "cpu" and config.checkpoint_dtype != torch.float32:
            return torch.float32
        return config.checkpoint_dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


