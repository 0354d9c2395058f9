"""A candidate for the one-row Q8_0 GEMV: the row quantized to int8 in blocks of 32 as the weight is
(Q8_0 times Q8_0, as llama.cpp multiplies them), and four int8 products summed by one ``dp4a`` a
weight word, against the GEMV in use (``triton_gemv._gemv``), which brings every int8 to float32 and
spends about five instructions a weight byte where the copy bandwidth leaves room for about seven
on the H200 (docs/PERFORMANCE.md, "Q8_0 weights").

Two ways to quantize the row are timed: a kernel of its own in front of the GEMV ("prequant", its
time included), and each GEMV program quantizing the slice it reads ("fused", the row read and
quantized once per program; more rows a program amortize it). Each runs inside a CUDA graph over
enough weight copies that nothing is served from L2 (``study_gemv.time_graph``), after a check
against the torch reference on the dequantized weight (the row's quantization adds an error of
about 1e-3 of the result's norm, which the check reports).

    TRITON_INTERPRET=1 python benchmarks/study_q8_dp4a.py --check   # the kernels on the CPU
    python benchmarks/study_q8_dp4a.py --out study-q8-dp4a.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

from study_gemv import MODELS, time_graph
from study_q8 import DT, packed_weights, rel_err
from tokenmill.bench.hardware import environment, measure_ceilings
from tokenmill.kernels import q8_0, reference
from tokenmill.kernels.triton_gemv import _gemv

PTX = os.environ.get("TRITON_INTERPRET") != "1"
SWEEP = list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8)))  # BLOCK_N, BLOCK_K, warps


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
    """``x`` float32 ``[BLOCK_K]`` in blocks of 32: int8 values packed four to an int32 word
    ``[BLOCK_K // 4]`` (little-endian) and each block's scale ``[BLOCK_K // 32]`` (absmax / 127)."""
    blocks = tl.reshape(x, (BLOCK_K // 32, 32))
    scale = tl.max(tl.abs(blocks), axis=1) / 127.0
    inv = tl.where(scale > 0, 1.0 / scale, 0.0)
    v = blocks * inv[:, None]
    q = tl.where(v >= 0, v + 0.5, v - 0.5).to(tl.int32)
    q = tl.reshape(q & 0xFF, (BLOCK_K // 4, 4))
    shifts = tl.arange(0, 4) * 8
    words = tl.sum(q << shifts[None, :], axis=1)  # disjoint bytes: the sum is their OR
    return words, scale


@triton.jit
def _quantize_row_kernel(x_ptr, words_ptr, scale_ptr, K, BLOCK_K: tl.constexpr):
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    words, scale = _quantize(x, BLOCK_K)
    kw = tl.program_id(0) * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)
    kb = tl.program_id(0) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    tl.store(words_ptr + kw, words, mask=kw < K // 4)
    tl.store(scale_ptr + kb, scale, mask=kb < K // 32)


@triton.jit
def _dp4a_gemv_kernel(x_ptr, xw_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, N, K, stride_w, stride_s,
                      FUSED: tl.constexpr, PTX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out = W x`` for a Q8_0 ``W`` read as int32 words; ``x`` quantized here (``FUSED``) or read
    quantized (``xw``, ``xs``)."""
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
            xw, xs = _quantize(tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32), BLOCK_K)
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
    xw = xs = x
    if not fused:
        xw = torch.empty(k // 4, dtype=torch.int32, device=x.device)
        xs = torch.empty(k // 32, dtype=torch.float32, device=x.device)
        _quantize_row_kernel[(triton.cdiv(k, 1024),)](x, xw, xs, k, BLOCK_K=1024)
    _dp4a_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, xw, xs, weight.qweight.view(torch.int32), weight.scales, out, n, k,
        weight.qweight.stride(0) // 4, weight.scales.stride(0),
        FUSED=fused, PTX=PTX, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out


def check() -> None:
    """Both ways against the reference on the CPU (the interpreter), K ending inside a tile."""
    gen = torch.Generator().manual_seed(0)
    for n, k, tiles in ((13, 96, (4, 64, 4)), (40, 320, (8, 128, 4))):
        weight = q8_0.quantize(torch.randn(n, k, generator=gen) / k**0.5)
        x = torch.randn(1, k, generator=gen)
        want = reference.linear(x, weight, None)
        for fused in (False, True):
            err = rel_err(dp4a_gemv(x, weight, tiles, fused), want)
            print(f"n={n} k={k} fused={fused}: rel err {err:.1e}")
            assert err < 2e-2, err


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="check the kernels (under TRITON_INTERPRET=1)")
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
        x = torch.randn(1, k, device="cuda", dtype=DT)
        want = reference.linear(x, packed[0], None)
        row = {"name": f"q8_dp4a/llama3-8b/{name}", "n": n, "k": k,
               "floor_us": n * k * (1 + 2 / 32) / ceilings.bandwidth * 1e6,
               "gemv_us": time_graph(lambda x=x: [_gemv(x, w, None) for w in packed]) * 1e3 / len(packed)}
        for fused in (False, True):
            timed = []
            for tiles in SWEEP:
                try:
                    err = rel_err(dp4a_gemv(x, packed[0], tiles, fused), want)
                except triton.runtime.errors.OutOfResources:
                    continue
                us = time_graph(lambda x=x, t=tiles, f=fused: [dp4a_gemv(x, w, t, f) for w in packed]) * 1e3
                timed.append({"tiles": list(tiles), "us": us / len(packed), "rel_err": err})
            timed.sort(key=lambda t: t["us"])
            row["fused" if fused else "prequant"] = timed
        best = min(row["fused"][0]["us"], row["prequant"][0]["us"])
        row["fraction_of_floor"] = row["floor_us"] / best
        rows.append(row)
        print(f"{name:<8} floor {row['floor_us']:6.2f} us  GEMV {row['gemv_us']:6.2f}  dp4a prequant "
              f"{row['prequant'][0]['us']:6.2f} {row['prequant'][0]['tiles']}  fused {row['fused'][0]['us']:6.2f} "
              f"{row['fused'][0]['tiles']}  err {row['fused'][0]['rel_err']:.1e}", flush=True)
        del packed
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(ceilings, " ".join(sys.argv)), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
