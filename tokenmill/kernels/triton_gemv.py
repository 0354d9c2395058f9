"""Triton GEMV for single-token decode with the projection's neighbours fused in
(see ``reference.norm_linear`` and ``reference.linear_residual``).

At batch 1 a projection's time is streaming its weight, and the small kernels around it cost a
few microseconds each however few bytes they move. Here each program owns ``BLOCK_N`` output
features and walks K with the next weight tile already in flight, and does the neighbours' work
on the way: in front, the RMSNorm of the input row (every program recomputes its statistics from
L2, a tile at a time); behind, the residual add, or SiLU (GeGLU: tanh-GELU) of gate row ``n``
times up row ``N + n``, or tanh-GELU of row ``n`` times element ``n`` of an input row (Gemma 4's
per-layer input gate). Launched with PDL, a program loads its first weight tile before it waits
for the previous kernel, so the weight stream starts under that kernel's tail. What the fusion
and PDL bought, and the sweeps behind ``MAX_ROWS``, ``TILES``, ``Q8_TILES`` and ``SHAPE_TILES``:
docs/PERFORMANCE.md, "Tuning: the one-row GEMV".

A Q8_0 weight (``q8_0.Q8Weight``) streams as int8 with a float16 scale every 32 values: about
half the bytes of bf16. Each block of 32 is summed against the row in float32 and scaled once, so
the weights are never rounded to the activations' dtype (the reference rounds its dequantized
matrix: the two differ by that rounding). An FP8 weight (``fp8.FP8Weight``) streams as float8 e4m3
the same way, its float32 scales applied once a row or once a 128-column block; the row stays in
its dtype (the weight-only product ``reference.fp8_weight_linear``: at one row the time is the
weight's bytes, and quantizing the row too would only add rounding).

Otherwise every rounding follows the unfused torch ops: Llama's normed row and weighted
normed row are each rounded to the input dtype (Gemma's once, as its norms do),
the projection is rounded before the residual add or the activation, and the
activation before the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.reference import Weight
from tokenmill.kernels.triton_activation import gate_activation
from tokenmill.kernels.triton_convert import (
    DENSE,
    FP8_GROUP,
    FP8_ROWS,
    Q8_0,
    bytes4_to_f32,
    ptx_conversions,
    weight_format,
)
from tokenmill.kernels.triton_launch import pdl_launch_args, wait_for_previous_kernel
from tokenmill.kernels.triton_norm import WEIGHTINGS, weigh

# Rows (tokens) the fused GEMV takes; more go to cuBLAS (at 2-8 rows this kernel lost to it:
# benchmarks/results/h200-2026-11-29-stop8/study-gemv-90d5c8a.json).
MAX_ROWS = 1
# Tiles (BLOCK_N, BLOCK_K, num_warps; a fourth, ROW_TILES, gives a program that many consecutive
# tiles of rows, 1 if absent) by kind of projection: picked on the H200 for Llama-3-8B's
# K = 4096 and 14336 (the tile sweep in study-gemv-90d5c8a.json, then the engine's latency with 8 and
# 16 rows for the normed projection: 4.23 vs 4.20 ms); a gated program reads two row sets.
TILES = {"plain": (8, 1024, 4), "norm": (16, 1024, 4), "gated": (4, 1024, 4)}
# A Q8_0 weight's tiles by kind: the fastest of benchmarks/studies/study_q8.py's sweep on the H200 for
# Llama-3-8B (benchmarks/results/h200-2026-12-01/q8-all-rows-38327dc/): qkv 11.17 -> 9.78 us, gate|up
# 39.05 -> 36.58, o 7.04 -> 6.25, down 21.67 -> 17.00 (half the bytes a row: longer K steps pay).
Q8_TILES = {"plain": (4, 2048, 4), "norm": (8, 1024, 4), "gated": (8, 1024, 4)}
# An FP8 weight's tiles: Q8_0's (a byte a value for both; BLOCK_K a multiple of the 128-column scale block).
FP8_TILES = Q8_TILES
# Shapes' own tiles, by (kind, N, K) of a bf16 weight: the fastest of benchmarks/studies/study_gemv.py's sweep
# on the H200 (benchmarks/results/h200-2026-12-01/gemv-tiles-3683d63/), where it beat the kind's tile
# by more than 1%. Gemma-3-4B: qkv 8.74 -> 7.63 us, o 4.50 -> 3.90, down 16.59 -> 14.64; Gemma-3-27B:
# qkv 29.79 -> 26.22, gate|up 117.97 -> 116.47, o 15.81 -> 13.62, down 75.55 -> 59.57; Llama-3-8B
# (o and down with the residual add): o 10.80 -> 10.30, down 32.10 -> 30.13.
SHAPE_TILES = {
    ("norm", 4096, 2560): (16, 512, 8),
    ("plain", 2560, 2048): (8, 2048, 4),
    ("plain", 2560, 10240): (4, 2048, 4),
    ("norm", 8192, 5376): (8, 1024, 4),
    ("gated", 43008, 5376): (4, 512, 4),
    ("plain", 5376, 4096): (8, 2048, 4),
    ("plain", 5376, 21504): (8, 2048, 4),
    ("plain", 4096, 4096): (4, 1024, 4),
    ("plain", 4096, 14336): (4, 2048, 8),
}


@triton.jit
def _row_dots(
    w, xf, s_rows, k0, n_ok, K, FORMAT: tl.constexpr, PTX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """The tile's ``BLOCK_N`` partial dot products with the row ``xf`` ``[1, BLOCK_K]`` (float32). A
    packed weight's values, read four to a word, reach float32 through float16 (``bytes4_to_f32``),
    not the conversion unit; each group that shares a scale (32 Q8_0 values, 128 FP8 ones) is summed
    against ``x`` first and times its scale once: the scales, a row's ``BLOCK_K / group`` consecutive
    values, cost one load and one multiply a group. An FP8 weight scaled by rows leaves its scale to
    the caller, once a row."""
    if FORMAT == DENSE:
        dots = tl.sum(xf * w.to(tl.float32), axis=1)
    else:
        values = bytes4_to_f32(w, FORMAT != Q8_0, PTX)
        if FORMAT == FP8_ROWS:
            dots = tl.sum(values * xf, axis=1)
        else:
            GROUP: tl.constexpr = 32 if FORMAT == Q8_0 else FP8_GROUP
            sums = tl.sum(
                tl.reshape(values, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * tl.reshape(xf, (1, BLOCK_K // GROUP, GROUP)),
                axis=2,
            )
            kb = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            scale = tl.load(s_rows + kb[None, :], mask=n_ok[:, None] & (kb[None, :] < tl.cdiv(K, GROUP)), other=0.0)
            dots = tl.sum(sums * scale.to(tl.float32), axis=1)
    return dots


@triton.jit
def _gemv_kernel(
    x_ptr,
    norm_w_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    N,
    K,
    stride_w,
    stride_s,
    eps,
    NORM: tl.constexpr,
    WEIGHTING: tl.constexpr,
    GATED: tl.constexpr,
    GELU: tl.constexpr,
    ADD_RES: tl.constexpr,
    ACT_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FORMAT: tl.constexpr,
    PTX: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_TILES: tl.constexpr,
):
    """A program owns ``ROW_TILES`` consecutive tiles of ``BLOCK_N`` rows: with more than one, the row's
    statistics are computed once for them all, and the last weight load of a tile fetches the next
    tile's first, so the stream runs on across tiles. ``res_ptr``: the row added to the projection
    (``ADD_RES``), or the row its activation multiplies (``ACT_MUL``)."""
    tile0 = tl.program_id(0) * ROW_TILES
    ks0 = tl.arange(0, BLOCK_K)
    # The weight's elements: a one-byte weight is read as int32 words of four values.
    W_PACK: tl.constexpr = 1 if FORMAT == DENSE else 4
    kw0 = tl.arange(0, BLOCK_K // W_PACK)
    KW = K // W_PACK
    ns = tile0 * BLOCK_N + tl.arange(0, BLOCK_N)
    first = (ns < N)[:, None] & (kw0[None, :] < KW)
    w_rows = w_ptr + ns.to(tl.int64)[:, None] * stride_w
    u_rows = w_rows + N.to(tl.int64) * stride_w
    w = tl.load(w_rows + kw0[None, :], mask=first, other=0.0, eviction_policy="evict_first")
    u = w
    if GATED:
        u = tl.load(u_rows + kw0[None, :], mask=first, other=0.0, eviction_policy="evict_first")
    wait_for_previous_kernel(PDL)

    # The row's statistics, BLOCK_K at a time (a whole row of Gemma-3-27B's 5376 held at once
    # spilled registers): reads from L2, under the first weight tile in flight.
    rstd = 0.0
    if NORM:
        row_sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            row = tl.load(x_ptr + k0 + ks0, mask=k0 + ks0 < K, other=0.0).to(tl.float32)
            row_sq += row * row
        rstd = tl.rsqrt(tl.sum(row_sq, axis=0) / K + eps)
    for t in tl.static_range(ROW_TILES):
        ns = (tile0 + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = ns < N
        w_rows = w_ptr + ns.to(tl.int64)[:, None] * stride_w
        u_rows = w_rows + N.to(tl.int64) * stride_w
        s_rows = w_scale_ptr + ns.to(tl.int64)[:, None] * stride_s  # a packed weight's row scales
        t_rows = s_rows + N.to(tl.int64) * stride_s
        # The next tile's rows and its first K tile (masked off past the program's last tile).
        later = (ns + BLOCK_N < N) & (t + 1 < ROW_TILES)
        later_first = later[:, None] & (kw0[None, :] < KW)
        later_w = w_rows + BLOCK_N * stride_w.to(tl.int64) + kw0[None, :]
        later_u = later_w + N.to(tl.int64) * stride_w
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + ks0
            nxt = (k0 + BLOCK_K) // W_PACK + kw0
            nxt_mask = n_ok[:, None] & (nxt[None, :] < KW)
            w_nxt = w_rows + nxt[None, :]
            u_nxt = u_rows + nxt[None, :]
            if ROW_TILES > 1:  # the tile's last pass fetches the next tile's first weights
                last = k0 + BLOCK_K >= K
                nxt_mask = tl.where(last, later_first, nxt_mask)
                w_nxt = tl.where(last, later_w, w_nxt)
                u_nxt = tl.where(last, later_u, u_nxt)
            w_next = tl.load(w_nxt, mask=nxt_mask, other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
            if NORM:
                if WEIGHTING == 0:  # Llama: the normed row rounded, then the weighted one
                    nw = tl.load(norm_w_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
                    normed = (x.to(tl.float32) * rstd).to(x.dtype)
                    x = (nw * normed.to(tl.float32)).to(x.dtype)
                else:  # Gemma: the weight meets the float32 normed row, one rounding
                    nw = tl.load(norm_w_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
                    x = weigh(x.to(tl.float32) * rstd, nw, WEIGHTING).to(x.dtype)
            xf = x.to(tl.float32)[None, :]
            acc += _row_dots(w, xf, s_rows, k0, n_ok, K, FORMAT, PTX, BLOCK_N, BLOCK_K)
            w = w_next
            if GATED:
                u_next = tl.load(u_nxt, mask=nxt_mask, other=0.0, eviction_policy="evict_first")
                acc_u += _row_dots(u, xf, t_rows, k0, n_ok, K, FORMAT, PTX, BLOCK_N, BLOCK_K)
                u = u_next

        if FORMAT == FP8_ROWS:
            acc *= tl.load(w_scale_ptr + ns * stride_s, mask=n_ok, other=0.0)
            if GATED:
                acc_u *= tl.load(w_scale_ptr + (N + ns) * stride_s, mask=n_ok, other=0.0)
        out_ty = out_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(bias_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)
            if GATED:
                acc_u += tl.load(bias_ptr + N + ns, mask=n_ok, other=0.0).to(tl.float32)
        if GATED or ACT_MUL:
            g = acc.to(out_ty).to(tl.float32)
            act = gate_activation(g, GELU).to(out_ty).to(tl.float32)
            if GATED:
                acc = act * acc_u.to(out_ty).to(tl.float32)
            else:
                acc = act * tl.load(res_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)
        if ADD_RES:
            r = tl.load(res_ptr + ns, mask=n_ok, other=0.0)
            acc = acc.to(out_ty).to(tl.float32) + r.to(tl.float32)
        tl.store(out_ptr + ns, acc.to(out_ty), mask=n_ok)


def _gemv(
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    up: torch.Tensor | None = None,
    weighting: str = "llama",
    activation: str = "silu",
    tiles: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``up``: the projection's ``activation`` times this row (a gate whose other half is an input).
    ``tiles``: force ``(BLOCK_N, BLOCK_K, num_warps[, ROW_TILES])`` (the tile study); default by the
    kind and shape."""
    weight, scales, fmt = weight_format(weight)
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"the fused GEMV takes at most {MAX_ROWS} row, got {m}")
    row = residual if residual is not None else up
    if residual is not None and up is not None:
        raise ValueError("the fused GEMV adds a residual or multiplies by a row, not both")
    if weight.shape[1] != k or (row is not None and row.shape != (m, n)):
        raise ValueError(
            f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}"
            + ("" if row is None else f", row {tuple(row.shape)}")
            + " do not match"
        )
    for t in (x, weight, scales, bias, norm_weight, row):
        if t is not None and t.stride(-1) != 1:
            raise ValueError("the fused GEMV needs contiguous rows")
    if norm_weight is not None and norm_weight.dtype != x.dtype:
        raise ValueError(f"norm weight dtype {norm_weight.dtype} differs from the input's {x.dtype}")
    out_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    kind = "gated" if gated else "norm" if norm_weight is not None else "plain"
    if tiles is None:
        packed_tiles = Q8_TILES if fmt == Q8_0.value else FP8_TILES
        tiles = packed_tiles[kind] if scales is not None else SHAPE_TILES.get((kind, n, k), TILES[kind])
    block_n, block_k, num_warps, row_tiles = (*tiles, 1) if len(tiles) == 3 else tiles
    words = weight if scales is None else weight.view(torch.int32)  # one-byte values read four a word
    _gemv_kernel[(triton.cdiv(triton.cdiv(n, block_n), row_tiles),)](
        x,
        norm_weight if norm_weight is not None else x,
        words,
        scales if scales is not None else weight,
        bias if bias is not None else weight,
        row if row is not None else out,
        out,
        n,
        k,
        words.stride(0),
        scales.stride(0) if scales is not None else 0,
        float(eps),
        NORM=norm_weight is not None,
        WEIGHTING=WEIGHTINGS[weighting],
        GATED=gated,
        GELU=activation == "gelu_tanh",
        ADD_RES=residual is not None,
        ACT_MUL=up is not None,
        HAS_BIAS=bias is not None,
        FORMAT=fmt,
        PTX=ptx_conversions(),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ROW_TILES=row_tiles,
        num_warps=num_warps,
        **pdl_launch_args(x.device),
    )
    return out


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for one row ``x`` ``[1, K]``."""
    return _gemv(x, weight, bias)


def linear_residual(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    """``residual + x @ weight.T (+ bias)`` for one row ``x`` ``[1, K]``."""
    return _gemv(x, weight, bias, residual=residual)


def linear_gelu_mul(x: torch.Tensor, weight: Weight, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x @ weight.T) * up`` for one row ``x`` ``[1, K]`` and ``up`` ``[1, N]``."""
    return _gemv(x, weight, None, up=up, activation="gelu_tanh")


def norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: Weight,
    bias: torch.Tensor | None,
    gated: bool = False,
    weighting: str = "llama",
    activation: str = "silu",
) -> torch.Tensor:
    """``rms_norm(x) @ weight.T (+ bias)`` for one row (the norm's weight applied as ``weighting``
    says: see ``reference.NORMS``), then the gate's ``activation`` (silu or gelu_tanh) times the up
    half with ``gated``."""
    return _gemv(
        x, weight, bias, norm_weight=norm_weight, eps=eps, gated=gated, weighting=weighting, activation=activation
    )
