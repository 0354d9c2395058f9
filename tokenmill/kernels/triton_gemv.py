"""Triton GEMV for small-batch decode, with the projection's neighbours fused in
(see ``reference.norm_linear`` and ``reference.linear_residual``).

At batch 1-8 a decode step's projections are matrix-vector products: the time
goes into streaming each weight once, and around them sit small kernels (the
RMSNorm before a projection, the residual add after it, SiLU-and-multiply
between gate|up and down) that each cost a few microseconds of launch and
latency however few bytes they move. Here each program owns ``BLOCK_N`` output
features and walks K with the next weight tile already in flight, and does the
neighbours' work on its way in (the norm of the input row, recomputed by every
program from L2) and on its way out (the residual add, or SiLU-and-multiply of
the gate row ``n`` with the up row ``N + n``). With ``pdl`` the kernel is
launched as a programmatic dependent launch: its first weight tile, which no
earlier kernel writes, is loaded before it waits for the previous kernel, so the
weight stream starts under the previous kernel's tail.

Every rounding follows the unfused torch ops: the residual sum, the normed row
and the weighted normed row are each rounded to the input dtype, the projection
is rounded before the residual add or the SiLU, and the SiLU before the product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Rows (tokens) up to which the fused GEMV replaces norm + cuBLAS + add.
MAX_ROWS = 8


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int


@triton.jit
def _stream_rows(x_ptr, res_ptr, ms, ks, M, K, stride_x, stride_r, ADD_RES: tl.constexpr):
    """Rows ``ms`` and columns ``ks`` of ``x (+ residual)``, rounded as the sum is, in float32."""
    mask = (ms[:, None] < M) & (ks[None, :] < K)
    x = tl.load(x_ptr + ms[:, None] * stride_x + ks[None, :], mask=mask, other=0.0)
    if ADD_RES:
        r = tl.load(res_ptr + ms[:, None] * stride_r + ks[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr, res_out_ptr,
                 M, N, K, stride_x, stride_r, stride_w, stride_o, stride_ro, eps,
                 NORM: tl.constexpr, ADD_RES_IN: tl.constexpr, ADD_RES_OUT: tl.constexpr, GATED: tl.constexpr,
                 HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    ms = tl.arange(0, BLOCK_M)
    ks0 = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + ns.to(tl.int64)[:, None] * stride_w
    u_rows = w_rows + N.to(tl.int64) * stride_w
    w = tl.load(w_rows + ks0[None, :], mask=n_ok[:, None] & (ks0[None, :] < K), other=0.0,
                eviction_policy="evict_first")
    u = w
    if GATED:
        u = tl.load(u_rows + ks0[None, :], mask=n_ok[:, None] & (ks0[None, :] < K), other=0.0,
                    eviction_policy="evict_first")
    if PDL:
        # Everything above reads only weights; from here on the previous kernel's outputs are read.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + ks0
            h = _stream_rows(x_ptr, res_ptr, ms, ks, M, K, stride_x, stride_r, ADD_RES_IN)
            if ADD_RES_IN:
                if pid == 0:
                    # Program 0 writes the new residual stream; the others only need its norm.
                    tl.store(res_out_ptr + ms[:, None] * stride_ro + ks[None, :], h,
                             mask=(ms[:, None] < M) & (ks[None, :] < K))
            hf = h.to(tl.float32)
            sum_sq += tl.sum(hf * hf, axis=1)
        rstd = tl.rsqrt(sum_sq / K + eps)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + ks0
        nxt = ks + BLOCK_K
        nxt_mask = n_ok[:, None] & (nxt[None, :] < K)
        w_next = tl.load(w_rows + nxt[None, :], mask=nxt_mask, other=0.0, eviction_policy="evict_first")
        h = _stream_rows(x_ptr, res_ptr, ms, ks, M, K, stride_x, stride_r, ADD_RES_IN)
        if NORM:
            normed = (h.to(tl.float32) * rstd[:, None]).to(h.dtype)
            nw = tl.load(norm_w_ptr + ks, mask=ks < K, other=0.0)
            h = (nw.to(tl.float32)[None, :] * normed.to(tl.float32)).to(h.dtype)
        xf = h.to(tl.float32)
        acc += tl.sum(xf[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        w = w_next
        if GATED:
            u_next = tl.load(u_rows + nxt[None, :], mask=nxt_mask, other=0.0, eviction_policy="evict_first")
            acc_u += tl.sum(xf[:, None, :] * u.to(tl.float32)[None, :, :], axis=2)
            u = u_next

    out_ty = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(bias_ptr + N + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_mask = (ms[:, None] < M) & n_ok[None, :]
    if GATED:
        g = acc.to(out_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
        acc = act * acc_u.to(out_ty).to(tl.float32)
    if ADD_RES_OUT:
        r = tl.load(res_ptr + ms[:, None] * stride_r + ns[None, :], mask=out_mask, other=0.0)
        acc = acc.to(out_ty).to(tl.float32) + r.to(tl.float32)
    tl.store(out_ptr + ms[:, None] * stride_o + ns[None, :], acc.to(out_ty), mask=out_mask)


# Tiles per (rows, K) picked on the H200 by benchmarks/study_gemv.py.
def default_config(m: int, n: int, k: int) -> GemvConfig:
    if m <= 1:
        return GemvConfig(block_n=8, block_k=1024, num_warps=4)
    if m <= 2:
        return GemvConfig(block_n=8, block_k=512, num_warps=4)
    return GemvConfig(block_n=4, block_k=256, num_warps=4)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
         add_residual_in: bool = False, gated: bool = False, pdl: bool = False,
         config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x @ weight.T (+ bias)`` for ``x`` ``[M, K]``, ``M <= MAX_ROWS``, with optional fusions:

    - ``norm_weight``: the input is ``rms_norm(x (+ residual if add_residual_in), norm_weight, eps)``;
      with ``add_residual_in`` the sum is also returned (the new residual stream);
    - ``residual`` without ``add_residual_in``: ``residual`` is added to the result;
    - ``gated``: ``weight`` is ``[gate; up]`` and the result ``silu(x @ gate.T) * (x @ up.T)``.

    Returns ``(out, new_residual)``; ``new_residual`` is None unless ``add_residual_in``.
    """
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {m}")
    if add_residual_in and (residual is None or norm_weight is None):
        raise ValueError("add_residual_in needs a residual and a norm weight")
    for t in (x, weight, residual, norm_weight, bias):
        if t is not None and t.stride(-1) != 1:
            raise ValueError("gemv needs contiguous rows")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(x) if add_residual_in else None
    if m == 0:
        return out, new_residual
    cfg = config or default_config(m, n, k)
    res = residual if residual is not None else x
    res_out = new_residual if new_residual is not None else out
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, res, norm_weight if norm_weight is not None else x, weight, bias if bias is not None else weight,
        out, res_out, m, n, k, x.stride(0), res.stride(0), weight.stride(0), out.stride(0), res_out.stride(0),
        float(eps),
        NORM=norm_weight is not None, ADD_RES_IN=add_residual_in,
        ADD_RES_OUT=residual is not None and not add_residual_in, GATED=gated, HAS_BIAS=bias is not None,
        PDL=pdl, BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, **({"launch_pdl": True} if pdl else {}),
    )
    return out, new_residual
