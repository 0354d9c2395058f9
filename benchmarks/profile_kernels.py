"""Where a decode step's GPU time goes, kernel by kernel, and how the small-batch GEMV
fares against cuBLAS on the real projection shapes.

python benchmarks/profile_kernels.py [--shape llama3-8b] [--batch 1] [--out FILE]   (GPU)
"""

import argparse
import collections
import functools
import itertools
import json
import random
import time

import torch
import torch.nn.functional as F
import triton

from tokenmill.bench.hardware import measure_ceilings
from tokenmill.bench.offline import make_engine, random_prompt
from tokenmill.kernels import triton_gemv
from tokenmill.sampling_params import SamplingParams


def _graph_us(fn) -> float:
    """Microseconds per call, replayed from a CUDA graph: no launch overhead, as in a decode step."""
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def gemv_sweep(cfg, bandwidth: float, rows: list[int]) -> list[dict]:
    """cuBLAS against the best of a few GEMV configurations, per projection shape, in graphs."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i),
              "lm_head": (cfg.vocab_size, h)}
    out = []
    for (name, (n, k)), m in itertools.product(shapes.items(), rows):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, w)
        row = {"name": f"gemv/{name}/m{m}", "n": n, "k": k, "m": m, "floor_us": n * k * 2 / bandwidth * 1e6,
               "cublas_us": _graph_us(functools.partial(F.linear, x, w))}
        for gated in (False, True) if name == "gate_up" else (False,):
            width = n // 2 if gated else n
            res = torch.empty(m, width, device="cuda", dtype=torch.bfloat16)
            want = F.silu(ref[:, :width]) * ref[:, width:] if gated else ref
            best = None
            for block_n, block_k, warps in itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8)):
                launch = functools.partial(
                    triton_gemv._gemv_kernel[(triton.cdiv(width, block_n),)], x, w, w, res, m, width, k,
                    x.stride(0), w.stride(0), res.stride(0), HAS_BIAS=False, GATED=gated,
                    BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
                launch()
                err = (res.float() - want.float()).abs().max().item()
                t = _graph_us(launch)
                if best is None or t < best[0]:
                    best = (t, {"block_n": block_n, "block_k": block_k, "num_warps": warps}, err)
            key = "triton_gated" if gated else "triton"
            row[f"{key}_us"], row[f"{key}_config"], row[f"{key}_max_err"] = best
        out.append(row)
        print(f"{row['name']:20s} floor {row['floor_us']:7.1f}  cublas {row['cublas_us']:7.1f}  "
              f"triton {row['triton_us']:7.1f} {row['triton_config']} err {row['triton_max_err']:.3g}"
              + (f"  gated {row['triton_gated_us']:.1f} {row['triton_gated_config']}" if "triton_gated_us" in row
                 else ""))
    return out


def kernel_profile(engine, steps: int) -> list[dict]:
    """Per-kernel GPU time per step (kernels inside CUDA graphs included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type.name == "CUDA":
            entry = totals[event.name[:90]]
            entry[0] += event.device_time
            entry[1] += 1
    rows = sorted(({"kernel": k, "us_per_step": v[0] / steps, "calls_per_step": v[1] / steps}
                   for k, v in totals.items()), key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    print(f"kernel time per step {total:.1f} us")
    for r in rows[:28]:
        print(f"  {r['us_per_step']:8.1f} us  {r['calls_per_step']:6.1f}x  {r['kernel']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rows", default="1")
    parser.add_argument("--out")
    args = parser.parse_args()
    ceilings = measure_ceilings()
    engine = make_engine(args.shape, max_num_seqs=max(8, args.batch))
    print(f"bandwidth {ceilings.bandwidth / 1e12:.2f} TB/s")
    result = {"gemv": gemv_sweep(engine.model_config, ceilings.bandwidth, [int(r) for r in args.rows.split(",")])}
    prompt = random_prompt(random.Random(0), 128, engine.model_config.vocab_size)
    for i in range(args.batch):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True),
                           stream=False)
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(50):
        engine.step()
    result["step_ms"] = (time.perf_counter() - started) / 50 * 1e3
    print(f"engine step {result['step_ms']:.3f} ms (batch {args.batch}, context ~140-190)")
    result["graphed"] = kernel_profile(engine, 20)
    graphs, engine.runner.graphs = engine.runner.graphs, None
    result["eager"] = kernel_profile(engine, 10)
    engine.runner.graphs = graphs
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
