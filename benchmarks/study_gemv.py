"""Which small-batch projections should run on the fused Triton GEMV (tokenmill/kernels/triton_gemv.py)?

Part 1 times each Llama-3-8B projection alone, cuBLAS against the GEMV's tile configurations, at
1-8 rows. Part 2 times the matmul chain of the decoder layers (norm, qkv, o, norm, gate_up, SiLU,
down; attention left out) as the engine runs it today against the fused variants, with and without
programmatic dependent launch. Everything runs inside CUDA graphs over 32 distinct weight sets (one
per layer, so nothing is served from L2), timed with CUDA events, median of replays; the floor is
the weight bytes over the copy bandwidth measured in the same call.

    python benchmarks/study_gemv.py --out study.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.kernels import triton_ops
from tokenmill.kernels.triton_gemv import GemvConfig, gemv

HIDDEN, QKV, INTER, LAYERS = 4096, 6144, 14336, 32
EPS = 1e-5
SHAPES = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
DT = torch.bfloat16


def copy_bandwidth() -> float:
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
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


CONFIGS_M1 = [GemvConfig(bn, bk, nw) for bn in (4, 8, 16) for bk in (512, 1024, 2048) for nw in (4, 8)]
CONFIGS_MN = [GemvConfig(bn, bk, 4) for bn in (2, 4, 8) for bk in (128, 256, 512)]


def per_op(bandwidth: float) -> tuple[list[dict], dict[tuple[str, int], GemvConfig]]:
    rows, best = [], {}
    for name, (n, k) in SHAPES.items():
        ws = weights(n, k)
        floor_us = n * k * 2 / bandwidth * 1e6
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=DT)
            cublas = time_graph(lambda: [F.linear(x, w) for w in ws]) * 1e3 / LAYERS
            results = []
            for cfg in CONFIGS_M1 if m == 1 else CONFIGS_MN:
                try:
                    out, _ = gemv(x, ws[0], config=cfg)
                    err = ((out.float() - F.linear(x, ws[0]).float()).norm() / F.linear(x, ws[0]).float().norm()).item()
                    us = time_graph(lambda cfg=cfg: [gemv(x, w, config=cfg) for w in ws]) * 1e3 / LAYERS
                except Exception as exc:  # a configuration that does not compile is skipped, and said
                    print(f"  {name} m={m} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                results.append((us, cfg, err))
            us, cfg, err = min(results, key=lambda r: r[0])
            best[(name, m)] = cfg
            row = {"name": f"gemv/{name}/m{m}", "n": n, "k": k, "m": m, "floor_us": floor_us, "cublas_us": cublas,
                   "triton_us": us, "triton_config": cfg.__dict__, "triton_rel_err": err,
                   "all_configs": [{"us": u, **c.__dict__} for u, c, _ in results]}
            rows.append(row)
            print(f"{row['name']:<18} floor {floor_us:7.2f}  cuBLAS {cublas:7.2f}  triton {us:7.2f} {cfg}")
        del ws
        torch.cuda.empty_cache()
    return rows, best


def chains(bandwidth: float, best: dict, m: int) -> list[dict]:
    """The decoder layers' matmul chain: today's path against the fused variants."""
    layer = [{name: torch.randn(*SHAPES[name], device="cuda", dtype=DT) / SHAPES[name][1] ** 0.5
              for name in SHAPES} for _ in range(LAYERS)]
    norms = [(1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(DT) for _ in range(2 * LAYERS)]
    x0 = torch.randn(m, HIDDEN, device="cuda", dtype=DT)
    floor_us = sum(n * k * 2 for n, k in SHAPES.values()) * LAYERS / bandwidth * 1e6

    def cfg(name: str) -> GemvConfig:
        return best[(name, m)]

    def today() -> torch.Tensor:
        x, res = x0, None
        for i, w in enumerate(layer):
            h, res = (triton_ops.rms_norm(x, norms[2 * i], EPS), x) if res is None else \
                triton_ops.rms_norm(x, norms[2 * i], EPS, res)
            qkv = F.linear(h, w["qkv"])
            o = F.linear(qkv[:, :HIDDEN].contiguous(), w["o"])
            h, res = triton_ops.rms_norm(o, norms[2 * i + 1], EPS, res)
            x = F.linear(triton_ops.silu_and_mul(F.linear(h, w["gate_up"])), w["down"])
        return x + res

    def fused(mlp_fused: bool, pdl: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            x, res = x0, None
            for i, w in enumerate(layer):
                if res is None:
                    qkv, _ = gemv(x, w["qkv"], norm_weight=norms[2 * i], eps=EPS, pdl=pdl, config=cfg("qkv"))
                    res = x
                else:
                    qkv, res = gemv(x, w["qkv"], norm_weight=norms[2 * i], eps=EPS, residual=res,
                                    add_residual_in=True, pdl=pdl, config=cfg("qkv"))
                stream, _ = gemv(qkv[:, :HIDDEN].contiguous(), w["o"], residual=res, pdl=pdl, config=cfg("o"))
                if mlp_fused:
                    act, _ = gemv(stream, w["gate_up"], norm_weight=norms[2 * i + 1], eps=EPS, gated=True,
                                  pdl=pdl, config=cfg("gate_up"))
                    x, res = gemv(act, w["down"], residual=stream, pdl=pdl, config=cfg("down"))[0], None
                else:
                    h = triton_ops.rms_norm(stream, norms[2 * i + 1], EPS)
                    x, res = F.linear(triton_ops.silu_and_mul(F.linear(h, w["gate_up"])), w["down"]), stream
            return x if res is None else x + res
        return run

    variants = {"today": today, "fused_attn": fused(False, False), "fused_attn_pdl": fused(False, True),
                "fused_all": fused(True, False), "fused_all_pdl": fused(True, True)}
    reference = today().float()
    rows = []
    for name, fn in variants.items():
        try:
            err = ((fn().float() - reference).norm() / reference.norm()).item()
            ms = time_graph(fn)
        except Exception as exc:
            print(f"chain {name} m={m}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        rows.append({"name": f"chain/{name}/m{m}", "ms": ms, "floor_ms": floor_us / 1e3,
                     "fraction_of_floor": floor_us / 1e3 / ms, "rel_err_vs_today": err})
        print(f"chain {name:<15} m={m}  {ms:.3f} ms  floor {floor_us / 1e3:.3f}  ({floor_us / 1e3 / ms:.0%})  err {err:.1e}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    ops_rows, best = per_op(bandwidth)
    chain_rows = chains(bandwidth, best, 1) + chains(bandwidth, best, 8)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "bandwidth": bandwidth,
              "ops": ops_rows, "chains": chain_rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
