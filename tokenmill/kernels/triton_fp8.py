"""FP8 projections of many rows on FP8 tensor cores: the rows quantized to float8 e4m3 per token (or
per token and 128-column block, or by a checkpoint's static scale), then multiplied by the FP8
weight with both scales applied in float32 (``reference.fp8_linear``).

Past a few dozen rows a projection stops being bound by its weight's bytes and the matrix units set
the pace; FP8 ones run at twice bf16's rate, which is worth the rounding of the rows. Rows scaled
one scale a token against a weight scaled one a row go to cuBLAS (``torch._scaled_mm``) where it
takes them (bfloat16 out, dimensions a multiple of 16); the rest, block-scaled weights among them,
to the Triton matmul here, which applies the two block scales to each 128-column step's partial
product in registers, so that the tensor cores' own accumulation never spans more than one block.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tokenmill.kernels.fp8 import FP8_DTYPE, FP8_MAX, FP8Weight
from tokenmill.kernels.triton_convert import FP8_BLOCKS, FP8_GROUP, round_to_e4m3, weight_format

_E4M3_MAX = tl.constexpr(FP8_MAX)
# Columns of a row a program quantizes at a time.
QUANTIZE_BLOCK_K = 1024
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M) of the Triton matmul: programs walk
# GROUP_M tiles of rows down a column of tiles before moving right, so a weight tile serves them from L2.
MATMUL_TILE = (128, 128, 128, 8, 3, 8)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    static_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_x,
    stride_s,
    GROUPED: tl.constexpr,
    STATIC: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program ``r``: row ``r`` of ``x`` in float8 e4m3 (``q``, rows ``K`` long), with its scales in
    ``s``: one a row (``GROUPED`` false), or one a 128-column block; ``STATIC``: the one scale at
    ``static_ptr`` for every value, nothing written to ``s``. Every value is divided by its scale
    (correctly rounded), clamped to ±448 and rounded to nearest, as the reference's cast rounds."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * K
    ks0 = tl.arange(0, BLOCK_K)
    if GROUPED:
        GROUPS: tl.constexpr = BLOCK_K // FP8_GROUP
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + ks0
            x = tl.reshape(tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32), (GROUPS, FP8_GROUP))
            amax = tl.max(tl.abs(x), axis=1)
            scale = tl.where(amax > 0.0, tl.math.div_rn(amax, _E4M3_MAX), 1.0)
            q = _to_e4m3(x, scale[:, None])
            tl.store(q_row + ks, tl.reshape(q, (BLOCK_K,)), mask=ks < K)
            gs = k0 // FP8_GROUP + tl.arange(0, GROUPS)
            tl.store(s_ptr + row * stride_s + gs, scale, mask=gs < tl.cdiv(K, FP8_GROUP))
    else:
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + ks0
                amax = tl.maximum(amax, tl.abs(tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)))
            row_amax = tl.max(amax, axis=0)
            scale = tl.where(row_amax > 0.0, tl.math.div_rn(row_amax, _E4M3_MAX), 1.0)
            tl.store(s_ptr + row * stride_s, scale)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + ks0
            x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            tl.store(q_row + ks, _to_e4m3(x, scale), mask=ks < K)


@triton.jit
def _to_e4m3(x, scale):
    return round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_E4M3_MAX), _E4M3_MAX)).to(tl.float8e4nv)


def quantize_rows(x: torch.Tensor, weight: FP8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.quantize_fp8_activations(x, weight.block, weight.input_scale)`` on the GPU: ``x``
    ``[T, K]`` as float8 e4m3 values and float32 scales (``[1, 1]``, the static scale, for a
    checkpoint that has one)."""
    t, k = x.shape
    if x.stride(-1) != 1:
        raise ValueError("quantize_rows needs each row contiguous")
    values = torch.empty((t, k), dtype=FP8_DTYPE, device=x.device)
    static = weight.input_scale
    grouped = weight.block is not None
    if static is not None:
        scales = static.amax().float().reshape(1, 1)
    else:
        scales = torch.empty(
            (t, triton.cdiv(k, FP8_GROUP.value) if grouped else 1), dtype=torch.float32, device=x.device
        )
    if t:
        _quantize_rows_kernel[(t,)](
            x,
            scales,
            values,
            scales,
            k,
            x.stride(0),
            scales.stride(0),
            GROUPED=grouped,
            STATIC=static is not None,
            BLOCK_K=QUANTIZE_BLOCK_K,
            num_warps=4,
        )
    return values, scales


