"""GGUF files (llama.cpp's format): the config, weights and tokenizer that a single ``.gguf`` file holds.

``transformers`` reads GGUF with the ``gguf`` package: its metadata becomes a Hugging Face config,
its tensors are dequantized (F32, F16, BF16, Q8_0, the K-quants…) and renamed to the Hugging Face
modules, with llama.cpp's row permutation of q and k undone, and its tokenizer and chat template
are rebuilt. The engine then loads the result as it loads a Hugging Face directory. Weights are
held in float32 while they load: a GGUF file needs about four bytes of host memory per parameter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# What each GGUF architecture is as a Hugging Face text model (the families the engine runs).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def is_gguf_file(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def _checkpoint(path: Path, **options: Any) -> dict[str, Any]:
    from tokenmill.loader.hf_config import ModelLoadError

    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as exc:  # pragma: no cover - the gguf package is a dependency
        raise ModelLoadError(f"reading GGUF files needs the gguf package: {exc}") from None
    try:
        return load_gguf_checkpoint(str(path), **options)
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise ModelLoadError(f"{path} is not a GGUF file this engine can read: {exc}") from None


def read_gguf_config(path: str | Path) -> dict[str, Any]:
    """The file's metadata as a Hugging Face ``config.json`` would hold it (``architectures`` included)."""
    from tokenmill.loader.hf_config import ModelLoadError

    config = dict(_checkpoint(Path(path))["config"])
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {model_type!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")
    config["architectures"] = [ARCHITECTURES[model_type]]
    # transformers reads no head size for every family (Qwen3's is not hidden / heads): take llama.cpp's.
    head_dim = _metadata_int(Path(path), f"{model_type}.attention.key_length")
    if head_dim is not None:
        config["head_dim"] = head_dim
    config.setdefault("dtype", "bfloat16")  # what dtype="auto" runs on a GPU (the file's types vary by tensor)
    return config


def _metadata_int(path: Path, key: str) -> int | None:
    """One integer of the file's metadata, or None where it has none."""
    import gguf

    field = gguf.GGUFReader(str(path)).get_field(key)
    return None if field is None else int(field.contents())


def iter_gguf_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor, dequantized, under its Hugging Face name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = read_gguf_config(path)
    config.pop("architectures")
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):  # names only: transformers maps the file's tensors onto a model's
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    tensors = _checkpoint(Path(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    while tensors:
        name = next(iter(tensors))
        yield name, torch.as_tensor(tensors.pop(name))
