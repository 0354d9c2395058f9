"""Where the standard throughput workload's time goes: decode steps against steps that
carry prefill, each beside its floor, then a cProfile of the host over a smaller run. With
``--kv-bound DTYPE``, the same for ``tokenmill bench kvcache``'s KV-bound workload (256 requests of
1024 + 512 tokens in 8 GiB of KV) with that ``kv_cache_dtype``; with ``--kv-long DTYPE``, for
``tokenmill bench kvcache-long``'s (1,024 requests of 2,048 + 1,024 tokens in the whole GPU).

python benchmarks/profile/profile_workload.py [--shape qwen3-0.6b] [--requests 256] [--kv-bound|--kv-long auto|fp8|int8]
    [--out FILE]   (GPU)
"""

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys

from tokenmill.bench.hardware import environment, measure_ceilings
from tokenmill.bench.offline import (add_workload, kv_bound_workload, long_workload, make_engine, release,
                                    run_metered, standard_workload)


SLOWEST = 5  # steps of each kind listed by time


def allocator_events() -> dict[str, int]:
    """The caching allocator's device allocations, frees and retries so far."""
    import torch

    stats = torch.cuda.memory_stats()
    return {name: stats.get(name, 0) for name in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def launch_costs() -> dict[str, float]:
    """Host microseconds to enqueue one call of each op (no synchronisation): what an
    eager step pays per kernel before the GPU sees it."""
    import time

    import torch

    from tokenmill.layers import ops

    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(512, 1024, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.zeros(16, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(4, 16, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    cos_sin = torch.randn(4096, 128, device="cuda")
    pos = torch.arange(4, device="cuda")
    slots = torch.arange(4, device="cuda")
    qsl = torch.arange(5, device="cuda", dtype=torch.int32)
    lens = torch.full((4,), 8, device="cuda", dtype=torch.int32)
    tables = torch.arange(4, device="cuda", dtype=torch.int32)[:, None]
    calls = {
        "rms_norm": lambda: ops.rms_norm(x, w, 1e-6, x),
        "rotary_embedding_and_write_kv": lambda: ops.rotary_embedding_and_write_kv(pos, q, kv, kv, cos_sin, k_cache,
                                                                                   k_cache, slots),
        "paged_attention": lambda: ops.paged_attention(q, k_cache, k_cache, qsl, lens, tables, 0.1, max_query_len=1,
                                                       max_seq_len=8),
        "silu_and_mul": lambda: ops.silu_and_mul(x),
        "torch_linear": lambda: torch.nn.functional.linear(x, weight),
        "torch_add": lambda: x + x,
    }
    out = {}
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(200):
            fn()
        out[name] = (time.perf_counter() - started) / 200 * 1e6
        torch.cuda.synchronize()
        print(f"launch {name:32s} {out[name]:7.1f} us")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=256)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--kv-bound", choices=["auto", "fp8", "fp8_e5m2", "int8"],
                       help="profile the KV-bound workload with this KV cache dtype instead (--requests unused)")
    which.add_argument("--kv-long", choices=["auto", "fp8", "fp8_e5m2", "int8"],
                       help="profile the long KV-bound workload with this KV cache dtype instead (--requests unused)")
    parser.add_argument("--out")
    args = parser.parse_args()
    ceilings = measure_ceilings()
    launches = launch_costs()
    if args.kv_bound or args.kv_long:
        build = kv_bound_workload if args.kv_bound else long_workload
        engine, workload = build(args.shape, args.kv_bound or args.kv_long)
    else:
        engine = make_engine(args.shape, max_num_seqs=256, max_num_batched_tokens=8192)
        workload = standard_workload(args.requests, vocab=engine.model_config.vocab_size)
    vocab = engine.model_config.vocab_size
    add_workload(engine, workload)
    before = allocator_events()
    records, wall, _ = run_metered(engine, ceilings)
    result = {"environment": environment(ceilings, " ".join(sys.argv)), "shape": args.shape,
              "requests": len(workload), "kv_bound": args.kv_bound, "kv_long": args.kv_long, "seconds": wall,
              "launch_us": launches, "compiles_after_startup": engine.get_stats().num_compiles_after_startup,
              "preemptions": engine.get_stats().num_preemptions}
    print(f"kernel variants compiled during the run: {result['compiles_after_startup']}; "
          f"preemptions: {result['preemptions']}")
    # A step that waits on the device allocator (a new segment, or a retry that frees the cache first).
    result["allocator_during_run"] = {k: v - before[k] for k, v in allocator_events().items()}
    print(f"allocator during the run: {result['allocator_during_run']}")
    numbered = list(enumerate(records))
    for kind, steps in (("decode", [(i, r) for i, r in numbered if r.decode]),
                        ("mixed", [(i, r) for i, r in numbered if not r.decode])):
        rows = [r for _, r in steps]
        slowest = sorted(steps, key=lambda step: -step[1].seconds)[:SLOWEST]
        result[kind] = {
            "steps": len(rows), "seconds": sum(r.seconds for r in rows), "floor_seconds": sum(r.floor for r in rows),
            "median_ms": statistics.median(r.seconds for r in rows) * 1e3 if rows else 0.0,
            "mean_batch": statistics.mean(r.batch_size for r in rows) if rows else 0.0,
            "mean_tokens": statistics.mean(r.tokens for r in rows) if rows else 0.0,
            # A mean far above the median comes from a few steps: which ones, and what they carried.
            "slowest": [{"step": i, "ms": r.seconds * 1e3, "floor_ms": r.floor * 1e3, "batch": r.batch_size,
                         "tokens": r.tokens} for i, r in slowest],
        }
        k = result[kind]
        print(f"{kind:6s} steps {k['steps']:5d}  {k['seconds']:.2f} s (floor {k['floor_seconds']:.2f} s)  "
              f"median {k['median_ms']:.2f} ms  batch {k['mean_batch']:.0f}  tokens {k['mean_tokens']:.0f}")
        print("       slowest: " + ", ".join(f"step {s['step']} {s['ms']:.1f} ms ({s['batch']} seqs, {s['tokens']} tokens)"
                                          for s in k["slowest"]))
    add_workload(engine, standard_workload(64, vocab=vocab, seed=1), prefix="p")
    profile = cProfile.Profile()
    profile.enable()
    while engine.has_unfinished_requests():
        engine.step()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue()[:6000])
    result["host_profile"] = text.getvalue()
    del engine
    release()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
