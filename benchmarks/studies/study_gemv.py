"""The fused single-row GEMV (tokenmill/kernels/triton_gemv.py) against the unfused ops it replaces,
on each projection shape of a model: RMSNorm + qkv, RMSNorm + gate|up + SiLU (GeGLU for Gemma), o and
down + the residual add (Llama), or o and down alone (Gemma, whose blocks are normed before they join
the stream: there the question is the GEMV against cuBLAS on a plain projection, asked with a
zero residual).

Each runs inside a CUDA graph over enough distinct weight sets that nothing is served from L2
(one per layer for Llama-3-8B's 32), timed with CUDA events, median of replays; the floor is the
weight bytes over the copy bandwidth measured in the same call.

The first version of this study (commit 90d5c8a, results in benchmarks/results/h200-2026-11-29-stop8/) also tried 2-8
rows, where the kernel lost to cuBLAS; and without programmatic dependent launch the fused qkv and
gate|up lost too.

    python benchmarks/studies/study_gemv.py [--models llama3-8b,gemma3-4b,...] [--sweep] --out study.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.bench.hardware import environment, measure_ceilings
from tokenmill.kernels import triton_ops
from tokenmill.kernels.triton_gemv import _gemv, linear_residual, norm_linear

EPS = 1e-6
DT = torch.bfloat16
L2_BYTES = 400 << 20  # weights cycled per graph: well past the H200's 50 MB L2
# Per model: (projection, N, K, kind); kinds: "norm" (norm + projection), "gated" (norm + gate|up +
# activation), "residual" (projection + residual add), "plain" (projection alone).
MODELS: dict[str, tuple[str, str, list[tuple[str, int, int, str]]]] = {
    # name: (norm weighting, gate activation, projections)
    "llama3-8b": ("llama", "silu", [("qkv", 6144, 4096, "norm"), ("gate_up", 28672, 4096, "gated"),
                                    ("o", 4096, 4096, "residual"), ("down", 4096, 14336, "residual")]),
    "qwen3-0.6b": ("llama", "silu", [("qkv", 4096, 1024, "norm"), ("gate_up", 6144, 1024, "gated"),
                                     ("o", 1024, 2048, "residual"), ("down", 1024, 3072, "residual")]),
    "gemma3-4b": ("offset", "gelu_tanh", [("qkv", 4096, 2560, "norm"), ("gate_up", 20480, 2560, "gated"),
                                          ("o", 2560, 2048, "plain"), ("down", 2560, 10240, "plain")]),
    "gemma3-27b": ("offset", "gelu_tanh", [("qkv", 8192, 5376, "norm"), ("gate_up", 43008, 5376, "gated"),
                                           ("o", 5376, 4096, "plain"), ("down", 5376, 21504, "plain")]),
    "gemma4-e4b": ("fp32", "gelu_tanh", [("qkv_sliding", 3072, 2560, "norm"), ("qkv_global", 6144, 2560, "norm"),
                                         ("gate_up", 20480, 2560, "gated"), ("o_sliding", 2560, 2048, "plain"),
                                         ("down", 2560, 10240, "plain")]),
    "gemma4-31b": ("fp32", "gelu_tanh", [("qkv_sliding", 16384, 5376, "norm"),
                                         ("qkv_global", 18432, 5376, "norm"), ("gate_up", 43008, 5376, "gated"),
                                         ("o_sliding", 5376, 8192, "plain"), ("down", 5376, 21504, "plain")]),
}


def time_graph(fn: Callable[[], object], replays: int = 20) -> float:
    """Median ms of one replay of a graph of ``fn``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def weights(n: int, k: int) -> list[torch.Tensor]:
    copies = max(4, -(-L2_BYTES // (n * k * DT.itemsize)))
    return [torch.randn(n, k, device="cuda", dtype=DT) / k**0.5 for _ in range(copies)]


def per_op(model: str, bandwidth: float) -> list[dict]:
    """Each projection of ``model`` at one row with its neighbours, unfused (Triton norm and
    activation kernels, cuBLAS, torch add) against the fused GEMV."""
    weighting, activation, projections = MODELS[model]
    norm = {"llama": triton_ops.rms_norm, "offset": triton_ops.offset_rms_norm,
            "fp32": triton_ops.fp32_weight_rms_norm}[weighting]
    act = {"silu": triton_ops.silu_and_mul, "gelu_tanh": triton_ops.gelu_tanh_and_mul}[activation]
    rows = []
    for name, n, k, kind in projections:
        ws = weights(n, k)
        floor_us = n * k * 2 / bandwidth * 1e6
        x = torch.randn(1, k, device="cuda", dtype=DT)
        out_n = n // 2 if kind == "gated" else n
        res = torch.randn(1, out_n, device="cuda", dtype=DT) if kind == "residual" else torch.zeros(1, out_n,
                                                                                                     device="cuda", dtype=DT)
        norm_w = ((0.0 if weighting == "offset" else 1.0) + 0.1 * torch.randn(k, device="cuda")).to(DT)

        def unfused(w: torch.Tensor, kind=kind, x=x, res=res, norm_w=norm_w) -> torch.Tensor:
            if kind == "residual":
                return F.linear(x, w) + res
            if kind == "plain":
                return F.linear(x, w)
            out = F.linear(norm(x, norm_w, EPS), w)
            return act(out) if kind == "gated" else out

        def fused(w: torch.Tensor, kind=kind, x=x, res=res, norm_w=norm_w) -> torch.Tensor:
            if kind in ("residual", "plain"):
                return linear_residual(x, w, None, res)  # plain: a zero residual
            return norm_linear(x, norm_w, EPS, w, None, kind == "gated", weighting=weighting, activation=activation)

        unfused_us = time_graph(lambda ws=ws, f=unfused: [f(w) for w in ws]) * 1e3 / len(ws)
        fused_us = time_graph(lambda ws=ws, f=fused: [f(w) for w in ws]) * 1e3 / len(ws)
        ref = unfused(ws[0]).float()
        err = ((fused(ws[0]).float() - ref).norm() / ref.norm()).item()
        rows.append({"name": f"gemv/{model}/{name}/m1", "n": n, "k": k, "kind": kind, "floor_us": floor_us,
                     "unfused_us": unfused_us, "fused_us": fused_us, "fraction_of_floor": floor_us / fused_us,
                     "unfused_fraction_of_floor": floor_us / unfused_us, "rel_err": err})
        print(f"{model:<11} {name:<12} floor {floor_us:7.2f} us   unfused {unfused_us:7.2f}   "
              f"fused GEMV {fused_us:7.2f}")
        del ws
        torch.cuda.empty_cache()
    return rows


SWEEP = [(block_n, block_k, warps) for block_n in (4, 8, 16, 32) for block_k in (512, 1024, 2048)
         for warps in (4, 8)]


def sweep(model: str, bandwidth: float, row_tiles: tuple[int, ...] = ()) -> list[dict]:
    """The fused GEMV of each projection of ``model`` over ``SWEEP``'s tiles (BLOCK_N, BLOCK_K,
    warps; a gated program reads BLOCK_N rows of each half), fastest first in each row's ``tiles``;
    then the three fastest again with a program owning each of ``row_tiles`` tiles of rows."""
    weighting, activation, projections = MODELS[model]
    rows = []
    for name, n, k, kind in projections:
        ws = weights(n, k)
        x = torch.randn(1, k, device="cuda", dtype=DT)
        norm_w = ((0.0 if weighting == "offset" else 1.0) + 0.1 * torch.randn(k, device="cuda")).to(DT)
        res = torch.zeros(1, n // 2 if kind == "gated" else n, device="cuda", dtype=DT)

        def time_tiles(tiles: tuple[int, ...], x=x, res=res, norm_w=norm_w, kind=kind, ws=ws) -> dict:
            if kind in ("residual", "plain"):
                def run(w: torch.Tensor) -> torch.Tensor:
                    return _gemv(x, w, None, residual=res, tiles=tiles)
            else:
                def run(w: torch.Tensor) -> torch.Tensor:
                    return _gemv(x, w, None, norm_weight=norm_w, eps=EPS, gated=kind == "gated", weighting=weighting,
                                 activation=activation, tiles=tiles)
            us = time_graph(lambda: [run(w) for w in ws]) * 1e3 / len(ws)
            return {"block_n": tiles[0], "block_k": tiles[1], "num_warps": tiles[2],
                    "row_tiles": tiles[3] if len(tiles) > 3 else 1, "us": us}

        timed = sorted((time_tiles(tiles) for tiles in SWEEP), key=lambda t: t["us"])
        timed += [time_tiles((t["block_n"], t["block_k"], t["num_warps"], count))
                  for t in timed[:3] for count in row_tiles]
        timed.sort(key=lambda t: t["us"])
        floor_us = n * k * 2 / bandwidth * 1e6
        rows.append({"name": f"gemv_tiles/{model}/{name}/m1", "n": n, "k": k, "kind": kind, "floor_us": floor_us,
                     "best_us": timed[0]["us"], "fraction_of_floor": floor_us / timed[0]["us"], "tiles": timed})
        best = timed[0]
        print(f"{model:<11} {name:<12} floor {floor_us:7.2f} us   best {best['us']:7.2f} "
              f"(BLOCK_N {best['block_n']}, BLOCK_K {best['block_k']}, {best['num_warps']} warps, "
              f"{best['row_tiles']} row tiles a program)")
        del ws
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--sweep", action="store_true", help="also time the fused GEMV over SWEEP's tiles")
    parser.add_argument("--row-tiles", default="", help="with --sweep: comma-separated tiles of rows a program "
                        "(e.g. 2,4,8) to time the three fastest tiles with")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ceilings = measure_ceilings()
    print(f"copy bandwidth {ceilings.bandwidth / 1e12:.2f} TB/s")
    models = args.models.split(",")
    ops = [row for model in models for row in per_op(model, ceilings.bandwidth)]
    result = {"environment": environment(ceilings, " ".join(sys.argv)), "ops": ops}
    if args.sweep:
        row_tiles = tuple(int(n) for n in args.row_tiles.split(",") if n)
        result["tiles"] = [row for model in models for row in sweep(model, ceilings.bandwidth, row_tiles)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
