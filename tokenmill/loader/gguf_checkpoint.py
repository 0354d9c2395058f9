"""GGUF files (llama.cpp's format): the config, weights and tokenizer that a single ``.gguf`` file holds.

``transformers`` reads GGUF with the ``gguf`` package: its metadata becomes a Hugging Face config,
its tensors are dequantized (F32, F16, BF16, Q8_0, the K-quants…) one at a time and renamed to
the Hugging Face modules, with llama.cpp's row permutation of q and k undone, and its tokenizer
and chat template are rebuilt. The engine then loads the result as it loads a Hugging Face
directory.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

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


@functools.lru_cache(maxsize=4)
def _hf_config(path: str) -> dict[str, Any]:
    """transformers' reading of the file's metadata, once per file (the config and the weights both need it)."""
    return _checkpoint(Path(path))["config"]


def read_gguf_config(path: str | Path) -> dict[str, Any]:
    """The file's metadata as a Hugging Face ``config.json`` would hold it (``architectures`` included)."""
    from tokenmill.loader.hf_config import ModelLoadError

    config = dict(_hf_config(str(path)))
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


def packs_q8_0(path: str | Path) -> bool:
    """Whether the file's layer matrices are Q8_0 (the engine then keeps them packed)."""
    from gguf import GGMLQuantizationType, GGUFReader

    return any(t.name.startswith("blk.") and t.tensor_type == GGMLQuantizationType.Q8_0
               for t in GGUFReader(str(path)).tensors)


def _metadata_int(path: Path, key: str) -> int | None:
    """One integer of the file's metadata, or None where it has none."""
    import gguf

    field = gguf.GGUFReader(str(path)).get_field(key)
    return None if field is None else int(field.contents())


def iter_gguf_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor, dequantized one at a time from the memory-mapped file, under its Hugging Face
    name (transformers' per-family processing applied: Llama's q/k rows put back in order, Gemma's
    norm offsets…), so host memory holds one tensor beyond the file's pages."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    from tokenmill.loader.hf_config import ModelLoadError

    path = Path(path)
    parsed = {"config": dict(_hf_config(str(path)))}  # what transformers' tensor processors read
    config = dict(parsed["config"])
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):  # names only: the file's tensors are mapped onto this model's
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    reader = GGUFReader(str(path))
    architecture = str(reader.get_field("general.architecture").contents())
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    logger.info("%s: %d tensors (%s), each dequantized to the model's dtype as it loads", path.name,
                len(reader.tensors), ", ".join(f"{n} {name}" for name, n in types.most_common()))
    names = get_gguf_hf_weights_map(skeleton, processor)
    for tensor in reader.tensors:
        try:
            weights = dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} of type {tensor.tensor_type.name} cannot be "
                                 f"read: {exc}") from None
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=names,
                                   parsed_parameters=parsed)
        if result.name in names:
            yield names[result.name], torch.from_numpy(np.array(result.weights))  # a copy: the file is read-only
