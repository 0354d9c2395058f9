"""The Llama family (Llama 2/3, Mistral): its decoder and its config mapping.

The decoder reads only switches carried by ModelConfig: q/k/v and output bias,
per-head RMSNorm on q and k before RoPE, per-layer sliding windows, llama3 rope
scaling, tied embeddings. q/k/v and gate/up are fused into one matmul each at
load time. Its projections and embeddings are the tensor-parallel layers of
``layers/linear.py``, so under tensor parallelism each rank builds and loads its
own share (its heads, its MLP rows, its vocabulary rows). Other families with the
same block layout (Qwen) reuse the decoder and ``decoder_config``, mapping their
own config keys onto those switches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol, cast

import torch
from torch import nn

from tokenmill.layers import ops
from tokenmill.layers.attention import AttentionMetadata, KVCache, PagedAttention
from tokenmill.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    Split,
    VocabParallelEmbedding,
    checkpoint_shape,
    float8_of,
    parameter_name,
    shard_read,
)
from tokenmill.layers.norm import NormParams, RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.loader.model_config import ModelConfig, ModelLoadError, checkpoint_dtype, rope_parameters


def sliding_windows(raw: dict[str, Any], window: int | None, first_sliding: int = 0) -> tuple[int | None, ...]:
    """Each layer's window: by ``layer_types`` where the config lists them, else
    ``window`` on every layer from ``first_sliding`` on; none when ``window`` is None."""
    num_layers = int(raw["num_hidden_layers"])
    if window is None:
        return (None,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types is None:
        return tuple(int(window) if i >= first_sliding else None for i in range(num_layers))
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def decoder_config(
    raw: dict[str, Any], arch: str, *, qkv_bias: bool, o_bias: bool, qk_norm: bool, windows: tuple[int | None, ...]
) -> ModelConfig:
    """The fields every Llama-layout config names alike; the family passes the switches
    its config spells its own way. A missing required field raises KeyError."""
    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    theta, scaling = rope_parameters(raw)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=qk_norm,
        sliding_windows=windows,
        checkpoint_dtype=checkpoint_dtype(raw),
    )


def parse_config(raw: dict[str, Any], arch: str) -> ModelConfig:
    """LlamaForCausalLM and MistralForCausalLM: ``attention_bias`` on q/k/v and o alike;
    Mistral's ``sliding_window`` applies to every layer."""
    bias = bool(raw.get("attention_bias", False))
    return decoder_config(
        raw, arch, qkv_bias=bias, o_bias=bias, qk_norm=False, windows=sliding_windows(raw, raw.get("sliding_window"))
    )


def matrix_rows(param: torch.Tensor) -> int:
    """The rows a parameter's reads must fill (``ShardRead.rows``): its first dimension, or for a stack of
    matrices (a mixture of experts' ``[E, rows, cols]``) the rows of all of them."""
    return param.shape[0] if param.dim() <= 2 else math.prod(param.shape[:-1])


class DecoderAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding,
        norm: Callable[[int, float], nn.Module] = RMSNorm,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        """``norm`` (the per-head q/k norm's class), ``scale`` and ``softcap``: where a family
        (Gemma 3) departs from Llama's RMSNorm and ``head_dim ** -0.5``, uncapped."""
        super().__init__()
        heads, kv_heads = Split(config.num_heads, config.head_dim), Split(config.num_kv_heads, config.head_dim)
        self.head_dim = config.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [heads, kv_heads, kv_heads], bias=config.qkv_bias)
        self.q_size, self.kv_size, _ = self.qkv_proj.part_sizes  # this rank's
        self.o_proj = RowParallelLinear(heads, config.hidden_size, bias=config.o_bias)
        self.q_norm = norm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.attn = PagedAttention(
            self.q_size // config.head_dim,
            self.kv_size // config.head_dim,
            config.head_dim,
            config.sliding_windows[layer],
            rotary,
            scale,
            softcap,
            kv_group=config.kv_layout().layer_group[layer],
        )

    def forward(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        residual: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``qkv``: ``qkv_proj`` of the normed input, which the layer runs fused with the norm. Returns
        the block's output folded into the residual stream (see ``ops.linear_into_stream``)."""
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(tokens, -1, self.head_dim)
        k = k.reshape(tokens, -1, self.head_dim)
        v = v.reshape(tokens, -1, self.head_dim)
        out = self.attn(positions, q, k, v, kv_cache, meta, self.q_norm, self.k_norm)
        return self.o_proj.into_stream(out.reshape(tokens, self.q_size), residual)


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        rows = Split(config.intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [rows, rows], bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(rows, config.hidden_size, bias=config.mlp_bias)

    def forward(self, activation: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``activation``: SiLU-and-multiply of ``gate_up_proj`` of the normed input, which the layer
        runs fused with the norm."""
        return self.down_proj.into_stream(activation, residual)


def norm_linear(
    norm: NormParams,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    linear: nn.Linear,
    gated: bool = False,
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear`` of ``norm``'s output (``ops.norm_linear``: one kernel for one-token decode on the GPU)."""
    return ops.norm_linear(
        x,
        residual,
        norm.weight,
        norm.eps,
        linear.weight,
        linear.bias,
        gated,
        weighting=norm.weighting,
        activation=activation,
    )


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, mlp: nn.Module | None = None) -> None:
        """``mlp``: the layer's own in place of the dense ``GatedMLP`` (a mixture of experts)."""
        super().__init__()
        self.self_attn = DecoderAttention(config, layer, rotary)
        self.mlp = GatedMLP(config) if mlp is None else mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        qkv, residual = norm_linear(self.input_layernorm, x, residual, self.self_attn.qkv_proj)
        x, residual = self.self_attn(positions, qkv, residual, kv_cache, meta)
        return self.feed_forward(x, residual)

    def feed_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's MLP after its norm (a family with another MLP overrides this: models/moe.py)."""
        mlp = cast(GatedMLP, self.mlp)
        activation, residual = norm_linear(self.post_attention_layernorm, x, residual, mlp.gate_up_proj, gated=True)
        return mlp(activation, residual)


LayerFactory = Callable[[ModelConfig, int, RotaryEmbedding], nn.Module]


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, make_layer: LayerFactory | None = None) -> None:
        """``make_layer(config, layer, rotary)``: where a family's layers differ from ``DecoderLayer`` only
        in their MLP (the mixture-of-experts families)."""
        super().__init__()
        make_layer = make_layer or DecoderLayer
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(make_layer(config, i, rotary) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class Decoder(Protocol):
    """The decoder stack under a causal LM's head: ``DecoderModel``, or a family's own; a tied head
    reuses its embedding."""

    @property
    def embed_tokens(self) -> VocabParallelEmbedding: ...

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor: ...


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states of every token;
    ``compute_logits`` runs the head only on the rows that sample (logits pruning)."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model: Decoder = DecoderModel(config, max_positions, self.make_layer)
        self.lm_head = (
            None if config.tie_word_embeddings else VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The model's logits: ``finish_logits_`` of ``head_logits``."""
        return self.finish_logits_(self.head_logits(hidden, out))

    def head_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head's output, before ``finish_logits_``; ``out``: a preallocated ``[rows, vocab]``
        buffer (a CUDA graph's static output)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return head.logits(hidden, out)

    def finish_logits_(self, logits: torch.Tensor) -> torch.Tensor:
        """``head_logits`` to the model's logits, in place. Increasing in every logit, so that a greedy
        token is the head's argmax: the engine applies it only where the values are read (sampling,
        logprobs), not for greedy rows. None here."""
        return logits

    make_layer: LayerFactory | None = None  # DecoderModel's layers: ``DecoderLayer`` unless a family says

    def fused_projections(self, layer: int) -> dict[str, tuple[str, int]]:
        """Which fused parameter, and which of its parts, each of decoder layer ``layer``'s checkpoint
        projections fills: ``name -> (fused name, part)``. The same for every layer here; families whose
        layers differ (Gemma 4) override this."""
        return {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }

    def checkpoint_projections(self, name: str) -> list[str]:
        """The checkpoint's projections that this model's projection ``name`` runs as one matmul (q, k and v
        for ``qkv_proj``; the inverse of ``fused_projections``), or ``name`` alone: the names a
        quantization_config's targets and ignore list use."""
        parts = name.split(".")
        if parts[1:2] == ["layers"]:
            slots = self.fused_projections(int(parts[2]))
            fused = sorted((part, proj) for proj, (target, part) in slots.items() if target == parts[-1])
            if fused:
                return [".".join([*parts[:-1], proj]) for _, proj in fused]
        return [name]

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        """The parameter (its full name as the checkpoint would spell it) that checkpoint tensor ``name``
        fills, and which part of it (``Sharded.shard``'s ``part``; None: the whole). Here: q/k/v and gate/up
        go to their fused projections (``fused_projections``), the rest to their own names."""
        parts = name.split(".")
        slot = self.fused_projections(int(parts[2])).get(parts[-2]) if parts[1:2] == ["layers"] else None
        if slot is None:
            return name, None
        fused_name, part = slot
        return ".".join([*parts[:-2], fused_name, parts[-1]]), part

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy checkpoint tensors (tensors, or safetensors slices, of which only this rank's share is
        read) into the parameters, fusing q/k/v and gate/up; raises if any parameter is left without a value.
        An FP8 layer's values and scales are copied as they are stored; a float8 tensor meant for a dense
        parameter, or the reverse, is a ModelLoadError (the quantization_config does not describe it)."""
        config = self.config
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        filled: dict[str, int] = {}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name.endswith((".k_scale", ".v_scale")):  # a KV-cache calibration: the layer's attention keeps it
                attention = modules.get(name.rsplit(".", 1)[0] + ".attn")
                if attention is None:
                    raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {config.architecture}")
                attention.load_checkpoint_scale(name.rsplit(".", 1)[1], tensor[...])
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            target, part = self.checkpoint_target(name)
            module_name, _, param_name = target.rpartition(".")
            param_name = parameter_name(modules.get(module_name), param_name)
            target = f"{module_name}.{param_name}"
            if target not in params:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {config.architecture}")
            read = shard_read(modules[module_name], param_name, part)
            shape = checkpoint_shape(tensor)
            if not read.fits(shape):
                raise ModelLoadError(f"checkpoint tensor {name!r} has shape {shape}, expected {read.full_shape}")
            stored, held = float8_of(tensor), read.dest.dtype
            if (stored is not None or held == torch.float8_e4m3fn) and stored != held:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} is {stored or 'not float8'}, but {target} holds {held}: the "
                    "checkpoint's quantization_config does not describe it (its scheme, targets or ignore list)"
                )
            read.dest.copy_(read.read(tensor))
            filled[target] = filled.get(target, 0) + read.rows
        missing = [n for n, p in params.items() if filled.get(n, 0) < matrix_rows(p)]
        missing += [
            f"{n}: k_scale or v_scale"
            for n, m in modules.items()
            if isinstance(m, PagedAttention) and m.kv_amax is not None and m.kv_amax.isnan().any()
        ]
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
