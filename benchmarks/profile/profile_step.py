"""Where a decode step's host time goes: cProfile over the engine's decode steps.

python benchmarks/profile/profile_step.py [SHAPE] [BATCH]   (GPU; random weights in the real shape)
"""

import cProfile
import pstats
import sys
import time

from profile_kernels import decoding_engine


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    engine = decoding_engine(shape, batch, 400, 20)
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
