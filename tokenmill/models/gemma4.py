"""The Gemma 4 family (text, dense): ``Gemma4ForCausalLM``, and the language model of
``Gemma4ForConditionalGeneration`` (its vision and audio towers are skipped).

What differs from Gemma 3 (whose GeGLU, scaled embeddings, sandwich norms and final softcap it keeps):

- Norms scale by ``w`` (not ``1 + w``), applied in float32 before the cast back; v is RMS-normed
  too, without a weight. The attention scale is 1.0: the q/k norms set the score scale.
- Sliding and global layers differ in shape: global layers have ``global_head_dim``-wide heads,
  may have their own KV head count, and with ``attention_k_eq_v`` no v projection (v is the raw
  k, before its norm and RoPE). Their RoPE is proportional: only the leading pairs rotate.
- KV sharing: the last ``num_kv_shared_layers`` layers own no cache and no k/v projection; each
  reads the cache of the last earlier non-shared layer of its type, and with
  ``use_double_wide_mlp`` its MLP is twice as wide.
- Per-layer inputs (PLE): a second, packed embedding of the token, plus a projection of the main
  embedding, gives every layer a small vector that gates a residual branch after its MLP.
- Each layer's output, residual stream included, is multiplied by its ``layer_scalar``.

The MoE variant (``enable_moe_block``) is refused for now.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from tokenmill.layers import ops
from tokenmill.layers.attention import AttentionMetadata, KVCache, PagedAttention
from tokenmill.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    Split,
    VocabParallelEmbedding,
)
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.loader.kv_layout import KVLayout, KVSpec
from tokenmill.loader.model_config import ModelConfig, ModelLoadError, rope_parameters
from tokenmill.models.gemma3 import GeGLUMLP, Gemma3ForCausalLM, PendingOutput, add_norm_linear, layer_types
from tokenmill.models.llama import decoder_config, norm_linear, sliding_windows

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' Gemma4TextConfig defaults, for keys a config.json leaves out.
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_DEFAULT_GLOBAL_HEAD_DIM = 512
_LAYER_TYPE_PATTERN = 6  # without layer_types: every 6th layer global
_PER_LAYER_INPUT_SCALE = 2.0**-0.5  # the PLE sum of two parts, rescaled
_TOWER_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
# A decoder layer's k/v tensors (under either checkpoint prefix), which a KV-shared layer does not use.
_LAYER_KV_TENSOR = re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.self_attn\.[kv]_(?:proj|norm)\.")


@dataclass(frozen=True)
class Gemma4Config(ModelConfig):
    """ModelConfig plus what only Gemma 4 reads. ``num_kv_heads``/``head_dim`` are the first layer's
    and ``rope_*`` the global layers' (``local_rope_*`` the sliding ones'), as in Gemma3Config; each
    layer's head shape is in the per-layer tuples."""

    final_softcap: float | None = None
    local_rope_theta: float = 10_000.0
    local_rope_scaling: dict[str, Any] | None = None
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    kv_sources: tuple[int, ...] = ()  # the layer whose cache each layer reads (itself unless KV-shared)
    attention_k_eq_v: bool = False  # on the global layers: v is k's projection
    double_wide_mlp: bool = False  # on the KV-shared layers
    per_layer_input_size: int = 0  # PLE width per layer; 0: no per-layer inputs
    per_layer_vocab_size: int = 0

    def kv_layout(self) -> KVLayout:
        specs = tuple(
            KVSpec(heads, dim, window)
            for heads, dim, window in zip(self.layer_kv_heads, self.layer_head_dims, self.sliding_windows)
        )
        return KVLayout(specs, self.kv_sources)

    def is_global(self, layer: int) -> bool:
        return self.sliding_windows[layer] is None

    def is_kv_shared(self, layer: int) -> bool:
        return self.kv_sources[layer] != layer

    def k_eq_v(self, layer: int) -> bool:
        return self.attention_k_eq_v and self.is_global(layer)

    def layer_intermediate_size(self, layer: int) -> int:
        return self.intermediate_size * (2 if self.double_wide_mlp and self.is_kv_shared(layer) else 1)


