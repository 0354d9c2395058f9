"""Where start-up goes: cProfile over building an engine in a real shape (random weights), the
phases the engine times itself beside the wall time, and who called the functions that took the
most time of their own (module compilation, operator registration: the import chains behind them).

python benchmarks/profile/profile_startup.py [--shape llama3-8b] [--out FILE]   (GPU)
"""

import argparse
import cProfile
import io
import json
import pstats
import time

from profile_ttft import profile_report
from tokenmill.bench.offline import make_engine


def callers_report(profile: cProfile.Profile, top: int = 6) -> str:
    """The callers, two levels up, of the ``top`` functions by their own time."""
    stats = pstats.Stats(profile)
    ranked = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    lines = []
    for func, (_, _, own, _, callers) in ranked:
        lines.append(f"{pstats.func_std_string(func)}: {own:.2f} s own")
        for caller, entry in sorted(callers.items(), key=lambda c: c[1][3], reverse=True)[:4]:
            lines.append(f"    <- {pstats.func_std_string(caller)} ({entry[3]:.2f} s)")
            for grand, grand_entry in sorted(stats.stats.get(caller, (0, 0, 0, 0, {}))[4].items(),
                                             key=lambda c: c[1][3], reverse=True)[:3]:
                lines.append(f"        <- {pstats.func_std_string(grand)} ({grand_entry[3]:.2f} s)")
    return "\n".join(lines) + "\n"


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
    print(f"{args.shape}: engine built in {seconds:.2f} s (under cProfile); phases {engine.startup_seconds}")
    report = profile_report(profile) + callers_report(profile)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "seconds": seconds, "phases": engine.startup_seconds,
                       "profile": report}, f, indent=1)


if __name__ == "__main__":
    main()
