"""Architecture name (config.json ``architectures``) → its family's config parser and model class.

The single list of supported architectures: ``load_model_config`` asks here which family
maps a config, the runner which class to build.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenmill.loader.fp8_checkpoint import checkpoint_quantization
from tokenmill.loader.gguf_checkpoint import is_gguf_file, read_gguf_config
from tokenmill.loader.model_config import ModelConfig, ModelLoadError, as_id_list, read_json
from tokenmill.models import gemma3, gemma4, llama, moe, qwen

ConfigParser = Callable[[dict[str, Any], str], ModelConfig]


@dataclass(frozen=True)
class Family:
    """How a family reads its Hugging Face config, and the module it builds from the result."""

    parse_config: ConfigParser
    model_class: type[llama.LlamaForCausalLM]  # every family's model subclasses it


_LLAMA = Family(llama.parse_config, llama.LlamaForCausalLM)
_QWEN = Family(qwen.parse_config, qwen.QwenForCausalLM)
_QWEN3_MOE = Family(moe.parse_qwen3_moe, moe.MoEForCausalLM)
_MIXTRAL = Family(moe.parse_mixtral, moe.MoEForCausalLM)
_GEMMA3 = Family(gemma3.parse_config, gemma3.Gemma3ForCausalLM)
_GEMMA4 = Family(gemma4.parse_config, gemma4.Gemma4ForCausalLM)

_REGISTRY: dict[str, Family] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _QWEN,
    "Qwen3ForCausalLM": _QWEN,
    "Qwen3MoeForCausalLM": _QWEN3_MOE,
    "MixtralForCausalLM": _MIXTRAL,
    "Gemma3ForCausalLM": _GEMMA3,
    "Gemma3ForConditionalGeneration": _GEMMA3,
    "Gemma4ForCausalLM": _GEMMA4,
    "Gemma4ForConditionalGeneration": _GEMMA4,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_REGISTRY)


def config_parser(architecture: str) -> ConfigParser:
    return _REGISTRY[architecture].parse_config


def model_class(config: ModelConfig) -> type[llama.LlamaForCausalLM]:
    return _REGISTRY[config.architecture].model_class


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse ``config.json`` (its ``text_config`` when it nests one, as multimodal
    checkpoints do; an FP8 checkpoint's ``quantization_config``, checked here before anything is
    built) and ``generation_config.json`` for eos ids, whose list wins."""
    model_dir = Path(model_dir)
    if is_gguf_file(model_dir):  # a single GGUF file: its metadata, as a config.json
        config_path, top = model_dir, read_gguf_config(model_dir)
    else:
        if not model_dir.is_dir():
            raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist")
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(
                f"{model_dir} has no config.json: is it a Hugging Face model directory (or a .gguf file)?"
            )
        top = read_json(config_path)
    archs = top.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"architecture {archs or 'missing'} in {config_path} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    raw = top.get("text_config") or top
    try:
        config = config_parser(arch)(raw, arch)
    except KeyError as exc:  # parsers index the fields they require
        raise ModelLoadError(f"{config_path} lacks the field {exc.args[0]!r}") from exc
    eos = as_id_list(raw.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if model_dir.is_dir() and gen_path.is_file():
        eos = as_id_list(read_json(gen_path).get("eos_token_id")) or eos
    quantization = checkpoint_quantization(top)
    if quantization is not None and config.moe is not None:
        raise ModelLoadError(
            f"{config_path}: FP8 checkpoints of a mixture of experts are not supported yet (no expert kernel "
            "reads FP8 weights): use its bf16 checkpoint, with quantization='fp8' to quantize all but the experts"
        )
    return replace(config, eos_token_ids=tuple(eos), quantization=quantization)
