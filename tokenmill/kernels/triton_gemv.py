"""Triton GEMV with the residual add fused in, for single-token decode
(see ``reference.linear_residual``).

At batch 1 the o and down projections are matrix-vector products whose time is
streaming the weight, and on the H200 cuBLAS runs them split-K with a separate
reduction kernel, after which the residual add needs a third. Here each program
owns ``BLOCK_N`` output features, walks K with the next weight tile already in
flight, and adds the residual on its way out. Launched with PDL, a program loads
its first weight tile before it waits for the previous kernel (attention, or
SiLU-and-multiply), so the weight stream starts under that kernel's tail.

``benchmarks/study_gemv.py`` measured the alternatives on the H200: the same
kernel for the qkv and gate|up projections (with the RMSNorm folded in front)
and for 2-8 rows lost to cuBLAS, so those stay on cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_launch import pdl_launch_args, wait_for_previous_kernel

# Rows (tokens) the fused GEMV takes; more go to cuBLAS.
MAX_ROWS = 1
# The H200's best tile for the 4096-row o and down projections (benchmarks/study_gemv.py).
BLOCK_N, BLOCK_K, NUM_WARPS = 8, 1024, 4


@triton.jit
def _gemv_residual_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, N, K, stride_w,
                          HAS_BIAS: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    ks0 = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + ns.to(tl.int64)[:, None] * stride_w
    w = tl.load(w_rows + ks0[None, :], mask=n_ok[:, None] & (ks0[None, :] < K), other=0.0,
                eviction_policy="evict_first")
    wait_for_previous_kernel(PDL)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + ks0
        nxt = ks + BLOCK_K
        w_next = tl.load(w_rows + nxt[None, :], mask=n_ok[:, None] & (nxt[None, :] < K), other=0.0,
                         eviction_policy="evict_first")
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
        acc += tl.sum(x.to(tl.float32)[None, :] * w.to(tl.float32), axis=1)
        w = w_next
    out_ty = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)
    # Rounded to the output dtype before the add, as the projection's output is.
    r = tl.load(res_ptr + ns, mask=n_ok, other=0.0)
    out = acc.to(out_ty).to(tl.float32) + r.to(tl.float32)
    tl.store(out_ptr + ns, out.to(out_ty), mask=n_ok)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
    """``residual + x @ weight.T (+ bias)`` for one row ``x`` ``[1, K]``."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"linear_residual takes at most {MAX_ROWS} row, got {m}")
    if residual.shape != (m, n) or weight.shape[1] != k:
        raise ValueError(f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}, residual "
                         f"{tuple(residual.shape)} do not match")
    for t in (x, weight, residual, bias):
        if t is not None and t.stride(-1) != 1:
            raise ValueError("linear_residual needs contiguous rows")
    out = torch.empty((m, n), dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    if m == 0:
        return out
    _gemv_residual_kernel[(triton.cdiv(n, BLOCK_N),)](
        x, weight, bias if bias is not None else weight, residual, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
        **pdl_launch_args(x.device),
    )
    return out
