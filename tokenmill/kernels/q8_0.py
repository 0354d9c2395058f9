"""8-bit weights in GGUF's Q8_0 layout, kept packed: every 32 consecutive values of a row share
one float16 scale, and each value is an int8 (``value = q * scale``). A projection reads about
1.06 bytes a weight instead of bf16's 2, which is what one-token decode's time is made of.

``Q8Weight`` is what the projection ops take in place of a dense weight: the Triton GEMV
dequantizes it in registers, and the torch reference (the CPU path, and the ground truth)
dequantizes it whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # values that share a scale


@dataclass(frozen=True)
class Q8Weight:
    """A ``[N, K]`` matrix as ``qweight`` int8 ``[N, K]`` and ``scales`` float16 ``[N, K // 32]``."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        n, k = self.qweight.shape
        if self.qweight.dtype != torch.int8 or k % BLOCK:
            raise ValueError(
                f"a Q8_0 matrix is int8 with rows a multiple of {BLOCK} long, got "
                f"{self.qweight.dtype} {tuple(self.qweight.shape)}"
            )
        if self.scales.shape != (n, k // BLOCK) or self.scales.dtype != torch.float16:
            raise ValueError(
                f"Q8_0 scales must be float16 {(n, k // BLOCK)}, got {self.scales.dtype} {tuple(self.scales.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.qweight.shape
        values = self.qweight.float().view(n, k // BLOCK, BLOCK) * self.scales.float()[..., None]
        return values.view(n, k).to(dtype)


def quantize(weight: torch.Tensor) -> Q8Weight:
    """``weight`` ``[N, K]`` (K a multiple of 32) in Q8_0, as llama.cpp quantizes: each block's scale is
    its largest magnitude over 127 (in float16), each value rounded to the nearest step."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 needs rows a multiple of {BLOCK} long, got {k}")
    blocks = weight.float().view(n, k // BLOCK, BLOCK)
    scales = (blocks.abs().amax(dim=-1) / 127).to(torch.float16)
    safe = torch.where(scales > 0, scales.float(), torch.ones_like(scales, dtype=torch.float32))
    qweight = (blocks / safe[..., None]).round().clamp(-127, 127).to(torch.int8)
    return Q8Weight(qweight.view(n, k), scales)


def dense(weight: torch.Tensor | Q8Weight, dtype: torch.dtype) -> torch.Tensor:
    """A dense matrix in ``dtype``: the weight itself, or a Q8_0 one dequantized."""
    return weight.dequantize(dtype) if isinstance(weight, Q8Weight) else weight