def parse_config(raw: dict[str, Any], arch: str) -> Gemma4Config:
    """Gemma4ForCausalLM's config, or the ``text_config`` of Gemma4ForConditionalGeneration."""
    _refuse_unsupported(raw)
    types = _layer_types(raw)
    window = raw.get("sliding_window", 512)
    if window is None:
        raise ModelLoadError("Gemma 4 needs a sliding_window for its sliding layers")
    head_dims, kv_heads = _layer_head_shapes(raw, types)
    rope = raw.get("rope_parameters") or _DEFAULT_ROPE
    if any(rope.get(t) is None for t in set(types)):
        raise ModelLoadError(f"Gemma 4 rope_parameters must give each layer type its own entry, got {rope}")
    local_theta, local_scaling = rope_parameters({"rope_parameters": rope[SLIDING]})
    bias = bool(raw.get("attention_bias", False))
    text = {
        **raw,
        "rope_parameters": rope[FULL],
        "rope_scaling": None,
        "layer_types": types,
        "head_dim": head_dims[0],
        "num_key_value_heads": kv_heads[0],
        "max_position_embeddings": raw.get("max_position_embeddings", 131_072),
        "tie_word_embeddings": raw.get("tie_word_embeddings", True),
    }
    base = decoder_config(text, arch, qkv_bias=bias, o_bias=bias, qk_norm=True, windows=sliding_windows(text, window))
    per_layer_input_size = int(raw.get("hidden_size_per_layer_input", 256) or 0)
    return Gemma4Config(
        **{f.name: getattr(base, f.name) for f in fields(ModelConfig)},
        final_softcap=None if raw.get("final_logit_softcapping") is None else float(raw["final_logit_softcapping"]),
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        layer_head_dims=head_dims,
        layer_kv_heads=kv_heads,
        kv_sources=_kv_sources(types, int(raw.get("num_kv_shared_layers", 0) or 0)),
        attention_k_eq_v=bool(raw.get("attention_k_eq_v", False)),
        double_wide_mlp=bool(raw.get("use_double_wide_mlp", False)),
        per_layer_input_size=per_layer_input_size,
        per_layer_vocab_size=int(raw.get("vocab_size_per_layer_input", 262_144)) if per_layer_input_size else 0,
    )


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    """MoE has no implementation yet; ``use_bidirectional_attention: all`` is not a causal LM. Its
    ``vision`` value only lets image tokens see each other, so a text-only model stays causal."""
    if raw.get("enable_moe_block"):
        raise ModelLoadError("Gemma 4 MoE (enable_moe_block) is not supported yet: only the dense models are")
    if raw.get("use_bidirectional_attention") not in (None, False, "vision"):
        raise ModelLoadError(
            f"Gemma 4 with use_bidirectional_attention={raw['use_bidirectional_attention']!r} "
            "is not supported (not a causal LM)"
        )
    activation = raw.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(f"Gemma 4 hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)")


def _layer_types(raw: dict[str, Any]) -> list[str]:
    """As transformers reads them: the last layer is always global, whatever the list says."""
    types = layer_types(raw, _LAYER_TYPE_PATTERN)
    unknown = set(types) - {SLIDING, FULL}
    if unknown:
        raise ModelLoadError(f"Gemma 4 layer types {sorted(unknown)} are not supported ({SLIDING}, {FULL})")
    return [*types[:-1], FULL]


