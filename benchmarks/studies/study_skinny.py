"""The few-row matmul (tokenmill/kernels/triton_skinny_matmul.py: ``weight @ x.T``, K split with a
fixed-order reduction) on a model's projections (``--models``, default Llama-3-8B's) at 4-64 rows and
past them (``--rows 128,256,512,2048``, where the engine gives it Q8_0 weights only; dense ones there
also try 64-row tiles of 128 columns and 128-row tiles of 4 warps), dense bf16 and Q8_0
(``--kinds``), over its tiles, beside cuBLAS on
the bf16 weight and the floor (the weight's bytes over the copy bandwidth measured in the same call,
or the FLOPs at the measured matmul rate where that is longer). Each runs inside a CUDA graph over
enough weight copies that nothing is served from L2 (``study_gemv.time_graph``), after a check
against the torch reference. The variants compile in parallel processes first (Triton's disk
cache), then load in this one.

    python benchmarks/studies/study_skinny.py [--rows 4,8,16,32,64] [--models llama3-8b,gemma3-4b] [--kinds bf16,q8] \
        --out study-skinny.json
"""

from __future__ import annotations

import argparse
import multiprocessing

import torch
import torch.nn.functional as F

from study_gemv import L2_BYTES, MODELS, time_graph
from study_q8 import DT, packed_weights, time_candidates
from tokenmill.bench.hardware import measure_ceilings, write_rows
from tokenmill.kernels import reference
from tokenmill.kernels.q8_0 import quantize
from tokenmill.kernels.triton_skinny_matmul import skinny_matmul

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split_k) by the largest row count they are tried at.
SWEEP = {bound: [(block_m, bn, bk, 4, 4, sk) for bn in (64, 128) for bk in (128, 256) for sk in (1, 2, 4, 8)]
         for bound, block_m in ((16, 16), (32, 32), (64, 64))}
# Past 64 rows: 64-row tiles as at 64 rows, and
# 128-row tiles of 8 warps (the fastest of a sweep over 64-128 columns and K steps, 4-8 warps, at
# 128-512 rows: h200-2026-12-01/q8-all-rows-38327dc/study-skinny-large.json), K split or not.
SWEEP[1 << 62] = ([(64, 64, 128, 4, 4, sk) for sk in (1, 2, 4)]
                  + [(128, bn, 128, 8, 3, sk) for bn in (64, 128) for sk in (1, 2, 4)])
# Dense rows past 64 (``--kinds bf16``) also try 64-row tiles of 128 columns and 128-row tiles of 4 warps.
DENSE_LARGE = [(64, 128, 128, 4, 3, sk) for sk in (1, 2, 4)] + [(128, 128, 64, 4, 4, sk) for sk in (1, 2, 4)]


def compile_some(jobs: list[tuple[bool, tuple[int, ...]]]) -> None:
    w = torch.randn(256, 512, device="cuda")
    packed, dense = quantize(w), w.to(DT)
    x = torch.randn(4, 512, device="cuda", dtype=DT)
    for quantized, tiles in jobs:
        try:
            skinny_matmul(x, packed if quantized else dense, None, tiles)
        except Exception as e:  # noqa: BLE001 - reported, the variant is left out of the timing
            print("compile", quantized, tiles, type(e).__name__, str(e)[:200], flush=True)
    torch.cuda.synchronize()


def candidates(m: int, quantized: bool) -> list[tuple[int, ...]]:
    """The tiles timed at ``m`` rows."""
    tiles = next(v for bound, v in sorted(SWEEP.items()) if m <= bound)
    return tiles + DENSE_LARGE if m > 64 and not quantized else tiles


def compile_all(workers: int, kinds: list[str]) -> None:
    jobs = [(q, t) for q in (False, True) if ("q8" if q else "bf16") in kinds
            for t in {t for m in (16, 32, 64, 128) for t in candidates(m, q)}]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers) as pool:
        pool.map(compile_some, [jobs[i::workers] for i in range(workers)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="4,8,16,32,64")
    parser.add_argument("--models", default="llama3-8b", help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--kinds", default="bf16,q8", help="the weights timed: bf16 (dense), q8 (Q8_0), or both")
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    compile_all(args.workers, kinds)
    ceilings = measure_ceilings()
    print(f"copy bandwidth {ceilings.bandwidth / 1e12:.2f} TB/s")
    rows = []
    for model, (name, n, k, _) in ((model, p) for model in args.models.split(",") for p in MODELS[model][2]):
        packed = packed_weights(n, k)
        dense = [w.dequantize(DT) for w in packed[:max(4, -(-L2_BYTES // (n * k * 2)))]]
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=DT)
            row = {"name": f"skinny/{model}/{name}/m{m}", "m": m, "n": n, "k": k,
                   "cublas_bf16_us": time_graph(lambda x=x: [F.linear(x, w) for w in dense]) * 1e3 / len(dense)}
            for kind, weight_bytes in (("bf16", n * k * 2), ("q8", n * k * (1 + 2 / 32))):
                row[f"{kind}_floor_us"] = ceilings.floor(weight_bytes + 2 * m * (n + k), 2 * m * n * k) * 1e6
            for kind, weights in (("bf16", dense), ("q8", packed)):
                if kind not in kinds:
                    continue
                timed = time_candidates(lambda x, w, t: skinny_matmul(x, w, None, t), candidates(m, kind == "q8"),
                                        weights, reference.linear(x, weights[0], None), x)
                row[f"{kind}_best"] = timed[0]
                row[f"{kind}_tiles"] = timed
            row["floor_us"] = row["bf16_floor_us"]  # the row's floor: the dense weight's
            best = row.get("bf16_best", row.get("q8_best"))
            row["fraction_of_floor"] = row["bf16_floor_us"] / best["us"]
            rows.append(row)
            print(f"{model} {name:<8} m={m:<3} bf16: floor {row['bf16_floor_us']:6.2f} cuBLAS "
                  f"{row['cublas_bf16_us']:6.2f}" + "".join(
                      f" | {kind}: skinny {row[kind + '_best']['us']:6.2f} {row[kind + '_best']['tiles']}"
                      for kind in kinds if kind + "_best" in row), flush=True)
        del packed, dense
        torch.cuda.empty_cache()
    if args.out:
        write_rows(args.out, ceilings, rows)


if __name__ == "__main__":
    main()
