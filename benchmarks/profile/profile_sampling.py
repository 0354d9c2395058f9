"""What a sampled decode step adds on the GPU: the kernels outside the step's CUDA graph (the
sampler's) per kind of sampling, from torch's profiler, at batch 1 (the step the GPU cannot hide
them under) and a larger batch.

    python benchmarks/profile/profile_sampling.py [--shape llama3-8b] [--batches 1,64] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill.bench.offline import make_engine, random_prompt
from tokenmill.sampling_params import SamplingParams

SAMPLINGS = {"greedy": {"temperature": 0.0}, "top_p": {"temperature": 1.0, "top_p": 0.95},
             "top_k_repetition_penalty": {"temperature": 1.0, "top_k": 50, "repetition_penalty": 1.1}}


def kernels_per_step(engine, batch: int, sampling: dict, steps: int = 20) -> dict:
    prompt = random_prompt(random.Random(0), 128, engine.model_config.vocab_size)
    for i in range(batch):
        engine.add_request(f"{batch}-{i}", prompt, SamplingParams(**sampling, max_tokens=steps + 30, ignore_eos=True),
                           stream=False)
    for _ in range(10):  # prefill and the first decode steps
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    totals: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total
            counts[event.name] += 1
    return {name[:90]: {"us_per_step": us / steps, "launches_per_step": counts[name] / steps}
            for name, us in totals.most_common()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    engine = make_engine(args.shape, max_num_seqs=64)
    result = {}
    for batch in (int(b) for b in args.batches.split(",")):
        for name, sampling in SAMPLINGS.items():
            kernels = kernels_per_step(engine, batch, sampling)
            result[f"b{batch}/{name}"] = kernels
            total = sum(k["us_per_step"] for k in kernels.values())
            print(f"== batch {batch}, {name}: {total:.1f} us of kernels per step")
            for kernel, row in list(kernels.items())[:14]:
                print(f"  {row['us_per_step']:8.1f} us  x{row['launches_per_step']:4.1f}  {kernel}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
