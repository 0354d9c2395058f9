"""Projections and embeddings split across tensor-parallel ranks (whole with one rank).

Column-parallel layers (q/k/v, gate/up) hold some of the output rows and need no communication;
row-parallel layers (o, down) hold the matching input columns, and their partial outputs are
summed by one all-reduce; a vocabulary-parallel embedding holds a run of vocabulary rows (a token's
row lives on one rank; the all-reduce brings it to all), and as the LM head the same rows, whose
logits are gathered. So a model built from these layers is split by construction.

Each layer also says which slice of a checkpoint tensor it holds (``shard``), so the loader reads
that slice alone and no rank materialises the whole model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from types import EllipsisType
from typing import Any

import torch
from torch import nn

from tokenmill.distributed import (
    TPGroup,
    all_gather,
    all_reduce,
    current_group,
    first_unit,
    units_per_rank,
)
from tokenmill.layers import ops


@dataclass(frozen=True)
class Split:
    """``units`` blocks of ``unit`` rows each (attention heads of ``head_dim``, or single rows),
    divided among the ranks as ``distributed.sharding`` says."""

    units: int
    unit: int = 1

    @property
    def size(self) -> int:
        return self.units * self.unit

    def local_size(self, tp: TPGroup) -> int:
        return units_per_rank(self.units, tp.size) * self.unit

    def local_slice(self, tp: TPGroup) -> slice:
        start = first_unit(self.units, tp.rank, tp.size) * self.unit
        return slice(start, start + self.local_size(tp))


@dataclass(frozen=True)
class ShardRead:
    """What a parameter takes from its checkpoint tensor (of ``full_shape``): ``index`` of it,
    copied into ``dest``; ``rows`` of the parameter it fills (padding included)."""

    dest: torch.Tensor
    full_shape: tuple[int, ...]
    index: tuple[slice, ...] | EllipsisType
    rows: int

    def read(self, source: Any) -> torch.Tensor:
        """``source``: a tensor, or a safetensors slice (read from disk only where indexed)."""
        return source[self.index]

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a checkpoint tensor of ``shape`` is the one this read expects."""
        return shape == self.full_shape


@dataclass(frozen=True)
class ScalarRead(ShardRead):
    """A one-value checkpoint tensor (a per-tensor scale: shape ``[]`` or ``[1]``), copied into every row
    of ``dest``."""

    def fits(self, shape: tuple[int, ...]) -> bool:
        return math.prod(shape) == 1


def whole(param: torch.Tensor) -> ShardRead:
    return ShardRead(param.data, tuple(param.shape), ..., param.shape[0] if param.dim() else 1)


class Sharded:
    """A layer whose parameters hold only this rank's share of the checkpoint's."""

    def shard(self, param: str, part: int | None) -> ShardRead:
        """The read that fills parameter ``param`` (``weight`` or ``bias``) from the checkpoint tensor of
        fused part ``part`` (q, k, v; gate, up; None where the layer fuses nothing)."""
        raise NotImplementedError

    def parameter(self, checkpoint_name: str) -> str:
        """The parameter a checkpoint tensor of this name (``weight``, ``bias``...) fills: its own name,
        unless a layer keeps it under another (an FP8 layer's values, ``qweight``)."""
        return checkpoint_name


# Where projections built now put their weights and biases: None, the default device; "meta" inside
# ``projections_deferred``.
_PROJECTION_DEVICE: ContextVar[str | None] = ContextVar("projection_device", default=None)


@contextlib.contextmanager
def projections_deferred() -> Iterator[None]:
    """Projections built inside hold their weights and biases on the meta device, allocating nothing: a
    checkpoint that stores them packed (FP8) replaces them before it loads, so a model that fits only
    packed never holds its dense projections. ``materialize`` gives what stays dense its memory."""
    token = _PROJECTION_DEVICE.set("meta")
    try:
        yield
    finally:
        _PROJECTION_DEVICE.reset(token)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Every parameter of ``model`` still on the meta device made an empty one on ``device`` (for the
    checkpoint to fill)."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                setattr(module, name, nn.Parameter(torch.empty_like(param, device=device), requires_grad=False))


class ColumnParallelLinear(nn.Linear, Sharded):
    """Output rows split. ``parts`` are the projections fused into this one matmul (q, k, v; gate, up),
    each divided among the ranks on its own, so each rank's output is its own q | k | v (gate | up)."""

    def __init__(self, in_features: int, parts: Sequence[Split], bias: bool) -> None:
        self.tp = current_group()
        self.parts = tuple(parts)
        super().__init__(in_features, sum(self.part_sizes), bias=bias, device=_PROJECTION_DEVICE.get())

    @property
    def part_sizes(self) -> list[int]:
        """The rows of each part on this rank."""
        return [p.local_size(self.tp) for p in self.parts]

    def shard(self, param: str, part: int | None) -> ShardRead:
        part = part or 0
        rows = self.part_sizes[part]
        dest = getattr(self, param).data.narrow(0, sum(self.part_sizes[:part]), rows)
        return ShardRead(dest, (self.parts[part].size, *dest.shape[1:]), (self.parts[part].local_slice(self.tp),), rows)


