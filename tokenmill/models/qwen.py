"""The Qwen family (Qwen2, Qwen3): the Llama decoder under Qwen's config keys.

Qwen2 always has q/k/v bias (and never an output bias); Qwen3 normalises q and k
per head before RoPE. Their ``sliding_window`` is inert unless
``use_sliding_window`` is set, and then covers the layers from
``max_window_layers`` on (or those ``layer_types`` marks).
"""

from __future__ import annotations

from typing import Any

from tokenmill.loader.model_config import ModelConfig
from tokenmill.models.llama import LlamaForCausalLM, decoder_config, sliding_windows


class QwenForCausalLM(LlamaForCausalLM):
    """Same layers and parameter names as Llama; the differences are ModelConfig switches."""


def parse_config(raw: dict[str, Any], arch: str) -> ModelConfig:
    """Qwen2ForCausalLM and Qwen3ForCausalLM."""
    qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(raw.get("attention_bias", False))
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    first_sliding = int(raw.get("max_window_layers", raw["num_hidden_layers"]))
    return decoder_config(
        raw,
        arch,
        qkv_bias=qwen2 or attention_bias,
        o_bias=not qwen2 and attention_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        windows=sliding_windows(raw, window, first_sliding),
    )
