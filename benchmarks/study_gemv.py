"""The fused single-row GEMV (tokenmill/kernels/triton_gemv.py) against cuBLAS plus the residual add,
on each Llama-3-8B projection shape; the engine uses it for o and down, where it wins.

Each runs inside a CUDA graph over 32 distinct weight sets (one per layer, so nothing is served
from L2), timed with CUDA events, median of replays; the floor is the weight bytes over the copy
bandwidth measured in the same call (after a warm-up copy, so the clocks are up).

The first version of this study (commit 90d5c8a, results in benchmarks/results/) also tried the
GEMV for qkv and gate|up with the RMSNorm folded in front and SiLU-and-multiply behind, and for
2-8 rows: all lost to cuBLAS, and only the one-row o/down variant was kept.

    python benchmarks/study_gemv.py --out study.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.kernels.triton_gemv import linear_residual

HIDDEN, QKV, INTER, LAYERS = 4096, 6144, 14336, 32
SHAPES = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
DT = torch.bfloat16


def copy_bandwidth() -> float:
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(20):  # bring the clocks up before the graph is timed
        b.copy_(a)
    ms = time_graph(lambda: b.copy_(a), replays=10)
    return 2 * a.numel() / (ms * 1e-3)


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
    return [torch.randn(n, k, device="cuda", dtype=DT) / k**0.5 for _ in range(LAYERS)]


def per_op(bandwidth: float) -> list[dict]:
    """One row: ``residual + x @ W.T`` through cuBLAS and the add, against the fused GEMV."""
    rows = []
    for name, (n, k) in SHAPES.items():
        ws = weights(n, k)
        floor_us = n * k * 2 / bandwidth * 1e6
        x = torch.randn(1, k, device="cuda", dtype=DT)
        res = torch.randn(1, n, device="cuda", dtype=DT)
        cublas = time_graph(lambda ws=ws, x=x, res=res: [F.linear(x, w) + res for w in ws]) * 1e3 / LAYERS
        fused = time_graph(lambda ws=ws, x=x, res=res: [linear_residual(x, w, None, res) for w in ws]) * 1e3 / LAYERS
        ref = F.linear(x, ws[0]) + res
        err = ((linear_residual(x, ws[0], None, res).float() - ref.float()).norm() / ref.float().norm()).item()
        rows.append({"name": f"gemv/{name}/m1", "n": n, "k": k, "floor_us": floor_us, "cublas_add_us": cublas,
                     "fused_us": fused, "rel_err": err})
        print(f"{name:<8} floor {floor_us:7.2f} us   cuBLAS + add {cublas:7.2f}   fused GEMV {fused:7.2f}")
        del ws
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "bandwidth": bandwidth,
              "ops": per_op(bandwidth)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
