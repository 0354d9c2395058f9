"""Triton fused gated activations of a gate|up projection: SiLU-and-multiply (see
``reference.silu_and_mul``) and GeGLU with the tanh GELU (``reference.gelu_tanh_and_mul``); the
latter also with its gate and up in tensors of their own (Gemma 4's per-layer input gate). And the
logit softcap ``tanh(x / cap) * cap`` (``reference.softcap_``), whose float32 ``tanh`` attention's
softcap uses too."""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_launch import pdl_launch_args, wait_for_previous_kernel

_BLOCK = 1024
# gelu_tanh(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3); since 1 + tanh(u) = 2 sigmoid(2u),
# it is x / (1 + exp(-2u)), silu's form with 2u for x.
_GELU_2_SQRT_2_OVER_PI = tl.constexpr(2.0 * math.sqrt(2.0 / math.pi))
_GELU_KAPPA = tl.constexpr(0.044715)
_MINUS_2_LOG2E = tl.constexpr(-2.0 * math.log2(math.e))


@triton.jit
def tanh(x):
    """tanh in float32 from exp2 alone (not every Triton has ``tl.tanh``): ``e = exp(-2|x|)`` lies in
    (0, 1] for every x, so nothing overflows, and the sign is put back after. The absolute error is
    a few float32 ulps of 1 near x = 0, where ``1 - e`` cancels: harmless in a value that is
    multiplied by a cap next."""
    e = tl.exp2(tl.abs(x) * _MINUS_2_LOG2E)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def gate_activation(g, GELU_TANH: tl.constexpr):
    """``silu(g)``, or ``gelu_tanh(g)`` with ``GELU_TANH``, of float32 ``g``, in float32 (as torch
    computes both for 16-bit inputs). The sigmoid form has no cancellation where 1 + tanh(u)
    would cancel (g << 0), and exp(-2u) = inf there gives g / inf = -0, as torch's 0.5 g (1 + -1)
    does."""
    if GELU_TANH:
        z = g * _GELU_2_SQRT_2_OVER_PI + (g * g * g) * (_GELU_2_SQRT_2_OVER_PI * _GELU_KAPPA)
    else:
        z = g
    return g / (1.0 + tl.exp(-z))


@triton.jit
def _act_and_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    gate_stride,
    up_stride,
    out_stride,
    d,
    GELU_TANH: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0)
    # Rounded to the input dtype between the activation and the product, as the two torch ops do.
    act = gate_activation(gate.to(tl.float32), GELU_TANH).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _row_launch(rows: int, d: int) -> tuple[tuple[int, int], int, int]:
    """The grid, block and warps of an elementwise kernel over ``rows`` rows of ``d``: a program a
    block of a row."""
    block = min(_BLOCK, triton.next_power_of_2(d))
    return (rows, triton.cdiv(d, block)), block, 4 if block >= 512 else 1


def _act_and_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None, gelu_tanh: bool) -> torch.Tensor:
    """``act(gate) * up`` for ``gate`` and ``up`` of one shape (views of one tensor or not), each row's
    last dimension contiguous."""
    d = gate.shape[-1]
    if up.shape != gate.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    gate2, up2 = gate.reshape(-1, d), up.reshape(-1, d)
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    out2 = out.view(-1, d)
    if gate2.stride(-1) != 1 or up2.stride(-1) != 1:
        raise ValueError("gated activations need a contiguous last dimension")
    rows = gate2.shape[0]
    if rows and d:
        grid, block, num_warps = _row_launch(rows, d)
        _act_and_mul_kernel[grid](
            gate2,
            up2,
            out2,
            gate2.stride(0),
            up2.stride(0),
            out2.stride(0),
            d,
            GELU_TANH=gelu_tanh,
            BLOCK=block,
            num_warps=num_warps,
            **pdl_launch_args(gate.device),
        )
    return out


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dim; ``out`` may be preallocated."""
    gate, up = x.chunk(2, dim=-1)
    return _act_and_mul(gate, up, out, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (GeGLU, transformers' ``gelu_pytorch_tanh``) for ``x = [gate | up]``;
    ``out`` may be preallocated."""
    gate, up = x.chunk(2, dim=-1)
    return _act_and_mul(gate, up, out, gelu_tanh=True)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for two tensors of one shape."""
    return _act_and_mul(gate, up, None, gelu_tanh=True)


@triton.jit
def _softcap_kernel(x_ptr, stride, d, cap, inv_cap, PDL: tl.constexpr, BLOCK: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0)
    # Rounded to x's dtype after each step, as the reference's three in-place ops round; divided as
    # torch divides by a scalar on the GPU, times its float32 reciprocal (a correctly rounded division
    # took about 10 instructions an element, as many as the rest: the kernel would not keep up with
    # its bytes).
    t = (x.to(tl.float32) * inv_cap).to(x.dtype)
    t = tanh(t.to(tl.float32)).to(x.dtype)
    tl.store(x_ptr + row * stride + cols, (t.to(tl.float32) * cap).to(x.dtype), mask=mask)


def softcap_(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``tanh(x / cap) * cap`` in place over ``x`` ``[rows, d]`` (each row contiguous); returns ``x``.
    One pass over the logits where the reference's three in-place ops take three: Gemma's final
    softcap over a 262k vocabulary, at 128 rows 67 MB of bf16 logits, read and written once."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(
            f"softcap_ takes rows with a contiguous last dimension, got {tuple(x.shape)} strides {x.stride()}"
        )
    rows, d = x.shape
    if rows and d:
        grid, block, num_warps = _row_launch(rows, d)
        inv_cap = float(np.float32(1) / np.float32(cap))  # float32's 1 / cap, as torch's
        _softcap_kernel[grid](
            x, x.stride(0), d, float(cap), inv_cap, BLOCK=block, num_warps=num_warps, **pdl_launch_args(x.device)
        )
    return x
