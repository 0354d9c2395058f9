"""Triton GEMV for the few-row products of small-batch decode (see ``reference.linear``).

At batch 1-8 a decode step's projections are matrix-vector products: all the
time goes into streaming the weight once. Each program owns ``BLOCK_N`` output
features and walks the whole K dimension, so every weight byte is read by
exactly one program in long contiguous rows. ``gated`` fuses the gate|up
projection with SiLU-and-multiply: the program reads row ``n`` of the gate and
row ``n`` of the up half and writes ``silu(g) * u``, so the intermediate never
touches memory and the separate activation kernel disappears.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows up to which the GEMV beats cuBLAS (measured on the H200, benchmarks/results).
MAX_ROWS = 8


@triton.jit
def _dot_rows(x_ptr, stride_xm, w_rows_ptr, stride_wn, M, N_valid, K,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    ms = tl.arange(0, BLOCK_M)
    ns = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(w_rows_ptr + ns[:, None] * stride_wn + ks[None, :],
                    mask=(ns[:, None] < N_valid) & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + ms[:, None] * stride_xm + ks[None, :],
                    mask=(ms[:, None] < M) & k_ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    rows = n0 + tl.arange(0, BLOCK_N)
    ms = tl.arange(0, BLOCK_M)
    n_valid = N - n0
    acc = _dot_rows(x_ptr, stride_xm, w_ptr + n0.to(tl.int64) * stride_wn, stride_wn, M, n_valid, K,
                    BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
    if GATED:
        # N is the width of one half; the up rows start N rows further down.
        up = _dot_rows(x_ptr, stride_xm, w_ptr + (N + n0).to(tl.int64) * stride_wn, stride_wn, M, n_valid, K,
                       BLOCK_M, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            up += tl.load(bias_ptr + N + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
        # Rounded as the unfused path rounds: projection, then silu, then the product.
        g = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = act * up.to(out_ptr.dtype.element_ty).to(tl.float32)
    mask = (ms[:, None] < M) & (rows[None, :] < N)
    tl.store(out_ptr + ms[:, None] * stride_om + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _block_n(n: int) -> int:
    """Enough programs to cover the SMs several times over, rows of at least 4."""
    return 8 if n >= 8192 else 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         gated: bool = False) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` ``[M, K]`` with ``M <= MAX_ROWS``; with ``gated``, ``weight`` is
    ``[gate; up]`` (``[2N, K]``) and the result is ``silu(x @ gate.T) * (x @ up.T)``, ``[M, N]``."""
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {m}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("gemv needs contiguous rows")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n = _block_n(n)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, GATED=gated,
        BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=512 if m <= 2 else 256,
        num_warps=4,
    )
    return out
