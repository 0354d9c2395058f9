"""Triton RMSNorm, with its weight applied the way each family does (``WEIGHTINGS``) and an
optional fused residual add: before the norm (``x + residual`` normed, ``reference.rms_norm``'s
``residual``) or, for Gemma's post-norms, after it (``reference.add_rms_norm``), optionally followed
by the next norm of the new stream (``reference.join_and_norm``)."""

from __future__ import annotations

from typing import cast

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_launch import pdl_launch_args, wait_for_previous_kernel

# The kernels' WEIGHTING constexpr: how a norm's weight meets the float32 normed value.
LLAMA, OFFSET, FP32 = 0, 1, 2
# ``reference.NORMS`` names (the norm modules' ``weighting``) → the constexpr.
WEIGHTINGS = {"llama": LLAMA, "offset": OFFSET, "fp32": FP32}


@triton.jit
def weigh(normed, w, WEIGHTING: tl.constexpr):
    """The float32 value a Gemma norm rounds once: ``normed`` times ``1 + w`` (Gemma 3) or times ``w``
    (Gemma 4). Llama's weighting rounds twice; its callers do it."""
    if WEIGHTING == 1:
        return normed * (1.0 + w)
    else:
        return normed * w


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    next_weight_ptr,
    out_ptr,
    residual_out_ptr,
    scale_ptr,
    x_stride,
    residual_stride,
    out_stride,
    residual_out_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ADD_AFTER: tl.constexpr,
    SCALE_AFTER: tl.constexpr,
    NORM_AGAIN: tl.constexpr,
    WEIGHTING: tl.constexpr,
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
    if WEIGHTING == 0:
        # Cast back to the input dtype *before* the weight, as transformers' Llama does.
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = w * normed.to(x.dtype).to(tl.float32)
    else:
        out = weigh(normed, tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32), WEIGHTING)
    if ADD_AFTER:
        # residual + norm(x): the normed value rounded first, then the sum, as the two torch ops round.
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        out = out.to(x.dtype).to(tl.float32) + r.to(tl.float32)
        if SCALE_AFTER:  # then the whole stream times a scalar (Gemma 4's layer scalar), rounded in between
            out = out.to(out_ptr.dtype.element_ty).to(tl.float32) * tl.load(scale_ptr).to(tl.float32)
        if NORM_AGAIN:
            # The new stream is stored, and its rounded value normed by the next norm's weight: the
            # block's join and the next block's input norm in one pass over the row.
            stream = out.to(residual_out_ptr.dtype.element_ty)
            tl.store(residual_out_ptr + row * residual_out_stride + cols, stream, mask=mask)
            sf = stream.to(tl.float32)
            normed = sf * tl.rsqrt(tl.sum(sf * sf, axis=0) / hidden + eps)
            out = weigh(normed, tl.load(next_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32), WEIGHTING)
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
    return _rms_norm(x, weight, eps, residual, LLAMA)


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
    return _rms_norm(x, weight, eps, residual, OFFSET)


def fp32_weight_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm, ``norm(x) * w`` in float32, in x's dtype."""
    return cast(torch.Tensor, _rms_norm(x, weight, eps, None, FP32))  # (no residual: one tensor)


def add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
    weighting: str,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + norm(x)`` in one pass, for Gemma's ``offset`` or ``fp32`` weighting (a block's
    normed output joining the stream), times ``scale`` (one value) where given."""
    return _join(x, weight, eps, residual, weighting, scale=scale)[1]


def join_and_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor, next_weight: torch.Tensor, weighting: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` (no scale), then the new stream normed by ``next_weight`` with the same
    weighting and eps, in one pass: returns ``(normed, new stream)``. A Gemma layer's two joins each
    meet the next block's input norm; one kernel where there were two."""
    return _join(x, weight, eps, residual, weighting, next_weight=next_weight)


def _join(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
    weighting: str,
    *,
    scale: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's post-norm join (``add_rms_norm``); with ``next_weight`` the new stream normed again.
    Returns ``(normed, new stream)``: the stream twice where nothing is normed after the join."""
    hidden = x.shape[-1]
    x2, r2 = x.reshape(-1, hidden), residual.reshape(-1, hidden)
    weights = (weight,) if next_weight is None else (weight, next_weight)
    if x.shape != residual.shape or x2.stride(-1) != 1 or r2.stride(-1) != 1 or any(w.stride(-1) != 1 for w in weights):
        raise ValueError("Gemma's post-norm needs x and residual of one shape, contiguous last dimensions")
    if weighting == "llama":
        raise ValueError("Gemma's post-norm takes offset or fp32 weighting")
    stream = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    normed = stream if next_weight is None else torch.empty_like(stream)
    if x2.shape[0]:
        _launch(
            x2,
            r2,
            weight,
            normed.view(-1, hidden),
            stream.view(-1, hidden),
            eps,
            has_residual=True,
            add_after=True,
            weighting=WEIGHTINGS[weighting],
            scale=scale,
            next_weight=next_weight,
        )
    return normed, stream


def _launch(
    x2: torch.Tensor,
    r2: torch.Tensor,
    weight: torch.Tensor,
    out2: torch.Tensor,
    nr2: torch.Tensor,
    eps: float,
    *,
    has_residual: bool,
    add_after: bool,
    weighting: int,
    scale: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
) -> None:
    block = triton.next_power_of_2(x2.shape[-1])
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight,
        next_weight if next_weight is not None else weight,
        out2,
        nr2,
        scale if scale is not None else x2,
        x2.stride(0),
        r2.stride(0),
        out2.stride(0),
        nr2.stride(0),
        x2.shape[-1],
        float(eps),
        HAS_RESIDUAL=has_residual,
        ADD_AFTER=add_after,
        SCALE_AFTER=scale is not None,
        NORM_AGAIN=next_weight is not None,
        WEIGHTING=weighting,
        BLOCK=block,
        num_warps=max(1, min(16, block // 256)),
        **pdl_launch_args(x2.device),
    )


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, weighting: int
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(weight.dtype, sum_dtype) if weighting == LLAMA else sum_dtype
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
        _launch(x2, r2, weight, out2, nr2, eps, has_residual=residual is not None, add_after=False, weighting=weighting)
    return out if residual is None else (out, new_residual)
