"""The Gemma 3 family (text): ``Gemma3ForCausalLM``, and the language model of
``Gemma3ForConditionalGeneration`` (its vision tower is skipped).

What differs from the Llama decoder: every RMSNorm scales by ``1 + w``; norms sit
both before and after attention and the MLP; q and k are normed per head; the
attention scale is ``query_pre_attn_scalar ** -0.5``; sliding and global layers
interleave, each kind with its own RoPE table; scores and final logits may be
softcapped (``tanh(x / cap) * cap``); the MLP is GeGLU; embeddings are scaled by
``sqrt(hidden_size)`` in the model's dtype. q/k/v and gate/up are fused at load
time under the Llama parameter names, so the Llama loader fills them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
from torch import nn

from tokenmill.layers import ops
from tokenmill.layers.attention import AttentionMetadata, KVCache
from tokenmill.layers.linear import ColumnParallelLinear, RowParallelLinear, Split, VocabParallelEmbedding
from tokenmill.layers.norm import NormParams, OffsetRMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.loader.model_config import ModelConfig, ModelLoadError, rope_parameters
from tokenmill.models.llama import (
    DecoderAttention,
    LlamaForCausalLM,
    decoder_config,
    norm_linear,
    sliding_windows,
)

logger = logging.getLogger(__name__)

_DEFAULT_GLOBAL_THETA = 1_000_000.0
_DEFAULT_LOCAL_THETA = 10_000.0
# Checkpoint prefixes of Gemma3ForConditionalGeneration's language model (transformers 5, then 4).
_LANGUAGE_MODEL_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    """ModelConfig plus what only Gemma 3 reads; ``rope_theta``/``rope_scaling`` are the global layers'."""

    attn_scale: float = 1.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    local_rope_theta: float = _DEFAULT_LOCAL_THETA
    local_rope_scaling: dict[str, Any] | None = None


def layer_types(raw: dict[str, Any], pattern: int) -> list[str]:
    """``layer_types``, or else every ``pattern``-th layer global and the others sliding."""
    if raw.get("layer_types") is not None:
        return list(raw["layer_types"])
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(int(raw["num_hidden_layers"]))
    ]


