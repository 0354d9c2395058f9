"""Where a decode step's GPU time goes, kernel by kernel (kernels inside CUDA graphs
included), next to the step's wall time.

python benchmarks/profile/profile_kernels.py [--shape llama3-8b] [--batch 1] [--context 128] [--kv-cache-dtype int8]
                                    [--quantization q8_0] [--no-eager] [--out FILE]   (GPU)

The GPU's idle time is measured inside the profiled window (no kernel running, between two). The
timed steps' wall time, taken without the profiler, need not equal the kernels' sum plus that idle
time: the profiler stretches short kernels, and programmatic dependent launch overlaps them.
"""

import argparse
import collections
import json
import random
import statistics
import time

import torch

from tokenmill.bench.hardware import measure_ceilings
from tokenmill.bench.offline import add_workload, make_engine, random_prompt, standard_workload
from tokenmill.sampling_params import SamplingParams


def decoding_engine(shape: str, batch: int, max_tokens: int, warm_steps: int, context: int = 128, **options):
    """An engine of ``shape`` (random weights) decoding ``batch`` random prompts of ``context`` tokens
    (a long prompt each, so that no prefix is shared), greedily, ``warm_steps`` steps after the last
    prompt's prefill (its graphs replaying)."""
    engine = make_engine(shape, **{"max_num_seqs": max(8, batch), "max_model_len": max(8192, context + max_tokens),
                                   "max_num_batched_tokens": max(8192, context), **options})
    rng, vocab = random.Random(0), engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), random_prompt(rng, context, vocab), params, stream=False)
    running = engine.core.scheduler.running
    while engine.has_unfinished_requests() and (len(running) < batch or any(seq.num_computed_tokens < context
                                                                           for seq in running)):
        engine.step()
    for _ in range(warm_steps):
        engine.step()
    torch.cuda.synchronize()
    return engine


def kernel_profile(engine, steps: int) -> dict:
    """Per-kernel GPU time per step (kernels inside CUDA graphs included) and the GPU's idle time
    (``kernel_profile_of``); with overlapped steps, ``steps`` calls of ``engine.step`` run about
    ``steps`` steps."""
    return kernel_profile_of(lambda: [engine.step() for _ in range(steps)], steps)