def _layer_head_shapes(raw: dict[str, Any], types: list[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's (head dim, KV heads). transformers writes them as ``per_layer_config`` overrides
    keyed by layer index; older config.json files (and the released checkpoints) as
    ``global_head_dim`` and ``num_global_key_value_heads`` for the global layers, the latter
    only heeded with ``attention_k_eq_v``. Layers of one type must agree, as they share a RoPE table."""
    head_dim = int(raw.get("head_dim", 256))
    kv_heads = int(raw.get("num_key_value_heads") or raw["num_attention_heads"])
    overrides = _per_layer_overrides(raw, types)
    dims = tuple(int(overrides[i].get("head_dim", head_dim)) for i in range(len(types)))
    heads = tuple(int(overrides[i].get("num_key_value_heads", kv_heads)) for i in range(len(types)))
    for kind in set(types):
        shapes = {(dims[i], heads[i]) for i, t in enumerate(types) if t == kind}
        if len(shapes) > 1:
            raise ModelLoadError(f"Gemma 4 {kind} layers of different shapes {sorted(shapes)} are not supported")
    return dims, heads


def _per_layer_overrides(raw: dict[str, Any], types: list[str]) -> list[dict[str, Any]]:
    if "per_layer_config" in raw:
        given = {int(i): dict(o or {}) for i, o in (raw["per_layer_config"] or {}).items()}
        unknown = {key for o in given.values() for key in o} - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise ModelLoadError(f"Gemma 4 per_layer_config keys {sorted(unknown)} are not supported")
        return [given.get(i, {}) for i in range(len(types))]
    full: dict[str, Any] = {"head_dim": raw.get("global_head_dim") or _DEFAULT_GLOBAL_HEAD_DIM}
    if raw.get("attention_k_eq_v") and raw.get("num_global_key_value_heads") is not None:
        full["num_key_value_heads"] = raw["num_global_key_value_heads"]
    return [full if t == FULL else {} for t in types]


def _kv_sources(types: list[str], num_shared: int) -> tuple[int, ...]:
    """The last ``num_shared`` layers read the cache of the last earlier non-shared layer of their type."""
    first_shared = len(types) - num_shared
    if num_shared and first_shared <= 0:
        raise ModelLoadError(f"Gemma 4 with all {len(types)} layers KV-shared has no layer to own a cache")
    owner = {t: i for i, t in enumerate(types[:first_shared])}
    missing = set(types[first_shared:]) - set(owner)
    if missing:
        raise ModelLoadError(f"Gemma 4 KV-shared {sorted(missing)} layers have no earlier layer of that type")
    return tuple(i if i < first_shared else owner[t] for i, t in enumerate(types))


class Gemma4RMSNorm(nn.Module):
    """``w * norm(x)`` in float32, ``w`` starting at one."""

    weighting = "fp32"

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.fp32_weight_rms_norm(x, self.weight, self.eps)

    def add_to(self, x: torch.Tensor, stream: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """``stream + norm(x)``: a block's output normed into the residual stream (then times ``scale``,
        the layer scalar, where given), in one pass."""
        return ops.add_rms_norm(x, self.weight, self.eps, stream, self.weighting, scale)


class SharedKVAttention(PagedAttention):
    """Attention of a KV-shared layer over the cache it is given (its source layer's): only q is
    normed and rotated (one pass), and nothing is written."""

    # (No k or v: it reads its source layer's cache.)
    def forward(  # type: ignore[override]
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        q_norm: Gemma4RMSNorm,
    ) -> torch.Tensor:
        q = ops.rotary_embedding_query(
            positions, q, self.rotary.cos_sin_cache, q_norm.weight, q_norm.eps, q_norm.weighting
        )
        return self.attend(q, kv_cache, meta)


class Gemma4Attention(nn.Module):
    """One fused projection per layer: ``q | k | v``, ``q | k`` where v is k (``attention_k_eq_v``
    on a global layer), or ``q`` alone on a KV-shared layer, which keeps it as ``q_proj``."""

    def __init__(self, config: Gemma4Config, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = config.layer_head_dims[layer]
        heads, kv_heads = Split(config.num_heads, self.head_dim), Split(config.layer_kv_heads[layer], self.head_dim)
        self.shared = config.is_kv_shared(layer)
        self.k_eq_v = config.k_eq_v(layer)
        self.q_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_proj = RowParallelLinear(heads, config.hidden_size, bias=config.o_bias)
        parts = [heads] if self.shared else [heads, kv_heads] if self.k_eq_v else [heads, kv_heads, kv_heads]
        projection = ColumnParallelLinear(config.hidden_size, parts, bias=config.qkv_bias)
        self.q_size, self.kv_size = projection.part_sizes[0], kv_heads.local_size(projection.tp)  # this rank's
        attention = SharedKVAttention if self.shared else PagedAttention
        self.attn = attention(
            self.q_size // self.head_dim,
            self.kv_size // self.head_dim,
            self.head_dim,
            config.sliding_windows[layer],
            rotary,
            scale=1.0,
            kv_group=config.kv_layout().layer_group[layer],
        )
        if self.shared:
            self.q_proj = projection
            return
        self.qkv_proj = projection
        self.k_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)

    @property
    def in_proj(self) -> nn.Linear:
        """The layer's one input projection: ``q_proj`` on a KV-shared layer, else ``qkv_proj``."""
        return self.q_proj if self.shared else self.qkv_proj

    def forward(
        self, positions: torch.Tensor, projected: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """``projected``: ``in_proj`` of the normed input (fused with the norm by the layer). The q/k
        norms and the weightless v norm (of the raw k where k = v) run in the RoPE pass."""
        tokens = projected.shape[0]
        if self.shared:
            out = self.attn(positions, projected.reshape(tokens, -1, self.head_dim), kv_cache, meta, self.q_norm)
        else:
            sizes = [self.q_size, self.kv_size] + ([] if self.k_eq_v else [self.kv_size])
            q, k, *v = (t.reshape(tokens, -1, self.head_dim) for t in projected.split(sizes, dim=-1))
            out = self.attn(
                positions, q, k, k if self.k_eq_v else v[0], kv_cache, meta, self.q_norm, self.k_norm, v_norm=True
            )
        return self.o_proj(out.reshape(tokens, self.q_size))


class Gemma4DecoderLayer(nn.Module):
    """Gemma 3's sandwich-normed attention and MLP, then the per-layer-input branch, then the
    whole stream times ``layer_scalar``."""

    def __init__(self, config: Gemma4Config, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer, rotary)
        self.mlp = GeGLUMLP(hidden, config.layer_intermediate_size(layer))
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        if config.per_layer_input_size:
            self.per_layer_input_gate = ReplicatedLinear(hidden, config.per_layer_input_size, bias=False)
            self.per_layer_projection = ReplicatedLinear(config.per_layer_input_size, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The stream in, the stream out, whole: the attention's normed output joins the stream in the
        kernel that norms it for the MLP's projection (one kernel for one-token decode on the GPU);
        the MLP's and the per-layer input's join it before the layer scalar multiplies it."""
        projected, _ = norm_linear(self.input_layernorm, x, None, self.self_attn.in_proj)
        attn = PendingOutput(self.self_attn(positions, projected, kv_cache, meta), self.post_attention_layernorm)
        activation, x = add_norm_linear(
            attn, x, self.pre_feedforward_layernorm, self.mlp.gate_up_proj, gated=True, activation="gelu_tanh"
        )
        mlp = self.mlp.down_proj(activation)
        if per_layer_input is None:
            return self.post_feedforward_layernorm.add_to(mlp, x, self.layer_scalar)
        x = self.post_feedforward_layernorm.add_to(mlp, x)
        gate = ops.linear_gelu_mul(x, self.per_layer_input_gate.weight, per_layer_input)
        return self.post_per_layer_input_norm.add_to(self.per_layer_projection(gate), x, self.layer_scalar)


class Gemma4Model(nn.Module):
    def __init__(self, config: Gemma4Config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # Held in the model's dtype: transformers rounds sqrt(hidden_size) to it before the multiply.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        rotary = self._rotary_by_type(config, max_positions)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, i, rotary[config.is_global(i)]) for i in range(config.num_layers)
        )
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.per_layer_input_size:
            packed = config.num_layers * config.per_layer_input_size
            self.embed_tokens_per_layer = VocabParallelEmbedding(config.per_layer_vocab_size, packed)
            self.register_buffer(
                "per_layer_embed_scale", torch.tensor(config.per_layer_input_size**0.5), persistent=False
            )
            self.per_layer_model_projection = ReplicatedLinear(config.hidden_size, packed, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(config.per_layer_input_size, config.rms_norm_eps)

    @staticmethod
    def _rotary_by_type(config: Gemma4Config, max_positions: int) -> dict[bool, RotaryEmbedding]:
        """One table per layer type (keyed by ``is_global``), at that type's head dim."""
        tables = {}
        for is_global in {config.is_global(i) for i in range(config.num_layers)}:
            dim = next(config.layer_head_dims[i] for i in range(config.num_layers) if config.is_global(i) == is_global)
            theta, scaling = (
                (config.rope_theta, config.rope_scaling)
                if is_global
                else (config.local_rope_theta, config.local_rope_scaling)
            )
            tables[is_global] = RotaryEmbedding(dim, max_positions, theta, scaling)
        return tables

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale
        per_layer = self._per_layer_inputs(input_ids, x) if self.config.per_layer_input_size else None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(positions, x, None if per_layer is None else per_layer[:, i], kv_cache, meta)
        return self.norm(x)

    def _per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """``[tokens, layers, width]``: the token's own per-layer embedding (scaled by sqrt(width))
        plus a normed projection of its scaled main embedding (scaled by 1/sqrt(hidden)), the sum
        divided by sqrt(2)."""
        shape = (input_ids.shape[0], self.config.num_layers, self.config.per_layer_input_size)
        identity = (self.embed_tokens_per_layer(input_ids) * self.per_layer_embed_scale).reshape(shape)
        context = self.per_layer_model_projection(embeds) * (self.config.hidden_size**-0.5)
        context = self.per_layer_projection_norm(context.reshape(shape))
        return (context + identity) * _PER_LAYER_INPUT_SCALE


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    """Gemma 4's decoder under Gemma 3's head (final softcap) and loader (nested checkpoint names);
    the fused projections differ per layer, and KV-shared layers' k/v tensors, which some
    checkpoints carry though nothing reads them, are dropped."""

    # Gemma 3's head reads only ``final_softcap`` of its config, which Gemma4Config has too.
    config: Gemma4Config  # type: ignore[assignment]
    towers = ("vision and audio", _TOWER_PREFIXES)

    def __init__(self, config: Gemma4Config, max_positions: int) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = Gemma4Model(config, max_positions)
        self.lm_head = (
            None if config.tie_word_embeddings else VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        )

    def fused_projections(self, layer: int) -> dict[str, tuple[str, int]]:
        slots = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        if self.config.is_kv_shared(layer):
            return slots
        slots |= {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1)}
        if not self.config.k_eq_v(layer):
            slots["v_proj"] = ("qkv_proj", 2)
        return slots

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self._without_shared_kv(weights))

    def _without_shared_kv(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            match = _LAYER_KV_TENSOR.match(name)
            if match is None or not self.config.is_kv_shared(int(match.group(1))):
                yield name, tensor
