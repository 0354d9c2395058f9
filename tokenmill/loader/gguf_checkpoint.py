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
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.loader.model_config import ModelLoadError

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

# The GGUF architectures (``general.architecture``) the engine runs, and the Hugging Face class of each
# model_type transformers reads from them: llama.cpp writes Mistral models as "llama" (transformers reads
# one as Mistral only where its ``general.name`` is "mistral"), and a "gemma3" file holds Gemma 3's text
# model alone.
ARCHITECTURES = {
    "llama": {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"},
    "qwen2": {"qwen2": "Qwen2ForCausalLM"},
    "qwen3": {"qwen3": "Qwen3ForCausalLM"},
    "gemma3": {"gemma3_text": "Gemma3ForCausalLM"},
}


def is_gguf_file(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def _open(path: Path) -> GGUFReader:
    """The file's reader (its tensors memory-mapped). A file cut short or corrupt fails inside the reader
    with numpy's complaint about some array: that becomes a ModelLoadError naming the file."""
    from gguf import GGUFReader

    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    try:
        return GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, OverflowError, OSError) as exc:
        raise ModelLoadError(f"{path} is not a GGUF file this engine can read, truncated or corrupt: {exc}") from None


def _field(reader: GGUFReader, key: str) -> Any:
    """One metadata value, or None where the file has none."""
    field = reader.get_field(key)
    return None if field is None else field.contents()


@functools.lru_cache(maxsize=4)
def _hf_config(path: str) -> dict[str, Any]:
    """transformers' reading of the file's metadata, once per file (the config and the weights both need it)."""

    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as exc:  # pragma: no cover - the gguf package is a dependency
        raise ModelLoadError(f"reading GGUF files needs the gguf package: {exc}") from None
    try:
        return load_gguf_checkpoint(path)["config"]
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise ModelLoadError(f"{path}: transformers cannot read its metadata: {exc}") from None


def _transformers_config(path: Path) -> PretrainedConfig:
    """The config ``from_pretrained(..., gguf_file=...)`` builds from the file: its metadata, and the
    config class's defaults for what the file does not state."""
    from transformers import AutoConfig

    config = dict(_hf_config(str(path)))
    return AutoConfig.for_model(config.pop("model_type"), **config)


def read_gguf_config(path: str | Path) -> dict[str, Any]:
    """The file's config as a Hugging Face ``config.json`` would hold it (``architectures`` included).
    transformers' defaults are spelled out, since the engine's own would differ where the file is
    silent (Gemma 3's sliding pattern, local rope base and attention scale, Mistral's window), and
    its tokens must be transformers' on the same file."""

    path = Path(path)
    reader = _open(path)
    architecture = _field(reader, "general.architecture")
    if architecture not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {architecture!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    if _field(reader, f"{architecture}.expert_count"):  # llama.cpp writes Mixtral as "llama" with experts
        raise ModelLoadError(f"{path}: GGUF files of a mixture of experts are not supported (only safetensors)")
    transformers_config = _transformers_config(path)
    config = transformers_config.to_dict()
    config["architectures"] = [ARCHITECTURES[architecture][transformers_config.model_type]]
    # transformers reads no head size for every family (Qwen3's is not hidden / heads): take llama.cpp's.
    head_dim = _field(reader, f"{architecture}.attention.key_length")
    if head_dim is not None:
        config["head_dim"] = int(head_dim)
    if architecture == "gemma3":
        _gemma3_as_llama_cpp_runs_it(reader, config)
    config["dtype"] = config.get("dtype") or "bfloat16"  # what "auto" runs on a GPU (the file's types vary by tensor)
    return config


# Gemma 3 27B (62 layers) scales its queries by hidden / heads before the square root; the other sizes
# by the head size. GGUF states neither: llama.cpp tells them apart by the layer count, as here.
_GEMMA3_27B_LAYERS = 62


def _gemma3_as_llama_cpp_runs_it(reader: GGUFReader, config: dict[str, Any]) -> None:
    """What a Gemma 3 file means that transformers' reading leaves out: the global layers' linear rope
    scaling (``rope.scaling.*``: a factor of 8 on the 4B, 12B and 27B), and the attention scale (its
    default of 256 is wrong for the 27B)."""
    kind, factor = _field(reader, "gemma3.rope.scaling.type"), _field(reader, "gemma3.rope.scaling.factor")
    if kind not in (None, "none"):
        if kind != "linear":
            raise ModelLoadError(f"Gemma 3 GGUF rope scaling {kind!r} is not supported (only linear)")
        rope = dict(config.get("rope_parameters") or {})
        rope["full_attention"] = {**rope.get("full_attention", {}), "rope_type": "linear", "factor": float(factor)}
        config["rope_parameters"] = rope
    heads = config["num_attention_heads"]
    config["query_pre_attn_scalar"] = (
        config["hidden_size"] // heads if config["num_hidden_layers"] == _GEMMA3_27B_LAYERS else config["head_dim"]
    )


def packs_q8_0(path: str | Path) -> bool:
    """Whether the file's layer matrices are Q8_0 (the engine then keeps them packed)."""
    from gguf import GGMLQuantizationType

    return any(
        t.name.startswith("blk.") and t.tensor_type == GGMLQuantizationType.Q8_0 for t in _open(Path(path)).tensors
    )


def iter_gguf_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor, dequantized one at a time from the memory-mapped file, under its Hugging Face
    name (transformers' per-family processing applied: Llama's q/k rows put back in order, Gemma's
    norm offsets…), so host memory holds one tensor beyond the file's pages."""
    import numpy as np
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    path = Path(path)
    parsed = {"config": dict(_hf_config(str(path)))}  # what transformers' tensor processors read
    with torch.device("meta"):  # names only: the file's tensors are mapped onto this model's
        skeleton = AutoModelForCausalLM.from_config(_transformers_config(path))
    reader = _open(path)
    architecture = _field(reader, "general.architecture")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    logger.info(
        "%s: %d tensors (%s), each dequantized to the model's dtype as it loads",
        path.name,
        len(reader.tensors),
        ", ".join(f"{n} {name}" for name, n in types.most_common()),
    )
    # The tensor names of the file's own architecture: transformers would ask gguf for those of its config's
    # model_type, and gguf has no "mistral" (a file read as Mistral holds llama's tensors).
    names = get_gguf_hf_weights_map(skeleton, processor, model_type=architecture)
    for tensor in reader.tensors:
        try:
            weights = dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name!r} of type {tensor.tensor_type.name} cannot be read: {exc}"
            ) from None
        result = processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed
        )
        if result.name in names:
            yield names[result.name], torch.from_numpy(np.array(result.weights))  # a copy: the file is read-only
