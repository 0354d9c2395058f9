"""Real architecture shapes for benchmarks with random weights (speed does not
depend on the weights' values), and the byte and FLOP counts of their steps."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from tokenmill.loader.hf_config import ModelConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500000.0}

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=131072, rope_parameters=_LLAMA3_ROPE, tie_word_embeddings=False),
    "llama3.2-1b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        vocab_size=128256, max_position_embeddings=131072,
                        rope_parameters={**_LLAMA3_ROPE, "factor": 32.0}, tie_word_embeddings=True),
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=8192, rope_theta=1000000.0,
                       tie_word_embeddings=True),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, max_position_embeddings=8192, rope_theta=1000000.0,
                     tie_word_embeddings=False),
    "mistral-7b": dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                       max_position_embeddings=8192, rope_theta=10000.0, sliding_window=4096,
                       tie_word_embeddings=False),
}


def shape_dir(name: str) -> Path:
    """A model directory holding only ``config.json`` (bf16) for a random-weight engine."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    path = Path(tempfile.mkdtemp(prefix=f"tokenmill-{name}-"))
    (path / "config.json").write_text(json.dumps({**SHAPES[name], "rms_norm_eps": 1e-5, "dtype": "bfloat16"}))
    return path


def linear_params(cfg: ModelConfig) -> int:
    """Parameters every token multiplies through: projections, MLP and the LM head."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size


def weight_bytes_per_step(cfg: ModelConfig, elem: int = 2) -> int:
    """Bytes a decode step must read once: every linear weight and the LM head (the
    embedding table is only gathered row by row, norms are negligible)."""
    return linear_params(cfg) * elem


def step_cost(cfg: ModelConfig, query_lens: list[int], context_lens: list[int], sampled_rows: int,
              dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    """(bytes, FLOPs) a step must at least move and compute: weights once, the KV of every
    context read once and the new K/V written; GEMMs over the step's tokens (LM head only
    on sampled rows) and attention over each query's causal context."""
    tokens = sum(query_lens)
    kv_tok = cfg.kv_layout().bytes_per_token(dtype)
    bytes_ = weight_bytes_per_step(cfg, dtype.itemsize) + kv_tok * (sum(context_lens) + tokens)
    body = linear_params(cfg) - cfg.vocab_size * cfg.hidden_size
    flops = 2.0 * tokens * body + 2.0 * sampled_rows * cfg.vocab_size * cfg.hidden_size
    attn = 0.0
    for q, ctx in zip(query_lens, context_lens):
        attn += q * (ctx - (q - 1) / 2)  # mean causal context of the query's tokens
    flops += 4.0 * attn * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return bytes_, flops
