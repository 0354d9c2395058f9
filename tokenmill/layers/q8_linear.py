"""Projections whose weights stay in Q8_0 (``kernels/q8_0.py``): about half of bf16's bytes, which
is what one-token decode's time is made of."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import q8_0
from tokenmill.layers.linear import ColumnParallelLinear, PackedLinear, PackedProjection, RowParallelLinear, projections


class Q8Weights(PackedProjection):
    """A linear layer whose weight is kept as Q8_0 buffers (``qweight``, ``scales``): its ``weight``
    is a ``Q8Weight``, which the layer's own forward, the model's code and the fused ops take in
    place of a dense matrix."""

    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    @property
    def weight(self) -> q8_0.Q8Weight:
        return q8_0.Q8Weight(self.qweight, self.scales)


class Q8Linear(Q8Weights, PackedLinear):
    """A plain (not split) ``nn.Linear`` in Q8_0."""

    def __init__(self, weight: q8_0.Q8Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


# (Their ``weight`` is a Q8Weight where nn.Linear's is a Parameter: the point of these classes.)
class Q8ColumnParallelLinear(Q8Weights, ColumnParallelLinear):  # type: ignore[misc]
    """A ``ColumnParallelLinear`` whose rank's rows are in Q8_0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)


class Q8RowParallelLinear(Q8Weights, RowParallelLinear):  # type: ignore[misc]
    """A ``RowParallelLinear`` whose rank's columns are in Q8_0 (whole blocks of 32: its share of K is
    a multiple of 32), summed over the ranks as the dense one is."""


_PACKED = {ColumnParallelLinear: Q8ColumnParallelLinear, RowParallelLinear: Q8RowParallelLinear}


def quantize_linears(model: nn.Module, keep: tuple[str, ...] = ("lm_head",)) -> int:
    """Keep in Q8_0 every linear layer of ``model`` whose rows (on this rank) are a multiple of 32 long,
    but those named in ``keep``, quantized from float32; returns how many. A split layer stays itself,
    its class swapped for its Q8_0 kind (its parts, split and group kept), so its collectives run as
    before; a plain ``nn.Linear`` becomes a ``Q8Linear``."""
    count = 0
    for _, module, child_name, child in projections(model, keep):
        if isinstance(child, Q8Weights) or child.in_features % q8_0.BLOCK:
            continue
        packed = q8_0.quantize(child.weight.data.float())
        if type(child) in _PACKED:
            del child.weight
            child.__class__ = _PACKED[type(child)]
            child.register_buffer("qweight", packed.qweight)
            child.register_buffer("scales", packed.scales)
        else:
            setattr(module, child_name, Q8Linear(packed, None if child.bias is None else child.bias.data))
        count += 1
    return count
