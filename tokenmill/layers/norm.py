"""RMSNorm, optionally fused with the residual add that precedes it: Llama's ``w * norm(x)``
and Gemma 3's ``(1 + w) * norm(x)``. ``weighting`` tells fused kernels (RoPE's q/k norm, the
decode GEMV) how a module applies its weight (``reference.NORMS``)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from tokenmill.layers import ops


class NormParams(Protocol):
    """What a fused kernel takes of a norm module (this file's, or Gemma 4's): its weight and eps, and
    how it applies the weight."""

    @property
    def weight(self) -> torch.Tensor: ...
    @property
    def eps(self) -> float: ...
    @property
    def weighting(self) -> str: ...


class RMSNorm(nn.Module):
    weighting = "llama"

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With ``residual``: returns ``(norm(x + residual), x + residual)``, one pass over memory."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm, ``norm(x) * (1 + w)`` in float32; ``w`` starts at zero (the identity)."""

    weighting = "offset"

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return ops.offset_rms_norm(x, self.weight, self.eps, residual)

    def add_to(self, x: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        """``stream + norm(x)``: a block's output normed into the residual stream, in one pass."""
        return ops.add_rms_norm(x, self.weight, self.eps, stream, self.weighting)