@triton.jit
def _fp8_matmul_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_om,
    BLOCKS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``out = (a * a_scale) @ (b * b_scale).T (+ bias)``, ``a`` ``[M, K]`` and ``b`` ``[N, K]`` float8
    e4m3. ``BLOCKS``: both scaled a row and 128-column block (``BLOCK_K`` is 128); else one scale a
    row of each (``stride_asm`` 0: one for all of ``a``)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_m
    pid_n = (pid % (GROUP_M * tiles_n)) // group_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks0 = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + cols.to(tl.int64)[:, None] * stride_bn
    a_scales = a_scale_ptr + rows.to(tl.int64) * stride_asm
    b_scales = b_scale_ptr + cols.to(tl.int64) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + ks0
        a = tl.load(a_rows + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
        if BLOCKS:
            sa = tl.load(a_scales + k0 // FP8_GROUP, mask=rows < M, other=0.0)
            sb = tl.load(b_scales + k0 // FP8_GROUP, mask=cols < N, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if not BLOCKS:
        sa = tl.load(a_scales, mask=rows < M, other=0.0)
        sb = tl.load(b_scales, mask=cols < N, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask
    )


def fp8_matmul(
    x: torch.Tensor, weight: FP8Weight, bias: torch.Tensor | None, tile: tuple[int, ...] | None = None
) -> torch.Tensor:
    """``reference.fp8_linear`` on the GPU: ``x`` ``[M, K]`` quantized (``quantize_rows``), then times the
    weight on FP8 tensor cores, in x's dtype. ``tile``: force ``MATMUL_TILE`` and the Triton matmul
    (the study)."""
    m, k = x.shape
    fmt = weight_format(weight)[2]  # checks the block and the row length
    w, w_scales = weight.qweight, weight.scales
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)} do not match")
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    values, scales = quantize_rows(x, weight)
    blocks = fmt == FP8_BLOCKS.value
    if tile is None and not blocks and _cublas_takes(x, n, k):
        a_scales = scales if weight.input_scale is None else scales.expand(m, 1).contiguous()
        return torch._scaled_mm(values, w.t(), scale_a=a_scales, scale_b=w_scales.t(), bias=bias, out_dtype=x.dtype)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, num_warps, num_stages, group_m = tile or MATMUL_TILE
    if blocks and block_k != FP8_GROUP.value:
        raise ValueError(f"a block-scaled FP8 matmul steps K by its block, {FP8_GROUP.value}, got {block_k}")
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_matmul_kernel[grid](
        values,
        scales,
        w,
        w_scales,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        values.stride(0),
        0 if weight.input_scale is not None else scales.stride(0),
        w.stride(0),
        w_scales.stride(0),
        out.stride(0),
        BLOCKS=blocks,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NUM_STAGES=num_stages,
        GROUP_M=group_m,
        num_warps=num_warps,
    )
    return out


def _cublas_takes(x: torch.Tensor, n: int, k: int) -> bool:
    """Whether ``torch._scaled_mm`` multiplies these with one scale a row of each: bfloat16 out, every
    dimension a multiple of 16, a GPU with FP8 matrix units."""
    return x.is_cuda and x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0 and _fp8_matrix_units(x.device)


@functools.cache
def _fp8_matrix_units(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)
