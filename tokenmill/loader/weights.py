"""Reads safetensors checkpoints, single-file or sharded with an index."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tokenmill.loader.gguf_checkpoint import is_gguf_file, iter_gguf_checkpoint
from tokenmill.loader.model_config import ModelLoadError, read_json


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a directory, in the order the index names them."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map", {}) if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise ModelLoadError(f"{index} must hold a weight_map object of tensor names to shard file names")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor | Any]]:
    """Every tensor of the checkpoint (a directory of safetensors, or a GGUF file), one at a time.
    A safetensors tensor comes as a slice not read yet (``get_shape()``, indexing reads): a rank of a
    tensor-parallel engine reads only its share, and peak memory stays one tensor."""
    if is_gguf_file(model_dir):
        yield from iter_gguf_checkpoint(model_dir)
        return
    for path in checkpoint_files(model_dir):
        try:  # the library checks the whole header as the file opens: a file cut short, bytes that are no
            # header, tensors whose offsets do not cover the file or do not fit their shapes and dtypes
            file = safe_open(str(path), framework="pt")
        except SafetensorError as exc:
            raise ModelLoadError(
                f"{path} is not a safetensors file this engine can read, truncated or corrupt: {exc}"
            ) from None
        with file as f:
            for name in f.keys():
                yield name, f.get_slice(name)
