"""Architecture name (config.json ``architectures``) → model class."""

from __future__ import annotations

from torch import nn

from tokenmill.loader.hf_config import SUPPORTED_ARCHITECTURES, ModelConfig
from tokenmill.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    return _REGISTRY[cfg.architecture]
