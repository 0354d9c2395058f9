"""Projections whose weights stay in FP8 (``kernels/fp8.py``): float8 e4m3 values with float32 scales,
read from an FP8 checkpoint as they are stored (``load_as_fp8``, before the weights load) or
quantized from a dense one (``quantize_linears_fp8``, ``quantization="fp8"``).

A split layer keeps its class's behaviour under its FP8 kind, as the Q8_0 ones do, and says which
part of each checkpoint tensor its rank holds: the rows (column-parallel) or input columns
(row-parallel) of the values, and the scales that go with them. Scales are held one per row (and
block of 128 input columns), so any split of rows carries its own; a row-parallel split of a
block-wise layer must fall on block boundaries, or a rank would hold part of a block's columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn

from tokenmill.kernels import fp8
from tokenmill.kernels.fp8 import FP8Scheme, FP8Weight
from tokenmill.layers.linear import (
    ColumnParallelLinear,
    PackedLinear,
    PackedProjection,
    RowParallelLinear,
    ScalarRead,
    Sharded,
    ShardRead,
    projections,
)


@dataclass(frozen=True)
class BlockScaleRead(ShardRead):
    """A block-wise checkpoint's scales ``[row blocks, column blocks]``: ``index`` the blocks covering the
    rank's rows and columns, each row block's scales repeated over its ``block_rows`` rows, from row
    ``skip`` of the first block."""

    block_rows: int
    skip: int

    def read(self, source: Any) -> torch.Tensor:
        return source[self.index].repeat_interleave(self.block_rows, dim=0)[self.skip : self.skip + self.rows]


class FP8Weights(Sharded, PackedProjection):
    """A linear layer whose weight is kept as FP8 parameters: ``qweight`` (float8 e4m3 ``[N, K]``),
    ``weight_scale`` (float32, one per row and block of input columns) and, for static activations,
    ``input_scale`` (one per fused part). Its ``weight`` is an ``FP8Weight``, which the projection ops
    take in place of a dense matrix. ``scheme``: the checkpoint's (None: quantized here, one scale per
    row, activations per token)."""

    qweight: nn.Parameter
    weight_scale: nn.Parameter
    input_scale: nn.Parameter | None
    bias: nn.Parameter | None
    scheme: FP8Scheme | None
    shape_on_rank: tuple[int, int]  # [N, K] of this rank's share

    # Checkpoints keep the FP8 values under ``weight``; block-wise ones of quant_method "fp8" call their
    # scales ``weight_scale_inv`` (the inverse of the quantizing scale: a multiplier, as every scale here).
    _PARAMETERS: ClassVar[dict[str, str]] = {"weight": "qweight", "weight_scale_inv": "weight_scale"}

    @property
    def weight(self) -> FP8Weight:
        return FP8Weight(self.qweight, self.weight_scale, self.column_block, self.input_scale)

    @property
    def column_block(self) -> int | None:
        """The input columns that share a weight scale (and an activation scale); None: the whole row."""
        return None if self.scheme is None or self.scheme.block is None else self.scheme.block[1]

    def parameter(self, checkpoint_name: str) -> str:
        return self._PARAMETERS.get(checkpoint_name, checkpoint_name)

    def checkpoint_rows(self, part: int) -> tuple[int, slice, int]:
        """For fused part ``part``: the first of its rows in this layer, the checkpoint rows they are,
        and the checkpoint tensor's row count. The layer's own rows, whole, unless it splits them."""
        n = self.shape_on_rank[0]
        return 0, slice(0, n), n

    def checkpoint_columns(self) -> tuple[slice, int]:
        """The checkpoint columns this layer holds, and the checkpoint tensor's column count."""
        k = self.shape_on_rank[1]
        return slice(0, k), k

    def shard(self, param: str, part: int | None) -> ShardRead:
        first, rows, full_rows = self.checkpoint_rows(part or 0)
        n = rows.stop - rows.start
        if param == "bias":
            assert self.bias is not None
            return ShardRead(self.bias.data.narrow(0, first, n), (full_rows,), (rows,), n)
        if param == "input_scale":
            assert self.input_scale is not None
            return ScalarRead(self.input_scale.data.narrow(0, part or 0, 1), (1,), ..., 1)
        columns, full_columns = self.checkpoint_columns()
        if param == "qweight":
            return ShardRead(self.qweight.data.narrow(0, first, n), (full_rows, full_columns), (rows, columns), n)
        dest = self.weight_scale.data.narrow(0, first, n)
        assert param == "weight_scale" and self.scheme is not None  # the load checks the name first
        if self.scheme.weight == "tensor":
            return ScalarRead(dest, (1,), ..., n)
        if self.scheme.weight == "channel":
            return ShardRead(dest, (full_rows, 1), (rows,), n)
        block_rows, block_columns = fp8.BLOCK_SHAPE
        row_blocks = slice(rows.start // block_rows, -(-rows.stop // block_rows))
        column_blocks = slice(columns.start // block_columns, -(-columns.stop // block_columns))
        full = (-(-full_rows // block_rows), -(-full_columns // block_columns))
        skip = rows.start - row_blocks.start * block_rows
        return BlockScaleRead(dest, full, (row_blocks, column_blocks), n, block_rows, skip)

    def hold_fp8(self, weight: FP8Weight | None, parts: int, device: torch.device) -> None:
        """Register the FP8 parameters: ``weight``'s, or empty ones of this layer's shape for a checkpoint
        to fill (with an ``input_scale`` for each of ``parts`` where the scheme's activations are static)."""
        if weight is None:
            n, k = self.shape_on_rank
            block = self.column_block
            qweight = torch.empty(n, k, dtype=fp8.FP8_DTYPE, device=device)
            scales = torch.empty(n, 1 if block is None else -(-k // block), dtype=torch.float32, device=device)
            weight = FP8Weight(qweight, scales, block)
        self.qweight = nn.Parameter(weight.qweight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight.scales, requires_grad=False)
        static = self.scheme is not None and self.scheme.static_input
        self.input_scale = (
            nn.Parameter(torch.empty(parts, dtype=torch.float32, device=device), requires_grad=False)
            if static
            else None
        )


class FP8Linear(FP8Weights, PackedLinear):
    """A plain (not split) ``nn.Linear`` in FP8."""

    def __init__(self, shape: tuple[int, int], bias: torch.Tensor | None, scheme: FP8Scheme | None) -> None:
        super().__init__()
        self.shape_on_rank = shape
        self.scheme = scheme
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


# (Their ``weight`` is an FP8Weight where nn.Linear's is a Parameter: the point of these classes.)
class FP8ColumnParallelLinear(FP8Weights, ColumnParallelLinear):  # type: ignore[misc]
    """A ``ColumnParallelLinear`` whose rank's rows are in FP8."""

    def checkpoint_rows(self, part: int) -> tuple[int, slice, int]:
        return sum(self.part_sizes[:part]), self.parts[part].local_slice(self.tp), self.parts[part].size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)


class FP8RowParallelLinear(FP8Weights, RowParallelLinear):  # type: ignore[misc]
    """A ``RowParallelLinear`` whose rank's input columns are in FP8, summed over the ranks as the dense
    one is (whole blocks of 128 columns on each rank, for block-wise weights)."""

    def checkpoint_columns(self) -> tuple[slice, int]:
        return self.split.local_slice(self.tp), self.split.size


_FP8_KINDS: dict[type, type] = {ColumnParallelLinear: FP8ColumnParallelLinear, RowParallelLinear: FP8RowParallelLinear}


def _to_fp8(
    name: str,
    parent: nn.Module,
    attribute: str,
    layer: nn.Linear,
    scheme: FP8Scheme | None,
    weight: FP8Weight | None,
    device: torch.device,
) -> None:
    """Replace ``layer`` (``parent.attribute``) by its FP8 kind holding ``weight`` (None: empty on ``device``,
    for a checkpoint to fill). A block-wise layer whose rank holds part of a block's input columns is a
    ValueError."""
    shape = (layer.out_features, layer.in_features)
    if type(layer) in _FP8_KINDS:
        del layer.weight
        layer.__class__ = _FP8_KINDS[type(layer)]
        fp8_layer = cast(FP8Weights, layer)  # its class is now the FP8 kind
        fp8_layer.scheme, fp8_layer.shape_on_rank = scheme, shape
        parts = len(layer.parts) if isinstance(layer, ColumnParallelLinear) else 1
    else:
        fp8_layer = FP8Linear(shape, None if layer.bias is None else layer.bias.data, scheme)
        setattr(parent, attribute, fp8_layer)
        parts = 1
    block = fp8_layer.column_block
    columns, full = fp8_layer.checkpoint_columns()
    if block is not None and (columns.start % block or (columns.stop % block and columns.stop != full)):
        raise ValueError(
            f"{name}: block-wise FP8 weights need each rank's share of the input columns to be whole blocks of "
            f"{block}, but this rank holds columns {columns.start}:{columns.stop} of {full}; use a "
            "tensor_parallel_size that splits them on block boundaries"
        )
    fp8_layer.hold_fp8(weight, parts, device)


def load_as_fp8(model: nn.Module, scheme: FP8Scheme, quantized: Callable[[str], bool], device: torch.device) -> int:
    """Before an FP8 checkpoint loads: every projection of ``model`` that it stores in FP8 (``quantized``
    of the layer's name; the LM head never) becomes its FP8 kind with empty parameters of this rank's
    shape on ``device``, which the checkpoint's values and scales then fill as they are stored. Returns
    how many."""
    chosen = [p for p in projections(model, keep=("lm_head",)) if quantized(p[0])]
    for name, parent, attribute, layer in chosen:
        _to_fp8(name, parent, attribute, layer, scheme, None, device)
    return len(chosen)


def quantize_linears_fp8(model: nn.Module, keep: tuple[str, ...] = ("lm_head",)) -> int:
    """``quantization="fp8"``: every projection of ``model`` (this rank's share of it) but those named in
    ``keep`` kept in FP8, one scale per output row, its activations quantized per token. Returns how many."""
    count = 0
    for name, parent, attribute, layer in projections(model, keep):
        if not isinstance(layer, FP8Weights):
            _to_fp8(name, parent, attribute, layer, None, fp8.quantize_rows(layer.weight.data), layer.weight.device)
            count += 1
    return count
