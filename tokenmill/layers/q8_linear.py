"""Projections whose weights stay in Q8_0 (``kernels/q8_0.py``): about half of bf16's bytes, which
is what one-token decode's time is made of."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import q8_0
from tokenmill.layers import ops


class Q8Linear(nn.Module):
    """An ``nn.Linear`` whose ``weight`` is a ``Q8Weight``: the model's code calls it, or hands its
    ``weight`` to the fused ops, as it would a dense one."""

    def __init__(self, weight: q8_0.Q8Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def weight(self) -> q8_0.Q8Weight:
        return q8_0.Q8Weight(self.qweight, self.scales)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return ops.linear(x.reshape(-1, shape[-1]), self.weight, self.bias).reshape(*shape[:-1], -1)

    def into_stream(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``RowParallelLinear.into_stream`` of one rank (Q8_0 weights are not split across ranks)."""
        return ops.linear_into_stream(x, self.weight, self.bias, residual)


def quantize_linears(model: nn.Module, keep: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every ``nn.Linear`` of ``model`` whose rows are a multiple of 32 long (but those named in
    ``keep``) by a ``Q8Linear`` of its weight, quantized from float32; returns how many."""
    count = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if (isinstance(child, nn.Linear) and child_name not in keep and full not in keep
                    and child.in_features % q8_0.BLOCK == 0):
                packed = q8_0.quantize(child.weight.data.float())
                setattr(module, child_name, Q8Linear(packed, None if child.bias is None else child.bias.data))
                count += 1
    return count
