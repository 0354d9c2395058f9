"""Where a decode step's host time goes: cProfile over the engine's decode steps.

python benchmarks/profile_step.py [SHAPE] [BATCH]   (GPU; random weights in the real shape)
"""

import cProfile
import pstats
import random
import sys
import time

import torch

from tokenmill.bench.offline import make_engine, random_prompt
from tokenmill.sampling_params import SamplingParams


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    engine = make_engine(shape, max_num_seqs=max(8, batch))
    prompt = random_prompt(random.Random(0), 128, engine.model_config.vocab_size)
    for i in range(batch):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
                           stream=False)
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    steps = 200
    started = time.perf_counter()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    print(f"{shape} batch {batch}: {(time.perf_counter() - started) / steps * 1e3:.2f} ms/step under cProfile")
    pstats.Stats(profile).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
