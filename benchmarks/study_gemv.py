"""The fused single-row GEMV (tokenmill/kernels/triton_gemv.py) against the unfused ops it replaces,
on each Llama-3-8B projection shape: RMSNorm + qkv, RMSNorm + gate|up + SiLU-and-multiply, o and
down + the residual add.

Each runs inside a CUDA graph over 32 distinct weight sets (one per layer, so nothing is served
from L2), timed with CUDA events, median of replays; the floor is the weight bytes over the copy
bandwidth measured in the same call.

The first version of this study (commit 90d5c8a, results in benchmarks/results/) also tried 2-8
rows, where the kernel lost to cuBLAS; and without programmatic dependent launch the fused qkv and
gate|up lost too.

    python benchmarks/study_gemv.py --out study.json
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
from tokenmill.kernels.triton_gemv import linear_residual, norm_linear

HIDDEN, QKV, INTER, LAYERS = 4096, 6144, 14336, 32
EPS = 1e-5
SHAPES = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
DT = torch.bfloat16


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
    """Each projection at one row with its neighbours, unfused (Triton norm and SiLU kernels, cuBLAS,
    torch add) against the fused GEMV."""
    rows = []
    for name, (n, k) in SHAPES.items():
        ws = weights(n, k)
        floor_us = n * k * 2 / bandwidth * 1e6
        x = torch.randn(1, k, device="cuda", dtype=DT)
        res = torch.randn(1, n, device="cuda", dtype=DT)
        norm_w = (1 + 0.1 * torch.randn(k, device="cuda")).to(DT)
        gated = name == "gate_up"

        def unfused(w: torch.Tensor, name=name, x=x, res=res, norm_w=norm_w, gated=gated) -> torch.Tensor:
            if name in ("o", "down"):
                return F.linear(x, w) + res
            out = F.linear(triton_ops.rms_norm(x, norm_w, EPS), w)
            return triton_ops.silu_and_mul(out) if gated else out

        def fused(w: torch.Tensor, name=name, x=x, res=res, norm_w=norm_w, gated=gated) -> torch.Tensor:
            if name in ("o", "down"):
                return linear_residual(x, w, None, res)
            return norm_linear(x, norm_w, EPS, w, None, gated)

        unfused_us = time_graph(lambda ws=ws, f=unfused: [f(w) for w in ws]) * 1e3 / LAYERS
        fused_us = time_graph(lambda ws=ws, f=fused: [f(w) for w in ws]) * 1e3 / LAYERS
        ref = unfused(ws[0]).float()
        err = ((fused(ws[0]).float() - ref).norm() / ref.norm()).item()
        rows.append({"name": f"gemv/{name}/m1", "n": n, "k": k, "floor_us": floor_us, "unfused_us": unfused_us,
                     "fused_us": fused_us, "rel_err": err})
        print(f"{name:<8} floor {floor_us:7.2f} us   unfused {unfused_us:7.2f}   fused GEMV {fused_us:7.2f}")
        del ws
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ceilings = measure_ceilings()
    print(f"copy bandwidth {ceilings.bandwidth / 1e12:.2f} TB/s")
    result = {"environment": environment(ceilings, " ".join(sys.argv)), "ops": per_op(ceilings.bandwidth)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
