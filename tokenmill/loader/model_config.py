"""The engine's own ModelConfig, and the helpers that fill it from a Hugging Face ``config.json``.

The engine never looks at the raw dict again: everything the models and the
KV cache need is normalised here once. This module knows no architecture: the
family registered for the ``architectures`` name maps the raw dict onto
ModelConfig, using the generic helpers below (rope parameters old and new
style, checkpoint dtype).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenmill.kernels.fp8 import FP8Scheme
from tokenmill.loader.kv_layout import KVLayout

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
class CheckpointQuantization:
    """An FP8 checkpoint's ``quantization_config`` (read by ``loader/fp8_checkpoint.py``): its scheme, and
    which projections it stores in FP8. ``method``: ``compressed-tensors`` or ``fp8``; ``targets``: the
    projections a compressed-tensors config quantizes (``Linear``: all; an exact name, or ``re:`` and a
    regular expression matched from the name's start), None for all; ``ignore``: those left dense, named
    the same way, or for quant_method ``fp8`` by any part of the name (as transformers reads its
    ``modules_to_not_convert``). Names are the checkpoint's, as the engine's models name them."""

    method: str
    scheme: FP8Scheme
    targets: tuple[str, ...] | None
    ignore: tuple[str, ...]

    def quantizes(self, names: Sequence[str]) -> bool:
        """Whether the checkpoint stores the projections ``names`` (the parts one of the engine's layers
        fuses: q, k, v) in FP8; parts that disagree are a ModelLoadError, since one matmul runs them."""
        answers = {self._quantizes(name) for name in names}
        if len(answers) > 1:
            raise ModelLoadError(
                f"the checkpoint stores only some of {', '.join(names)} in FP8 ({self.method} ignore list or "
                "targets), but the engine runs them as one matmul"
            )
        return answers.pop()

    def _quantizes(self, name: str) -> bool:
        def named(pattern: str) -> bool:
            if pattern.startswith("re:"):
                return re.match(pattern[3:], name) is not None
            return pattern == name or (self.method == "fp8" and pattern in name)

        targeted = self.targets is None or any(t == "Linear" or named(t) for t in self.targets)
        return targeted and not any(named(p) for p in self.ignore)


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts model's MLPs: ``num_experts`` gated MLPs of ``intermediate_size`` rows
    each, of which a router picks ``top_k`` per token (softmax over all, top-k, divided by their sum with
    ``renormalize``); ``sparse_layers[i]``: whether layer ``i`` has them (else a dense MLP of
    ``ModelConfig.intermediate_size``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[bool, ...]

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ModelLoadError(
                f"a mixture of experts needs 1 <= experts per token <= experts, got {self.top_k} of "
                f"{self.num_experts} experts (num_experts_per_tok, num_experts / num_local_experts)"
            )
        if self.intermediate_size < 1:
            raise ModelLoadError(f"expert intermediate size {self.intermediate_size} must be positive")


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
    quantization: CheckpointQuantization | None = None  # an FP8 checkpoint's; None: dense weights
    moe: MoEConfig | None = None  # a sparse mixture of experts' MLPs; None: dense MLPs only

    def kv_layout(self) -> KVLayout:
        """Each layer's cache: every layer owns one of ``num_kv_heads`` × ``head_dim``, with its
        sliding window. Families whose layers differ further (Gemma 4) override this."""
        return KVLayout.uniform(self.num_layers, self.num_kv_heads, self.head_dim, self.sliding_windows)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file of the model directory; a ModelLoadError naming it if it is not valid JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def rope_parameters(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Rope theta and scaling, from transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` pair; scaling is None for plain rope."""
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
        if kind not in ("linear", "llama3", "proportional"):
            raise ModelLoadError(
                f"rope type {kind!r} is not supported (supported: default, linear, llama3, proportional)"
            )
        scaling["rope_type"] = kind
    return theta, scaling


def checkpoint_dtype(raw: dict[str, Any]) -> torch.dtype:
    """The dtype the weights were saved in (``dtype``, or the older ``torch_dtype``)."""
    return _DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype") or "float32"), torch.float32)


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
