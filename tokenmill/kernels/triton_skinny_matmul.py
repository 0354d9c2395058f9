"""Triton matmul for a few rows (decode batches, short chunks) and every Q8_0 projection of more than
one row: ``x`` ``[M, K]`` times ``weight`` ``[N, K]`` transposed, dense or Q8_0 (see ``q8_0.py``),
computed as ``weight @ x.T``.

With so few rows a projection is bound by reading its weight, and two things decide how close it
gets: whether the weight tile reaches the tensor cores without a detour, and whether enough programs
stream it at once. Here the weight tile is the left operand, taken from registers (a Q8_0 tile
dequantized there, as the reference rounds it, with no transpose through shared memory), and the few
rows are the narrow right one. Where a projection's column tiles alone leave SMs short of programs,
``SPLIT_K`` programs share a column tile's K: each writes its float32 partial sum, and the last of
them to finish (a counter per tile, reset by that program) adds the parts in a fixed order, so the
result does not depend on which finished first, and no second kernel is launched.

On the H200 inside CUDA graphs (``python benchmarks/studies/study_skinny.py``), Llama-3-8B's projections at
8 rows: dense qkv / gate|up / o / down 15.6 / 57.9 / 11.2 / 31.6 µs against cuBLAS's 16.2 / 58.0 /
13.7 / 33.5; Q8_0 19.2 / 60.5 / 13.1 / 32.7 µs against 23.7 / 83.8 / 17.5 / 54.2 for a tiled
matmul that dequantized into shared memory. Past 32 rows dense projections go to cuBLAS. Q8_0 ones
stay here at any row count in 128 x 128 tiles: at 128 rows 38.7 / 112.2 / 26.4 / 68.0 µs against
that tiled matmul's 46.9 / 179.7 / 34.6 / 116.4, at 512 rows 740 against 853 µs for the four, at
2,048 rows as fast (2,796 against 2,788 µs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.fp8 import FP8Weight
from tokenmill.kernels.q8_0 import BLOCK, Q8Weight
from tokenmill.kernels.reference import Weight
from tokenmill.kernels.triton_convert import (
    DENSE,
    FP8_BLOCKS,
    FP8_GROUP,
    FP8_ROWS,
    Q8_0,
    dot_f32,
    ptx_conversions,
    q8_0_tile,
    to_f16,
    weight_format,
)
from tokenmill.kernels.triton_launch import num_sms, pdl_launch_args, wait_for_previous_kernel

# The most dense rows this kernel takes: past them cuBLAS was as fast. Q8_0 rows have no limit.
MAX_DENSE_ROWS = 32
# The most rows it takes of an FP8 weight, read as FP8 against rows in their own dtype (the weight's
# bytes are the time); more go to FP8 tensor cores with the rows quantized (``triton_fp8``).
MAX_FP8_ROWS = 64
# Programs an SM that the K split aims at: a Q8_0 tile spends longer dequantizing than loading, so
# more of them in flight hide the loads (the study's best split for each projection, within 6%).
_PROGRAMS_PER_SM = {"dense": 1, "q8_0": 4}
_MAX_SPLIT = 8
BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 128, 4, 4
# Past 64 rows: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), K split only where these tiles
# leave SMs without a program (the study's fastest at 128-2,048 rows, split and unsplit).
LARGE_TILE = (128, 128, 128, 8, 3)

# Per device, every counter array made (the last one in use): one a CUDA graph captured stays valid.
_counters: dict[torch.device, list[torch.Tensor]] = {}


@triton.jit(do_not_specialize=["M"])  # the row count changes with every batch
def _skinny_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    FORMAT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    PTX: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Program ``(j, i, s)``: output columns ``j``, rows ``i``, the ``s``-th of ``SPLIT_K`` parts of K
    (whole ``BLOCK_K`` steps; a part may be empty)."""
    wait_for_previous_kernel(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks0 = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + cols.to(tl.int64)[:, None] * stride_sn
    x_cols = x_ptr + rows.to(tl.int64)[None, :] * stride_xm
    part = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = tl.program_id(2) * part
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(k_start, tl.minimum(k_start + part, K), BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + ks0
        xt = tl.load(x_cols + ks[:, None], mask=(rows[None, :] < M) & (ks[:, None] < K), other=0.0)  # [K, M]
        w = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
        if FORMAT == Q8_0:  # rounded to x's dtype, as the reference's dequantized matrix is
            w = q8_0_tile(w, s_rows, k0, K, cols < N, PTX).to(xt.dtype)
        elif FORMAT != DENSE:  # float8 values are exact in x's dtype (16 or 32 bits): scaled after the dot
            w = to_f16(w, PTX, False).to(xt.dtype)
        if FORMAT == FP8_BLOCKS:  # one scale a row for this step's columns (BLOCK_K divides the block)
            scale = tl.load(s_ptr + cols.to(tl.int64) * stride_sn + k0 // FP8_GROUP, mask=cols < N, other=0.0)
            acc += dot_f32(w, xt, IEEE_DOT) * scale[:, None]
        else:
            acc += dot_f32(w, xt, IEEE_DOT)
    if FORMAT == FP8_ROWS:
        acc *= tl.load(s_ptr + cols.to(tl.int64) * stride_sn, mask=cols < N, other=0.0)[:, None]
    mask = (rows[None, :] < M) & (cols[:, None] < N)
    if SPLIT_K > 1:
        offsets = rows.to(tl.int64)[None, :] * N + cols[:, None]
        tl.store(part_ptr + tl.program_id(2).to(tl.int64) * M * N + offsets, acc, mask=mask)
        tl.debug_barrier()  # every thread's part written before the counter says so
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") != SPLIT_K - 1:
            return
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # from L2: another SM wrote them
            acc += tl.load(part_ptr + s * M * N + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + tile, 0)
    if HAS_BIAS:  # into the float32 sum, rounded once with it, as addmm does
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
    tl.store(
        out_ptr + rows.to(tl.int64)[None, :] * stride_om + cols[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask
    )


def takes(x: torch.Tensor, weight: Weight) -> bool:
    """Whether ``x`` times ``weight`` go through this kernel on the GPU: few enough rows (any number of
    Q8_0 ones), each row of both contiguous (a packed weight's always is; other layouts stay with
    cuBLAS)."""
    if isinstance(weight, Q8Weight):
        return x.stride(-1) == 1
    if isinstance(weight, FP8Weight):
        return x.shape[0] <= MAX_FP8_ROWS and x.stride(-1) == 1
    return x.shape[0] <= MAX_DENSE_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1


def default_tiles(
    m: int, n: int, k: int, quantized: bool, device: torch.device, float32: bool = False
) -> tuple[int, ...]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, split_k)``: rows in tiles of 16, 32 or 64
    (one compiled variant for each), K split in a power of two of parts up to ``_MAX_SPLIT`` so that
    about ``_PROGRAMS_PER_SM`` programs share an SM; more rows in ``LARGE_TILE``s, one program an SM
    (float32 rows in half its K step, which their stages' shared memory needs)."""
    if m > 64:
        block_m, block_n, block_k, num_warps, num_stages = LARGE_TILE
        block_k = block_k // 2 if float32 else block_k
        per_sm = 1
    else:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_n, block_k, num_warps, num_stages = BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES
        per_sm = _PROGRAMS_PER_SM["q8_0" if quantized else "dense"]
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    want = per_sm * num_sms(device) // tiles
    split = 1
    while split * 2 <= min(want, _MAX_SPLIT, triton.cdiv(k, block_k)):
        split *= 2
    return block_m, block_n, block_k, num_warps, num_stages, split


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters the split programs of a tile count on, kept per device: every launch
    leaves them zero, and launches on one stream run one after another. A launch with more tiles
    than they hold gets a longer array; the old one is kept, since a captured graph may use it."""
    made = _counters.setdefault(device, [])
    if not made or made[-1].numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Made inside a capture, they would be zeroed only when that graph replays.
            raise RuntimeError(
                "the split-K tile counters must be made outside a CUDA graph capture: run this shape eagerly first"
            )
        made.append(torch.zeros(max(1 << 12, tiles), dtype=torch.int32, device=device))
    return made[-1]


def skinny_matmul(
    x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, tiles: tuple[int, ...] | None = None
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in x's dtype. ``tiles``: force ``default_tiles``' choice (the study)."""
    m, k = x.shape
    w, scales, fmt = weight_format(weight)
    n = w.shape[0]
    if w.shape[1] != k or (fmt == Q8_0.value and k % BLOCK):
        raise ValueError(f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)} do not match")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("skinny_matmul needs x's and the weight's rows contiguous")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages, split_k = tiles or default_tiles(
        m, n, k, fmt == Q8_0.value, x.device, x.dtype == torch.float32
    )
    if fmt == FP8_BLOCKS.value and FP8_GROUP.value % block_k:
        raise ValueError(f"a block-scaled FP8 weight needs K tiles that divide {FP8_GROUP.value}, got {block_k}")
    split_k = min(split_k, triton.cdiv(k, block_k))
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)
    partials = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    _skinny_matmul_kernel[grid](
        x,
        w,
        scales if scales is not None else w,
        bias if bias is not None else x,
        out,
        partials,
        _tile_counters(x.device, grid[0] * grid[1]) if split_k > 1 else out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        scales.stride(0) if scales is not None else 0,
        out.stride(0),
        FORMAT=fmt,
        HAS_BIAS=bias is not None,
        IEEE_DOT=x.dtype == torch.float32,
        PTX=ptx_conversions(),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NUM_STAGES=num_stages,
        SPLIT_K=split_k,
        num_warps=num_warps,
        **pdl_launch_args(x.device),
    )
    return out