class RowParallelLinear(nn.Linear, Sharded):
    """Input columns split as ``split`` (the heads or rows of the column-parallel layer before it);
    the ranks' partial outputs are summed by one all-reduce, and the bias added once."""

    def __init__(self, split: Split, out_features: int, bias: bool) -> None:
        self.tp = current_group()
        self.split = split
        super().__init__(split.local_size(self.tp), out_features, bias=bias, device=_PROJECTION_DEVICE.get())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return ops.linear(x, self.weight, self.bias)
        out = all_reduce(ops.linear(x, self.weight, None), self.tp)
        return out if self.bias is None else out + self.bias

    def into_stream(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``ops.linear_into_stream`` over the ranks. Where one kernel projects and adds the residual
        (one-token decode on the GPU), rank 0 adds it (and the bias) and the others only project, so
        the all-reduced sum is the new stream, whole, and the next norm can fuse with its projection."""
        if self.tp.size == 1:
            return ops.linear_into_stream(x, self.weight, self.bias, residual)
        if not ops.fuses_residual(x, self.weight):
            return self(x), residual
        if self.tp.rank == 0:
            partial = ops.linear_into_stream(x, self.weight, self.bias, residual)[0]
        else:
            partial = ops.linear(x, self.weight, None)
        return all_reduce(partial, self.tp), None

    def shard(self, param: str, part: int | None) -> ShardRead:
        if param == "bias":
            return whole(self.bias)
        return ShardRead(
            self.weight.data,
            (self.out_features, self.split.size),
            (slice(None), self.split.local_slice(self.tp)),
            self.out_features,
        )


class PackedProjection:
    """A linear layer whose ``weight`` is a packed form (``Q8Weight``, ``FP8Weight``) that the projection
    ops take in place of a dense matrix, where ``nn.Linear``'s forward takes none; ``qweight`` holds its
    values ``[N, K]``."""

    qweight: torch.Tensor
    bias: torch.Tensor | None

    @property
    def weight(self) -> Any:
        raise NotImplementedError

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` over any leading dimensions."""
        shape = x.shape
        return ops.linear(x.reshape(-1, shape[-1]), self.weight, self.bias).reshape(*shape[:-1], -1)


class PackedLinear(PackedProjection, nn.Module):
    """A plain (not split) ``nn.Linear`` with a packed weight."""

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)


class ReplicatedLinear(nn.Linear):
    """A projection every rank holds whole (Gemma 4's small per-layer-input projections), run through
    ``ops.linear`` as the split ones are (``nn.Linear``'s forward would take cuBLAS at every row count)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class VocabParallelEmbedding(nn.Embedding, Sharded):
    """Vocabulary rows split: each rank holds ``ceil(vocab / size)`` rows from ``vocab_start`` (the
    last rank's tail is padding). As an embedding, each token's row comes from the rank holding it
    (the others give zeros) and one all-reduce brings it to all; as an LM head (``logits``), each
    rank scores its rows and the logits are gathered."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        self.tp = current_group()
        self.vocab_size = vocab_size
        rows = -(-vocab_size // self.tp.size)
        self.vocab_start = self.tp.rank * rows
        self.num_valid = max(0, min(rows, vocab_size - self.vocab_start))
        super().__init__(rows, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.num_valid)
        out = nn.functional.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return all_reduce(out.masked_fill_(elsewhere.unsqueeze(-1), 0), self.tp)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[rows, vocab]`` scores of ``hidden``; ``out``: a preallocated buffer (a CUDA graph's static output)."""
        if self.tp.size == 1:
            return (
                nn.functional.linear(hidden, self.weight) if out is None else torch.mm(hidden, self.weight.t(), out=out)
            )
        logits = all_gather(nn.functional.linear(hidden, self.weight), self.tp)[:, : self.vocab_size]
        return logits if out is None else out.copy_(logits)

    def shard(self, param: str, part: int | None) -> ShardRead:
        dest = self.weight.data[: self.num_valid]
        return ShardRead(
            dest,
            (self.vocab_size, self.embedding_dim),
            (slice(self.vocab_start, self.vocab_start + self.num_valid),),
            self.num_embeddings,
        )


def parameter_name(module: nn.Module | None, checkpoint_name: str) -> str:
    """The parameter of ``module`` that a checkpoint tensor named ``checkpoint_name`` fills (``Sharded.parameter``)."""
    return module.parameter(checkpoint_name) if isinstance(module, Sharded) else checkpoint_name


def shard_read(module: nn.Module, param: str, part: int | None) -> ShardRead:
    """How parameter ``param`` of ``module`` is filled: its layer's shard, or the whole tensor."""
    if isinstance(module, Sharded):
        return module.shard(param, part)
    return whole(getattr(module, param))


def checkpoint_shape(source: Any) -> tuple[int, ...]:
    """The shape of a checkpoint tensor: a tensor, or a safetensors slice not read yet."""
    return tuple(source.shape) if isinstance(source, torch.Tensor) else tuple(source.get_shape())


_FLOAT8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def float8_of(source: Any) -> torch.dtype | None:
    """The float8 dtype of a checkpoint tensor (a tensor, or a safetensors slice), None for any other dtype."""
    if isinstance(source, torch.Tensor):
        return source.dtype if source.dtype in _FLOAT8.values() else None
    return _FLOAT8.get(source.get_dtype())


def projections(model: nn.Module, keep: tuple[str, ...]) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """Every ``nn.Linear`` of ``model`` but those named in ``keep`` (by attribute or full name), as
    ``(full name, parent, attribute, layer)``: what a quantization replaces (the embeddings and a
    ``VocabParallelEmbedding`` head are no ``nn.Linear``, so they stay as they are)."""
    found = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and child_name not in keep and full not in keep:
                found.append((full, module, child_name, child))
    return found
