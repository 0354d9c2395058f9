"""FP8 projections by row count (tokenmill/kernels/triton_gemv.py at one row, triton_skinny_matmul.py and
triton_fp8.py past it) on a model's projections (``--models``, default Llama-3-8B's and Qwen3-0.6B's),
against bf16 through the engine's own path and the floor (the FP8 bytes over the copy bandwidth, or
the FLOPs at the FP8 matrix rate, both measured in the same call). At each row count:

- ``bf16``: ``triton_ops.linear`` on the bf16 weight (the GEMV, the few-row matmul or cuBLAS);
- ``fp8_weight``: the FP8 weight against rows as they are (the GEMV at one row, over ``GEMV_TILES``;
  the few-row matmul past it, its default tiles), what ``linear`` takes up to ``MAX_FP8_ROWS``;
- ``fp8_cublas`` / ``fp8_triton``: the rows quantized per token, then cuBLAS's scaled matmul or the
  Triton one (``MATMUL_TILES``), what ``linear`` takes past it.

The fastest FP8 way at each row count says where ``MAX_FP8_ROWS`` belongs. Each runs inside a CUDA graph
over enough weight copies that nothing is served from L2, after a check against the torch reference.

    python benchmarks/studies/study_fp8.py [--rows 1,8,16,32,64,96,128,256,512,2048] [--models llama3-8b] --out F
"""

from __future__ import annotations

import argparse

import torch
import triton

from study_gemv import L2_BYTES, MODELS, time_graph
from study_q8 import rel_err
from tokenmill.bench.hardware import measure_ceilings, write_rows
from tokenmill.kernels import fp8, reference, triton_ops
from tokenmill.kernels.triton_fp8 import MATMUL_TILE, fp8_matmul
from tokenmill.kernels.triton_gemv import _gemv
from tokenmill.kernels.triton_skinny_matmul import skinny_matmul

DT = torch.bfloat16
GEMV_TILES = [(4, 2048, 4), (8, 1024, 4), (8, 2048, 4), (16, 1024, 4), (4, 1024, 4), (16, 512, 4), (8, 1024, 8),
              (4, 4096, 4), (8, 1024, 4, 2), (4, 2048, 4, 4)]
MATMUL_TILES = [MATMUL_TILE, (64, 128, 128, 4, 3, 8), (128, 256, 128, 8, 3, 8), (128, 128, 128, 4, 4, 8),
                (64, 256, 128, 8, 3, 8)]


def fp8_weights(n: int, k: int) -> list[fp8.FP8Weight]:
    copies = max(4, -(-L2_BYTES // (n * k)))
    return [fp8.quantize_rows(torch.randn(n, k, device="cuda") / k**0.5) for _ in range(copies)]


def timed(fn, weights: list, want: torch.Tensor, tol: float) -> tuple[float, float] | None:
    """(µs a call of ``fn(weight)`` over ``weights`` in a CUDA graph, relative error on the first), None
    where it does not compile."""
    try:
        err = rel_err(fn(weights[0]), want)
    except (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError):
        return None
    if err > tol:
        raise AssertionError(f"relative error {err:.2e} over {tol}")
    return time_graph(lambda: [fn(w) for w in weights]) * 1e3 / len(weights), err


def study(model: str, rows: list[int], ceilings) -> list[dict]:
    out = []
    for name, n, k, _ in MODELS[model][2]:
        packed = fp8_weights(n, k)
        dense = [w.dequantize(DT) for w in packed[: max(4, -(-L2_BYTES // (n * k * 2)))]]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=DT)
            weight_only = reference.fp8_weight_linear(x, packed[0], None)
            quantized = reference.fp8_linear(x, packed[0], None)
            floor_s = ceilings.floor(n * k + 2 * m * (n + k), 0.0, 2 * m * n * k)
            ways: dict[str, tuple[float, float, list | None]] = {}
            result = timed(lambda w: triton_ops.linear(x, w, None), dense, weight_only, 2e-2)
            if result:
                ways["bf16"] = (*result, None)
            if m == 1:
                for tiles in GEMV_TILES:
                    result = timed(lambda w, t=tiles: _gemv(x, w, None, tiles=t), packed, weight_only, 1e-2)
                    if result and ("fp8_weight" not in ways or result[0] < ways["fp8_weight"][0]):
                        ways["fp8_weight"] = (*result, list(tiles))
            elif m <= 256:
                result = timed(lambda w: skinny_matmul(x, w, None), packed, weight_only, 1e-2)
                if result:
                    ways["fp8_weight"] = (*result, None)
            if m >= 8:
                result = timed(lambda w: fp8_matmul(x, w, None), packed, quantized, 1e-2)
                if result:
                    ways["fp8_cublas"] = (*result, None)
                for tile in MATMUL_TILES:
                    result = timed(lambda w, t=tile: fp8_matmul(x, w, None, t), packed, quantized, 1e-2)
                    if result and ("fp8_triton" not in ways or result[0] < ways["fp8_triton"][0]):
                        ways["fp8_triton"] = (*result, list(tile))
            for way, (us, err, tiles) in ways.items():
                row = {"name": f"study_fp8/{model}/{name}/m{m}/{way}", "rows": m, "n": n, "k": k, "us": us,
                       "rel_err": err, "floor_us": floor_s * 1e6, "fraction_of_floor": floor_s * 1e6 / us}
                if tiles:
                    row["tiles"] = tiles
                if way != "bf16" and "bf16" in ways:
                    row["speedup_over_bf16"] = ways["bf16"][0] / us
                out.append(row)
                print(f"{model:12s} {name:8s} m={m:5d} {way:11s} {us:9.1f} us  {row['fraction_of_floor']:.2f} of floor"
                      f"  {row.get('speedup_over_bf16', 1.0):.2f}x bf16", flush=True)
        del packed, dense
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,16,32,64,96,128,256,512,2048")
    parser.add_argument("--models", default="llama3-8b,qwen3-0.6b")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ceilings = measure_ceilings()
    print(f"copy {ceilings.bandwidth / 1e12:.2f} TB/s, FP8 {(ceilings.fp8_matmul_rate or 0) / 1e12:.0f} TFLOP/s")
    rows = [row for model in args.models.split(",") for row in study(model, [int(r) for r in args.rows.split(",")],
                                                                       ceilings)]
    if args.out:
        write_rows(args.out, ceilings, rows)


if __name__ == "__main__":
    main()
