"""Where start-up goes: cProfile over building an engine in a real shape (random weights), the
phases the engine times itself beside the wall time.

python benchmarks/profile_startup.py [--shape llama3-8b] [--out FILE]   (GPU)
"""

import argparse
import cProfile
import json
import time

from profile_ttft import profile_report
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
    report = profile_report(profile)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "seconds": seconds, "phases": engine.core.startup_seconds,
                       "profile": report}, f, indent=1)


if __name__ == "__main__":
    main()
