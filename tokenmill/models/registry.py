"""Architecture name (config.json ``architectures``) → its family's config parser and model class.

The single list of supported architectures: the loader asks here which family
maps a config, the runner which class to build.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from tokenmill.loader.hf_config import ModelConfig
from tokenmill.models import gemma3, gemma4, llama, qwen

ConfigParser = Callable[[dict[str, Any], str], ModelConfig]


@dataclass(frozen=True)
class Family:
    """How a family reads its Hugging Face config, and the module it builds from the result."""

    parse_config: ConfigParser
    model_class: type[nn.Module]


_LLAMA = Family(llama.parse_config, llama.LlamaForCausalLM)
_QWEN = Family(qwen.parse_config, qwen.QwenForCausalLM)
_GEMMA3 = Family(gemma3.parse_config, gemma3.Gemma3ForCausalLM)
_GEMMA4 = Family(gemma4.parse_config, gemma4.Gemma4ForCausalLM)

_REGISTRY: dict[str, Family] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _QWEN,
    "Qwen3ForCausalLM": _QWEN,
    "Gemma3ForCausalLM": _GEMMA3,
    "Gemma3ForConditionalGeneration": _GEMMA3,
    "Gemma4ForCausalLM": _GEMMA4,
    "Gemma4ForConditionalGeneration": _GEMMA4,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_REGISTRY)


def config_parser(architecture: str) -> ConfigParser:
    return _REGISTRY[architecture].parse_config


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    return _REGISTRY[cfg.architecture].model_class
