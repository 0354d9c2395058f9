"""Candidates for Q8_0 projections on int8 activations: the rows quantized to int8 in blocks of 32
as the weight is (Q8_0 times Q8_0, as llama.cpp multiplies them), so that the products are integer
ones, against the kernels in use, which bring every int8 weight to float first.

- One row: four int8 products summed by one ``dp4a`` a weight word, against the GEMV in use
  (``triton_gemv._gemv``), which spends about five instructions a weight byte where the copy
  bandwidth leaves room for about seven on the H200 (docs/PERFORMANCE.md, "Q8_0 weights"). The row
  is quantized by a kernel of its own in front ("prequant", its time included) or by each GEMV
  program for the slice it reads ("fused").
- 2-512 rows: the int8 tensor cores, a ``tl.dot`` of int8 tiles a block of 32 along K, each block's
  int32 sums times the weight's and the rows' scales into a float32 accumulator (the weight tile on
  the left, as in ``triton_skinny_matmul``), after the rows' quantization kernel (its time included);
  against what ``linear`` runs now (the few-row matmul, which dequantizes each weight tile in
  registers) and cuBLAS on the bf16 weight.

Each runs inside a CUDA graph over enough weight copies that nothing is served from L2
(``study_gemv.time_graph``), after a check against the torch reference on the dequantized weight
(the rows' quantization adds an error of about 4e-3 of the result's norm, which the check reports).

    TRITON_INTERPRET=1 python benchmarks/studies/study_q8_a8.py --check   # the kernels on the CPU
    python benchmarks/studies/study_q8_a8.py [--rows 1,8,32,128,512] --out study-q8-a8.json
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
import triton
import triton.language as tl

from study_gemv import MODELS, time_graph
from study_q8 import DT, packed_weights, rel_err, time_candidates
from tokenmill.bench.hardware import measure_ceilings, write_rows
from tokenmill.kernels import q8_0, reference, triton_ops
from tokenmill.kernels.triton_gemv import _gemv

PTX = os.environ.get("TRITON_INTERPRET") != "1"
GEMV_SWEEP = list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8)))  # BLOCK_N, BLOCK_K, warps
# BLOCK_M, BLOCK_N, BLOCK_K, warps, stages by the largest row count they are tried at.
MATMUL_SWEEP = {
    16: [(16, bn, bk, 4, st) for bn in (32, 64, 128) for bk in (64, 128) for st in (3, 4)],
    64: [(bm, bn, bk, 4, 4) for bm in (32, 64) for bn in (64, 128) for bk in (64, 128)],
    1 << 62: [(bm, bn, bk, w, 4) for bm in (64, 128) for bn in (64, 128) for bk in (64, 128) for w in (4, 8)],
}


@triton.jit
def _dp4a(a, b, PTX: tl.constexpr):
    """Per int32 word pair, the sum of the four signed byte products (int32)."""
    if PTX:
        out = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=tl.int32,
                                        is_pure=True, pack=1)
    else:
        out = (((a << 24) >> 24) * ((b << 24) >> 24) + ((a << 16) >> 24) * ((b << 16) >> 24)
               + ((a << 8) >> 24) * ((b << 8) >> 24) + (a >> 24) * (b >> 24))
    return out


@triton.jit
def _quantize(x, BLOCK_K: tl.constexpr):
    """``x`` float32 ``[BLOCK_K]`` in blocks of 32: int8 values (int32, -127..127) and each block's
    scale ``[BLOCK_K // 32]`` (absmax / 127; the value rounded half away from zero)."""
    blocks = tl.reshape(x, (BLOCK_K // 32, 32))
    scale = tl.max(tl.abs(blocks), axis=1) / 127.0
    v = blocks * tl.where(scale > 0, 1.0 / scale, 0.0)[:, None]
    return tl.reshape(tl.where(v >= 0, v + 0.5, v - 0.5).to(tl.int32), (BLOCK_K,)), scale


@triton.jit
def _pack_words(q, BLOCK_K: tl.constexpr):
    """int8 values (as int32) ``[BLOCK_K]`` packed four to an int32 word, little-endian."""
    shifts = tl.arange(0, 4) * 8
    return tl.sum(tl.reshape(q & 0xFF, (BLOCK_K // 4, 4)) << shifts[None, :], axis=1)  # disjoint: sum = OR


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, BLOCK_K: tl.constexpr):
    """Program ``(m, j)``: row ``m``'s ``j``-th ``BLOCK_K`` values as int8 ``q`` and their scales."""
    m = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    kb = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    q, scale = _quantize(tl.load(x_ptr + m * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32), BLOCK_K)
    tl.store(q_ptr + m * K + ks, q.to(tl.int8), mask=ks < K)
    tl.store(scale_ptr + m * (K // 32) + kb, scale, mask=kb < K // 32)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` as int8 ``[M, K]`` and float32 scales ``[M, K // 32]``."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scales = torch.empty((m, k // 32), dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(m, triton.cdiv(k, 1024))](x, q, scales, k, x.stride(0), BLOCK_K=1024)
    return q, scales


@triton.jit
def _dp4a_gemv_kernel(x_ptr, xw_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, N, K, stride_w, stride_s,
                      FUSED: tl.constexpr, PTX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out = W x`` for a Q8_0 ``W`` read as int32 words; ``x`` quantized here (``FUSED``) or read
    quantized (``xw`` int8 read as words, ``xs``)."""
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    kw0 = tl.arange(0, BLOCK_K // 4)
    kb0 = tl.arange(0, BLOCK_K // 32)
    w_rows = w_ptr + ns.to(tl.int64)[:, None] * stride_w
    s_rows = s_ptr + ns.to(tl.int64)[:, None] * stride_s
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kw = k0 // 4 + kw0
        kb = k0 // 32 + kb0
        w = tl.load(w_rows + kw[None, :], mask=n_ok[:, None] & (kw[None, :] < K // 4), other=0,
                    eviction_policy="evict_first")
        if FUSED:
            ks = k0 + tl.arange(0, BLOCK_K)
            q, xs = _quantize(tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32), BLOCK_K)
            xw = _pack_words(q, BLOCK_K)
        else:
            xw = tl.load(xw_ptr + kw, mask=kw < K // 4, other=0)
            xs = tl.load(xs_ptr + kb, mask=kb < K // 32, other=0.0)
        dots = tl.sum(tl.reshape(_dp4a(w, xw[None, :], PTX), (BLOCK_N, BLOCK_K // 32, 8)), axis=2)
        ws = tl.load(s_rows + kb[None, :], mask=n_ok[:, None] & (kb[None, :] < K // 32), other=0.0)
        acc += tl.sum(dots.to(tl.float32) * ws.to(tl.float32) * xs[None, :], axis=1)
    tl.store(out_ptr + ns, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def dp4a_gemv(x: torch.Tensor, weight: q8_0.Q8Weight, tiles: tuple[int, int, int], fused: bool) -> torch.Tensor:
    """``x`` ``[1, K]`` times the Q8_0 ``weight`` transposed, the row quantized in blocks of 32."""
    block_n, block_k, warps = tiles
    n, k = weight.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    xw, xs = (x, x) if fused else quantize_rows(x)
    _dp4a_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, xw.view(torch.int32) if not fused else xw, xs, weight.qweight.view(torch.int32), weight.scales, out, n, k,
        weight.qweight.stride(0) // 4, weight.scales.stride(0),
        FUSED=fused, PTX=PTX, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out


@triton.jit(do_not_specialize=["M"])
def _int8_matmul_kernel(xq_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_w, stride_s, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NUM_STAGES: tl.constexpr):
    """``out = xq W^T`` scaled: program ``(j, i)`` owns columns ``j`` and rows ``i``; each block of 32
    along K is one int8 ``tl.dot`` (int32), times the weight's and the rows' scales into float32."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    k32 = tl.arange(0, 32)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    s_rows = s_ptr + cols.to(tl.int64) * stride_s
    x_cols = xq_ptr + rows.to(tl.int64)[None, :] * K
    xs_rows = xs_ptr + rows.to(tl.int64) * (K // 32)
    n_ok, m_ok = cols < N, rows < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        for j in tl.static_range(BLOCK_K // 32):
            ks = k0 + j * 32 + k32
            kb = k0 // 32 + j
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & (ks[None, :] < K), other=0)  # [N, 32]
            xt = tl.load(x_cols + ks[:, None], mask=m_ok[None, :] & (ks[:, None] < K), other=0)  # [32, M]
            ws = tl.load(s_rows + kb, mask=n_ok & (kb + 0 * cols < K // 32), other=0.0).to(tl.float32)
            xs = tl.load(xs_rows + kb, mask=m_ok & (kb + 0 * rows < K // 32), other=0.0)
            acc += tl.dot(w, xt).to(tl.float32) * ws[:, None] * xs[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[None, :] * stride_om + cols[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[None, :] & n_ok[:, None])


def int8_matmul(x: torch.Tensor, weight: q8_0.Q8Weight, tiles: tuple[int, ...]) -> torch.Tensor:
    """``x`` ``[M, K]`` times the Q8_0 ``weight`` transposed on int8 tensor cores, the rows quantized
    in blocks of 32 by a kernel of their own first."""
    block_m, block_n, block_k, warps, stages = tiles
    m, k = x.shape
    n = weight.shape[0]
    xq, xs = quantize_rows(x)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _int8_matmul_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        xq, xs, weight.qweight, weight.scales, out, m, n, k, weight.qweight.stride(0), weight.scales.stride(0),
        out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, num_warps=warps)
    return out


def check() -> None:
    """Every candidate against the reference on the CPU (the interpreter), K ending inside a tile."""
    gen = torch.Generator().manual_seed(0)
    for n, k, gemv_tiles, m, matmul_tiles in ((13, 96, (4, 64, 4), 5, (16, 16, 64, 4, 2)),
                                              (40, 320, (8, 128, 4), 37, (32, 32, 128, 4, 2))):
        weight = q8_0.quantize(torch.randn(n, k, generator=gen) / k**0.5)
        x = torch.randn(m, k, generator=gen)
        for fused in (False, True):
            err = rel_err(dp4a_gemv(x[:1], weight, gemv_tiles, fused), reference.linear(x[:1], weight, None))
            print(f"gemv n={n} k={k} fused={fused}: rel err {err:.1e}")
            assert err < 2e-2, err
        err = rel_err(int8_matmul(x, weight, matmul_tiles), reference.linear(x, weight, None))
        print(f"matmul m={m} n={n} k={k}: rel err {err:.1e}")
        assert err < 2e-2, err


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="check the kernels (under TRITON_INTERPRET=1)")
    parser.add_argument("--rows", default="1,8,32,128,512")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.check:
        check()
        return
    ceilings = measure_ceilings()
    print(f"copy bandwidth {ceilings.bandwidth / 1e12:.2f} TB/s")
    rows = []
    for name, n, k, _ in MODELS["llama3-8b"][2]:
        packed = packed_weights(n, k)
        dense = [w.dequantize(DT) for w in packed[:4]]
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=DT)
            want = reference.linear(x, packed[0], None)
            floor_us = ceilings.floor(n * k * (1 + 2 / 32) + 2 * m * (n + k), 2 * m * n * k) * 1e6
            row = {"name": f"q8_a8/llama3-8b/{name}/m{m}", "m": m, "n": n, "k": k, "floor_us": floor_us,
                   "in_use_us": time_graph(lambda x=x: [triton_ops.linear(x, w, None) for w in packed]) * 1e3
                   / len(packed),
                   "cublas_bf16_us": time_graph(lambda x=x: [torch.nn.functional.linear(x, w) for w in dense]) * 1e3
                   / len(dense)}
            if m == 1:
                for fused in (False, True):
                    row["fused" if fused else "prequant"] = time_candidates(
                        lambda x, w, t, f=fused: dp4a_gemv(x, w, t, f), GEMV_SWEEP, packed, want, x)
                best = min(row["fused"][0], row["prequant"][0], key=lambda t: t["us"])
            else:
                row["int8_mma"] = time_candidates(int8_matmul, next(v for b, v in sorted(MATMUL_SWEEP.items())
                                                                     if m <= b), packed, want, x)
                best = row["int8_mma"][0]
            row["best"] = best
            row["fraction_of_floor"] = floor_us / best["us"]
            rows.append(row)
            print(f"{name:<8} m={m:<4} floor {floor_us:6.2f} us  in use {row['in_use_us']:6.2f}  cuBLAS bf16 "
                  f"{row['cublas_bf16_us']:6.2f}  int8 activations {best['us']:6.2f} {best['tiles']} "
                  f"err {best['rel_err']:.1e}", flush=True)
        del packed, dense
        torch.cuda.empty_cache()
    if args.out:
        write_rows(args.out, ceilings, rows)


if __name__ == "__main__":
    main()
