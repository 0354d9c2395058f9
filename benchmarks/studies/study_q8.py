"""The fused one-row Q8_0 GEMV (tokenmill/kernels/triton_gemv.py, with its neighbours: the norm in
front of qkv and gate|up, the activation behind gate|up, the residual add behind o and down) on
Llama-3-8B's shapes over its tiles, against the bf16 GEMV and the floor (the packed bytes, int8
values and a float16 scale every 32, over the copy bandwidth measured in the same call). More rows
take the few-row matmul: benchmarks/studies/study_skinny.py.

Each runs inside a CUDA graph over enough distinct weight sets that nothing is served from L2
(``study_gemv.time_graph``); each variant is first checked against the torch reference.

    python benchmarks/studies/study_q8.py --out study-q8.json
"""

from __future__ import annotations

import argparse

import torch
import triton

from study_gemv import EPS, L2_BYTES, MODELS, time_graph
from tokenmill.bench.hardware import measure_ceilings, write_rows
from tokenmill.kernels import q8_0, reference
from tokenmill.kernels.triton_gemv import _gemv

DT = torch.bfloat16
GEMV_SWEEP = [(block_n, block_k, warps) for block_n in (4, 8, 16, 32) for block_k in (1024, 2048, 4096)
              for warps in (4, 8)]
# And the kinds' default tiles with a program owning several tiles of rows.
GEMV_SWEEP += [(block_n, 1024, 4, row_tiles) for block_n in (4, 16) for row_tiles in (2, 4, 8)]


def packed_weights(n: int, k: int) -> list[q8_0.Q8Weight]:
    copies = max(4, -(-L2_BYTES // (n * k)))
    return [q8_0.quantize(torch.randn(n, k, device="cuda") / k**0.5) for _ in range(copies)]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def time_candidates(fn, candidates: list[tuple], weights: list, want: torch.Tensor, x: torch.Tensor) -> list[dict]:
    """Each candidate tile's median µs a call of ``fn(x, weight, tiles)`` over ``weights`` (in a CUDA
    graph) and its error against ``want`` on the first weight, fastest first; a candidate that does
    not compile (out of shared memory or registers, or refused) is left out."""
    out = []
    for tiles in candidates:
        try:
            err = rel_err(fn(x, weights[0], tiles), want)
        except (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError):
            continue
        us = time_graph(lambda t=tiles: [fn(x, w, t) for w in weights]) * 1e3 / len(weights)
        out.append({"tiles": list(tiles), "us": us, "rel_err": err})
    return sorted(out, key=lambda t: t["us"])


def gemv_rows(bandwidth: float) -> list[dict]:
    """One row: the bf16 fused GEMV (its default tiles) and the Q8_0 one over ``GEMV_SWEEP``."""
    rows = []
    for name, n, k, kind in MODELS["llama3-8b"][2]:
        packed = packed_weights(n, k)
        dense = [w.dequantize(DT) for w in packed[:max(4, -(-L2_BYTES // (n * k * 2)))]]
        x = torch.randn(1, k, device="cuda", dtype=DT)
        norm_w = (1.0 + 0.1 * torch.randn(k, device="cuda")).to(DT)
        res = torch.randn(1, n // 2 if kind == "gated" else n, device="cuda", dtype=DT)

        def run(w, tiles=None, kind=kind, x=x, norm_w=norm_w, res=res) -> torch.Tensor:
            if kind == "residual":
                return _gemv(x, w, None, residual=res, tiles=tiles)
            return _gemv(x, w, None, norm_weight=norm_w, eps=EPS, gated=kind == "gated", tiles=tiles)

        def ref(w, kind=kind, x=x, norm_w=norm_w, res=res) -> torch.Tensor:
            if kind == "residual":
                return reference.linear_residual(x, w, None, res)
            return reference.norm_linear(x, norm_w, EPS, w, None, kind == "gated")

        bf16_us = time_graph(lambda: [run(w) for w in dense]) * 1e3 / len(dense)
        timed = time_candidates(lambda x, w, t: run(w, t), GEMV_SWEEP, packed, ref(packed[0]), x)
        default_us = time_graph(lambda: [run(w) for w in packed]) * 1e3 / len(packed)
        floor_us = n * k * (1 + 2 / 32) / bandwidth * 1e6
        best = timed[0]
        rows.append({"name": f"q8_gemv/llama3-8b/{name}/m1", "n": n, "k": k, "kind": kind, "floor_us": floor_us,
                     "bf16_us": bf16_us, "bf16_floor_us": n * k * 2 / bandwidth * 1e6, "default_us": default_us,
                     "best_us": best["us"], "fraction_of_floor": floor_us / best["us"], "tiles": timed})
        print(f"gemv {name:<8} floor {floor_us:7.2f} us  bf16 {bf16_us:7.2f}  q8 default {default_us:7.2f}  "
              f"best {best['us']:7.2f} (BLOCK_N, BLOCK_K, warps[, row tiles] {best['tiles']}; "
              f"err {best['rel_err']:.1e})")
        del packed, dense
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ceilings = measure_ceilings()
    print(f"copy bandwidth {ceilings.bandwidth / 1e12:.2f} TB/s")
    rows = gemv_rows(ceilings.bandwidth)
    if args.out:
        write_rows(args.out, ceilings, rows)


if __name__ == "__main__":
    main()
