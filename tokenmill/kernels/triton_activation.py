"""Triton fused SiLU-and-multiply of a gate|up projection (see ``reference.silu_and_mul``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_launch import pdl_launch_args, wait_for_previous_kernel

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, d, PDL: tl.constexpr, BLOCK: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # Rounded to the input dtype between silu and the product, as the two torch ops do.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dim; ``out`` may be preallocated."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, d)
    if x2.stride(-1) != 1:
        raise ValueError("silu_and_mul needs a contiguous last dimension")
    rows = x2.shape[0]
    if rows and d:
        block = min(_BLOCK, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
            x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=block, num_warps=4 if block >= 512 else 1,
            **pdl_launch_args(x.device),
        )
    return out
