"""Real architecture shapes for benchmarks with random weights (speed does not
depend on the weights' values), and the byte and FLOP counts of their steps."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tokenmill.layers.fp8_linear import FP8Weights
from tokenmill.layers.q8_linear import Q8Weights
from tokenmill.loader.kv_layout import KVLayout
from tokenmill.loader.model_config import ModelConfig

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}

_GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}
_GEMMA4_ROPE = {
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_parameters=_LLAMA3_ROPE,
        tie_word_embeddings=False,
    ),
    "llama3-70b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_parameters=_LLAMA3_ROPE,
        tie_word_embeddings=False,
    ),
    "llama3.2-1b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_parameters={**_LLAMA3_ROPE, "factor": 32.0},
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    "mistral-7b": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=32768,
        rope_theta=10000.0,
        sliding_window=4096,
        tie_word_embeddings=False,
    ),
    "gemma3-4b": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=34,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=1024,
        vocab_size=262208,
        max_position_embeddings=131072,
        rope_parameters=_GEMMA3_ROPE,
        tie_word_embeddings=True,
    ),
    "gemma3-27b": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=62,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        query_pre_attn_scalar=168,
        sliding_window=1024,
        vocab_size=262208,
        max_position_embeddings=131072,
        rope_parameters=_GEMMA3_ROPE,
        tie_word_embeddings=True,
    ),
    "gemma4-e4b": dict(
        architectures=["Gemma4ForCausalLM"],
        model_type="gemma4_text",
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=42,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        global_head_dim=512,
        sliding_window=512,
        vocab_size=262144,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7,
        num_kv_shared_layers=18,
        hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262144,
        attention_k_eq_v=False,
        use_double_wide_mlp=False,
        final_logit_softcapping=30.0,
        max_position_embeddings=131072,
        rope_parameters=_GEMMA4_ROPE,
        tie_word_embeddings=True,
    ),
    "gemma4-31b": dict(
        architectures=["Gemma4ForCausalLM"],
        model_type="gemma4_text",
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=60,
        num_attention_heads=32,
        num_key_value_heads=16,
        num_global_key_value_heads=4,
        head_dim=256,
        global_head_dim=512,
        sliding_window=1024,
        vocab_size=262144,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        use_double_wide_mlp=False,
        final_logit_softcapping=30.0,
        max_position_embeddings=262144,
        rope_parameters=_GEMMA4_ROPE,
        tie_word_embeddings=True,
    ),
}


def shape_dir(name: str) -> Path:
    """A model directory holding only ``config.json`` (bf16) for a random-weight engine."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    path = Path(tempfile.mkdtemp(prefix=f"tokenmill-{name}-"))
    (path / "config.json").write_text(json.dumps({**SHAPES[name], "rms_norm_eps": 1e-5, "dtype": "bfloat16"}))
    return path


class StepCost(NamedTuple):
    """What a step must move and compute: ``bytes`` read and written, ``flops`` at the 16-bit matrix
    rate and ``fp8_flops`` at the FP8 one (FP8 projections' products)."""

    bytes: float
    flops: float
    fp8_flops: float = 0.0


@dataclass(frozen=True)
class StepCostModel:
    """What a step of one model must at least move and compute, counted from the built model:
    ``body_params`` the decoder's projection weights (every ``nn.Linear`` but the LM head),
    ``head_params`` the LM head's (the tied embedding where there is none)."""

    body_params: int
    head_params: int
    num_heads: int
    layout: KVLayout
    q8_params: int = 0  # of body_params, those kept in Q8_0 (1 byte and 1/16 of a scale's 2 each)
    fp8_params: int = 0  # of body_params, those kept in FP8 (1 byte each; their scales are negligible)
    split: int = 1  # the GPUs a tensor-parallel step is spread over: each moves and computes its share

    @classmethod
    def of(cls, model: torch.nn.Module, cfg: ModelConfig) -> StepCostModel:
        lm_head = getattr(model, "lm_head", None)
        dense = sum(
            m.weight.numel()
            for m in model.modules()
            if isinstance(m, torch.nn.Linear) and not isinstance(m, (Q8Weights, FP8Weights)) and m is not lm_head
        )
        q8 = sum(m.qweight.numel() for m in model.modules() if isinstance(m, Q8Weights))
        fp8 = sum(m.qweight.numel() for m in model.modules() if isinstance(m, FP8Weights))
        return cls(dense + q8 + fp8, cfg.vocab_size * cfg.hidden_size, cfg.num_heads, cfg.kv_layout(), q8, fp8)

    def weight_bytes(self, elem: int = 2) -> float:
        """Bytes a decode step reads once: every projection and the LM head (the embedding
        tables are gathered row by row, norms are negligible)."""
        dense = self.body_params - self.q8_params - self.fp8_params + self.head_params
        return dense * elem + self.q8_params * (1 + 2 / 32) + self.fp8_params

    def step(
        self,
        query_lens: list[int],
        context_lens: list[int],
        sampled_rows: int,
        dtype: torch.dtype = torch.bfloat16,
        kv_dtype: torch.dtype | None = None,
    ) -> StepCost:
        """The cost of a step: weights once (in ``dtype``); each layer reads the KV its window can
        see of every context and each cache-owning layer writes the new K/V (in ``kv_dtype``, with its
        scales where quantized; None: ``dtype``); GEMMs over the step's tokens (the LM head only on
        sampled rows) and attention over each query's visible context."""
        kv_dtype = kv_dtype or dtype
        tokens = sum(query_lens)
        kv_bytes, attn = 0.0, 0.0
        for i, spec in enumerate(self.layout.layers):
            window = spec.sliding_window
            seen = sum(ctx if window is None else min(ctx, window) for ctx in context_lens)
            kv_bytes += spec.bytes_per_token(kv_dtype) * (seen + (tokens if self.layout.source[i] == i else 0))
            for q, ctx in zip(query_lens, context_lens):
                mean_context = ctx - (q - 1) / 2  # over the query's causal positions
                attn += q * (mean_context if window is None else min(mean_context, window)) * spec.head_dim
        fp8_flops = 2.0 * tokens * self.fp8_params
        flops = 2.0 * tokens * (self.body_params - self.fp8_params) + 2.0 * sampled_rows * self.head_params
        flops += 4.0 * attn * self.num_heads
        return StepCost(
            (self.weight_bytes(dtype.itemsize) + kv_bytes) / self.split, flops / self.split, fp8_flops / self.split
        )