def parse_config(raw: dict[str, Any], arch: str) -> Gemma3Config:
    """Gemma3ForCausalLM's config, or the ``text_config`` of Gemma3ForConditionalGeneration. RoPE comes
    per layer type from transformers 5's ``rope_parameters``, or from the older ``rope_theta`` +
    ``rope_scaling`` (global) and ``rope_local_base_freq`` (sliding)."""
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma 3 with use_bidirectional_attention is not supported (not a causal LM)")
    activation = raw.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(f"Gemma 3 hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)")
    rope = raw.get("rope_parameters") or {}
    full = dict(rope.get("full_attention") or raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", raw.get("rope_theta", _DEFAULT_GLOBAL_THETA))
    local = dict(rope.get("sliding_attention") or {})
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", _DEFAULT_LOCAL_THETA))
    local_theta, local_scaling = rope_parameters({"rope_parameters": local})
    types = layer_types(raw, int(raw.get("sliding_window_pattern", 6)))  # the older spelling of layer_types
    bias = bool(raw.get("attention_bias", False))
    text = {
        **raw,
        "rope_parameters": full,
        "rope_scaling": None,
        "layer_types": types,
        "tie_word_embeddings": raw.get("tie_word_embeddings", True),
    }
    base = decoder_config(
        text, arch, qkv_bias=bias, o_bias=bias, qk_norm=True, windows=sliding_windows(text, raw.get("sliding_window"))
    )
    return Gemma3Config(
        **{f.name: getattr(base, f.name) for f in fields(ModelConfig)},
        attn_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=_optional_float(raw.get("attn_logit_softcapping")),
        final_softcap=_optional_float(raw.get("final_logit_softcapping")),
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


class Gemma3Attention(DecoderAttention):
    def __init__(self, config: Gemma3Config, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer, rotary, OffsetRMSNorm, config.attn_scale, config.attn_softcap)

    # (No residual in or out, unlike Llama's: the sandwich norm comes between the block and the stream.)
    def forward(  # type: ignore[override]
        self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """``qkv``: ``qkv_proj`` of the normed input (fused with the norm by the layer); the q/k norms
        run in the RoPE pass. Returns the output projection, to be normed before it joins the stream."""
        tokens = qkv.shape[0]
        q, k, v = (
            t.reshape(tokens, -1, self.head_dim) for t in qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        )
        out = self.attn(positions, q, k, v, kv_cache, meta, self.q_norm, self.k_norm)
        return self.o_proj(out.reshape(tokens, self.q_size))


class GeGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        rows = Split(intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [rows, rows], bias=bias)
        self.down_proj = RowParallelLinear(rows, hidden_size, bias=bias)


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: each block's input and output are normed, then the output joins the stream."""

    def __init__(self, config: Gemma3Config, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer, rotary)
        self.mlp = GeGLUMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        stream: torch.Tensor,
        pending: PendingOutput | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, PendingOutput]:
        """Each block's output is normed and added into the stream by the kernel that norms the stream
        for the next block's projection (one kernel for one-token decode on the GPU): the MLP's output
        is handed on as ``pending``, to join the stream in the next layer (or the final norm)."""
        if pending is None:
            qkv, _ = norm_linear(self.input_layernorm, stream, None, self.self_attn.qkv_proj)
        else:
            qkv, stream = add_norm_linear(pending, stream, self.input_layernorm, self.self_attn.qkv_proj)
        attn = PendingOutput(self.self_attn(positions, qkv, kv_cache, meta), self.post_attention_layernorm)
        activation, stream = add_norm_linear(
            attn, stream, self.pre_feedforward_layernorm, self.mlp.gate_up_proj, gated=True, activation="gelu_tanh"
        )
        return stream, PendingOutput(self.mlp.down_proj(activation), self.post_feedforward_layernorm)


class StreamNorm(NormParams, Protocol):
    """A norm that adds a block's output, normed, into the residual stream: OffsetRMSNorm, or Gemma 4's."""

    def add_to(self, x: torch.Tensor, stream: torch.Tensor) -> torch.Tensor: ...


@dataclass
class PendingOutput:
    """A block's output not yet in the residual stream, and the norm it takes on the way in."""

    x: torch.Tensor
    norm: StreamNorm

    def join(self, stream: torch.Tensor) -> torch.Tensor:
        return self.norm.add_to(self.x, stream)


def add_norm_linear(
    pending: PendingOutput,
    stream: torch.Tensor,
    norm: NormParams,
    linear: nn.Linear,
    gated: bool = False,
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pending`` joins ``stream``; the new stream is normed by ``norm`` and projected by ``linear``
    (``ops.add_norm_linear``); returns ``(projection, new stream)``."""
    return ops.add_norm_linear(
        pending.x,
        stream,
        pending.norm.weight,
        norm.weight,
        norm.eps,
        linear.weight,
        linear.bias,
        gated,
        norm.weighting,
        activation,
    )


class Gemma3Model(nn.Module):
    def __init__(self, config: Gemma3Config, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # Held in the model's dtype: transformers rounds sqrt(hidden_size) to it before the multiply.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        global_rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        local_rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.local_rope_theta, config.local_rope_scaling
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, global_rotary if window is None else local_rotary)
            for i, window in enumerate(config.sliding_windows)
        )
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        stream, pending = self.embed_tokens(input_ids) * self.embed_scale, None
        for layer, kv_cache in zip(self.layers, kv_caches):
            stream, pending = layer(positions, stream, pending, kv_cache, meta)
        assert pending is not None  # the last layer's MLP output
        return self.norm(pending.join(stream))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's decoder under the Llama head, logits pruning and loader; adds final-logit softcapping
    and the nested checkpoint names of Gemma3ForConditionalGeneration."""

    config: Gemma3Config
    # The multimodal checkpoint's towers, skipped at load: what the log line calls them, their prefixes.
    towers: tuple[str, tuple[str, ...]] = ("vision", _VISION_PREFIXES)

    def __init__(self, config: Gemma3Config, max_positions: int) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = Gemma3Model(config, max_positions)
        self.lm_head = (
            None if config.tie_word_embeddings else VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        )

    def finish_logits_(self, logits: torch.Tensor) -> torch.Tensor:
        """The final-logit softcap (``tanh(x / cap) * cap``, increasing): skipped for greedy rows, whose
        head logits at 262k a row were read and written three times for it (Gemma-3-4B, 128 rows: 47 us a
        step in one kernel)."""
        cap = self.config.final_softcap
        return logits if cap is None else ops.softcap_(logits, cap)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(language_model_weights(weights, *self.towers))


def language_model_weights(
    weights: Iterable[tuple[str, Any]], towers: str, tower_prefixes: tuple[str, ...]
) -> Iterator[tuple[str, Any]]:
    """A ...ForConditionalGeneration checkpoint's tensors renamed as its ...ForCausalLM's; the
    towers' (``tower_prefixes``) dropped, with one log line naming them ``towers``."""
    skipped = 0
    for name, tensor in weights:
        if name.startswith(tower_prefixes):
            skipped += 1
            continue
        prefix = next((p for p in _LANGUAGE_MODEL_PREFIXES if name.startswith(p)), None)
        yield (name if prefix is None else _LANGUAGE_MODEL_PREFIXES[prefix] + name[len(prefix) :]), tensor
    if skipped:
        logger.info("skipped %d %s tensors: only the language model is loaded", skipped, towers)
