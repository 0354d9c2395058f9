"""Triton matmul of activations by a Q8_0 weight (see ``q8_0.py`` and ``reference.linear``), for
the steps with more rows than the few-row matmul takes (prefill chunks, large decode batches; see
``triton_skinny_matmul.py``): each weight tile is read as
int8 with its float16 scales and dequantized in registers to the activations' dtype, rounded as
the reference's dequantized matrix is, before ``tl.dot``. Dequantizing the whole matrix for cuBLAS
instead would read and write it three times over per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.q8_0 import BLOCK, Q8Weight
from tokenmill.kernels.triton_convert import ptx_conversions, q8_0_tile
from tokenmill.kernels.triton_launch import pdl_launch_args, wait_for_previous_kernel


# Tiles by rows (``(max rows, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``, the first that
# holds ``M``; the sweep of benchmarks/study_q8.py on Llama-3-8B's projections, H200). Fewer rows than
# these take the few-row matmul (``triton_skinny_matmul``) on the GPU.
TILES = ((128, 64, 64, 128, 4, 3), (1 << 62, 128, 64, 64, 8, 3))


@triton.jit(do_not_specialize=["M"])  # the row count changes with every batch
def _q8_matmul_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
                      HAS_BIAS: tl.constexpr, IEEE_DOT: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      NUM_STAGES: tl.constexpr):
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks0 = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + cols.to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + ks0
        x = tl.load(x_rows + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0)  # [N, K] int8
        weights = tl.trans(q8_0_tile(w, s_rows, k0, K, cols < N, PTX).to(x.dtype))
        if IEEE_DOT:
            acc += tl.dot(x, weights, input_precision="ieee")
        else:
            acc += tl.dot(x, weights)
    if HAS_BIAS:  # into the float32 sum, rounded once with it, as addmm does
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def q8_matmul(x: torch.Tensor, weight: Q8Weight, bias: torch.Tensor | None,
              tiles: tuple[int, ...] | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` times the Q8_0 ``weight`` ``[N, K]`` transposed (+ ``bias``): ``[M, N]`` in x's
    dtype. ``tiles``: force ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` (the tile study)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or k % BLOCK:
        raise ValueError(f"shapes x {tuple(x.shape)}, Q8_0 weight {tuple(weight.shape)} do not match")
    if x.stride(-1) != 1:
        raise ValueError("q8_matmul needs x's rows contiguous")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages = tiles or next(t[1:] for t in TILES if m <= t[0])
    _q8_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, weight.qweight, weight.scales, bias if bias is not None else x, out, m, n, k,
        x.stride(0), weight.qweight.stride(0), weight.scales.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, IEEE_DOT=x.dtype == torch.float32, PTX=ptx_conversions(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
        num_warps=num_warps, **pdl_launch_args(x.device),
    )
    return out