def kernel_profile_of(work, steps: int) -> dict:
    """Per-kernel GPU time of ``work()``, divided by ``steps``, the biggest printed; then where the GPU
    ran no kernel between two (``idle_gaps``), in total and for the pairs around the longest gaps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    spans = []
    calls: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)  # (start, duration) a kernel
    for event in prof.events():
        if event.device_type.name == "CUDA":
            spans.append((event.name[:60], event.time_range.start, event.time_range.end))
            calls[event.name[:90]].append((event.time_range.start, event.device_time))
    rows = sorted(({"kernel": k, "us_per_step": sum(d for _, d in v) / steps, "calls_per_step": len(v) / steps}
                   for k, v in calls.items()), key=lambda r: -r["us_per_step"])
    # The costliest kernel's n-th call of a step (e.g. each layer's attention), median over the steps.
    top = sorted(calls[rows[0]["kernel"]]) if rows else []
    per_step = max(1, round(len(top) / steps))
    by_call = [statistics.median(d for _, d in top[j::per_step]) for j in range(min(per_step, len(top)))]
    if by_call:
        print(f"{rows[0]['kernel'][:60]} by call in a step (us): " + " ".join(f"{d:.1f}" for d in by_call))
    total = sum(r["us_per_step"] for r in rows)
    print(f"kernel time per step {total:.1f} us, {sum(r['calls_per_step'] for r in rows):.0f} kernels")
    for r in rows[:28]:
        print(f"  {r['us_per_step']:8.1f} us  {r['calls_per_step']:6.1f}x  {r['kernel']}")
    gaps = idle_gaps(spans)
    idle = sum(gaps.values()) / steps
    longest = [{"after": after, "before": before, "us_per_step": us / steps}
               for (after, before), us in sorted(gaps.items(), key=lambda item: -item[1])[:8]]
    print(f"idle between kernels {idle:.1f} us a step; the longest, after -> before:")
    for gap in longest:
        print(f"  {gap['us_per_step']:8.1f} us  {gap['after']} -> {gap['before']}")
    return {"kernels": rows, "idle_us_per_step": idle, "longest_idle": longest, "top_kernel_by_call_us": by_call}


def idle_gaps(spans: list[tuple[str, float, float]]) -> dict[tuple[str, str], float]:
    """The time (the spans' unit) in which no kernel ran, from each kernel's end to the next start
    after it, summed per pair of kernel names; ``spans``: (name, start, end) of every kernel, of one
    or more streams in any order (overlapping kernels leave no gap)."""
    gaps: dict[tuple[str, str], float] = collections.defaultdict(float)
    ordered = sorted(spans, key=lambda span: span[1])
    busy_until, last = None, None
    for name, start, end in ordered:
        if busy_until is not None and start > busy_until:
            gaps[(last, name)] += start - busy_until
        if busy_until is None or end >= busy_until:
            busy_until, last = end, name
    return dict(gaps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prefill", action="store_true",
                        help="profile the first two steps of the standard workload (8192-token prefill chunks)")
    parser.add_argument("--context", type=int, default=128, help="tokens in each request's prompt")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e5m2 or int8")
    parser.add_argument("--quantization", default=None, help="weights: e.g. q8_0 (default: the model's dtype)")
    parser.add_argument("--no-eager", action="store_true", help="profile the graphed steps only")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.prefill:
        engine = make_engine(args.shape, max_num_seqs=256, max_num_batched_tokens=8192)
        vocab = engine.model_config.vocab_size
        for seed in (1, 0):  # a whole warm-up run (Triton compiles), then the profiled steps
            add_workload(engine, standard_workload(24, seed=seed, vocab=vocab), prefix=f"{seed}-")
            if seed:
                while engine.has_unfinished_requests():
                    engine.step()
        torch.cuda.synchronize()
        started = time.perf_counter()
        profiled = kernel_profile(engine, 2)  # launches steps 1-3, completes 1-2: ~13.5k prompt tokens
        print(f"first two steps {(time.perf_counter() - started) * 1e3:.1f} ms under the profiler")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"shape": args.shape, "prefill_steps": profiled}, f, indent=1)
        return
    ceilings = measure_ceilings()
    # A long prompt is prefilled while the first requests decode: enough tokens for every request to
    # decode through the last prefill, the warm steps and the timed and profiled ones.
    max_tokens = 300 + args.batch * args.context // 8192
    engine = decoding_engine(args.shape, args.batch, max_tokens, 10, args.context, quantization=args.quantization,
                             kv_cache_dtype=args.kv_cache_dtype)
    print(f"bandwidth {ceilings.bandwidth / 1e12:.2f} TB/s")
    result = {"bandwidth": ceilings.bandwidth, "batch": args.batch, "context": args.context,
              "kv_cache_dtype": args.kv_cache_dtype}
    # Each window's start and end in seconds since the epoch, to line up with a clock and power log
    # taken beside the run (``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw -lms 200``).
    result["timed_window"] = [time.time()]
    started = time.perf_counter()
    for _ in range(50):
        engine.step()
    torch.cuda.synchronize()  # the last step launched is in flight when step() returns
    result["step_ms"] = (time.perf_counter() - started) / 50 * 1e3
    result["timed_window"].append(time.time())
    print(f"engine step {result['step_ms']:.3f} ms (batch {args.batch}, "
          f"context ~{args.context + 20}-{args.context + 70})")
    result["profiled_window"] = [time.time()]
    result["graphed"] = kernel_profile(engine, 20)
    result["profiled_window"].append(time.time())
    if not args.no_eager:
        graphs, engine.core.runner.graphs = engine.core.runner.graphs, None
        result["eager"] = kernel_profile(engine, 10)
        engine.core.runner.graphs = graphs
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
