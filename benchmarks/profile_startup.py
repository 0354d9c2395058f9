"""Where start-up goes: cProfile over building an engine in a real shape (random weights), the
phases the engine times itself beside the wall time.

python benchmarks/profile_startup.py [--shape llama3-8b] [--out FILE]   (GPU)
"""

import argparse
import cProfile
import io
import json
import pstats
import time

from tokenmill.bench.offline import make_engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--out")
    args = parser.parse_args()
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    engine = make_engine(args.shape, max_num_seqs=256)
    profile.disable()
    seconds = time.perf_counter() - started
    print(f"{args.shape}: engine built in {seconds:.2f} s (under cProfile); phases {engine.core.startup_seconds}")
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "seconds": seconds, "phases": engine.core.startup_seconds,
                       "profile": text.getvalue()}, f, indent=1)


if __name__ == "__main__":
    main()
