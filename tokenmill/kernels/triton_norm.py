"""Triton RMSNorm with optional fused residual add: Llama's ``w * norm(x)`` (``reference.rms_norm``)
and Gemma's ``(1 + w) * norm(x)`` (``reference.offset_rms_norm``); the add before the norm
(``x + residual`` normed) or, for Gemma's post-norms, after it (``reference.add_offset_rms_norm``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_launch import pdl_launch_args, wait_for_previous_kernel


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    x_stride,
    residual_stride,
    out_stride,
    residual_out_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ADD_AFTER: tl.constexpr,
    OFFSET: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # One program per row; the whole row stays in registers between the two passes.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL and not ADD_AFTER:
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        # The sum is rounded to the residual's dtype, as the reference's `x + residual` is,
        # and that rounded value is what gets normed.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * residual_out_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / hidden
    normed = xf * tl.rsqrt(mean_sq + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        # Gemma: (1 + w) in float32 multiplies the float32 normed value; one rounding, at the store.
        out = normed * (1.0 + w)
    else:
        # Cast back to the input dtype *before* the weight, as transformers' Llama does.
        out = w * normed.to(x.dtype).to(tl.float32)
    if ADD_AFTER:
        # residual + norm(x): the normed value rounded first, then the sum, as the two torch ops round.
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        out = out.to(x.dtype).to(tl.float32) + r.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with ``residual`` returns ``(out, x + residual)``.

    Output dtypes follow torch promotion exactly as the reference: the sum has
    ``promote(x, residual)``, the output ``promote(weight, that)``. Inputs are not modified.
    """
    return _rms_norm(x, weight, eps, residual, offset=False)


def offset_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gemma's RMSNorm, ``norm(x) * (1 + w)`` in float32; with ``residual`` returns ``(out, x + residual)``.

    As the reference: the sum has ``promote(x, residual)`` and the output that same dtype, whatever
    the weight's. Inputs are not modified.
    """
    return _rms_norm(x, weight, eps, residual, offset=True)


def add_offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor) -> torch.Tensor:
    """``residual + offset_rms_norm(x)`` in one pass (a Gemma block's output joining the stream)."""
    hidden = x.shape[-1]
    x2, r2 = x.reshape(-1, hidden), residual.reshape(-1, hidden)
    if x.shape != residual.shape or x2.stride(-1) != 1 or r2.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("add_offset_rms_norm needs x and residual of one shape, contiguous last dimensions")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    out2 = out.view(-1, hidden)
    if x2.shape[0]:
        _launch(x2, r2, weight, out2, out2, eps, has_residual=True, add_after=True, offset=True)
    return out


def _launch(x2: torch.Tensor, r2: torch.Tensor, weight: torch.Tensor, out2: torch.Tensor, nr2: torch.Tensor,
            eps: float, *, has_residual: bool, add_after: bool, offset: bool) -> None:
    block = triton.next_power_of_2(x2.shape[-1])
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out2, nr2, x2.stride(0), r2.stride(0), out2.stride(0), nr2.stride(0), x2.shape[-1],
        float(eps), HAS_RESIDUAL=has_residual, ADD_AFTER=add_after, OFFSET=offset, BLOCK=block,
        num_warps=max(1, min(16, block // 256)), **pdl_launch_args(x2.device),
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
              offset: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = sum_dtype if offset else torch.promote_types(weight.dtype, sum_dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        new_residual = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
        nr2 = new_residual.view(-1, hidden)
    else:
        r2 = nr2 = x2  # unused by the kernel when HAS_RESIDUAL is off
    if x2.stride(-1) != 1 or r2.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("rms_norm needs a contiguous last dimension")
    if x2.shape[0]:
        _launch(x2, r2, weight, out2, nr2, eps, has_residual=residual is not None, add_after=False, offset=offset)
    return out if residual is None else (out, new_residual)
