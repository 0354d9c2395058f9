"""Where a lone prompt's time to first token goes: the wall time, the GPU's kernel time within it,
and the host's functions (cProfile), for a prompt alone in the engine (nothing cached).

python benchmarks/profile_ttft.py [--shape llama3-8b] [--tokens 100] [--max-num-batched-tokens N] [--sampled]
    [--out FILE]   (GPU; the token budget unset: the engine's default; --sampled: top-k, top-p and a
    repetition penalty, as the start-up benchmark's sampled prompt; the very first request is timed apart)
"""

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys

import torch

from tokenmill.bench.hardware import environment
from tokenmill.bench.offline import SAMPLED, make_engine, random_prompt, time_to_first_token
from profile_kernels import kernel_profile_of


def profile_report(profile: cProfile.Profile) -> str:
    """The host functions of ``profile``: by their own time, then by time including their callees."""
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--sampled", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    engine = make_engine(args.shape, max_num_seqs=8, max_num_batched_tokens=args.max_num_batched_tokens)
    budget = engine.core.config.max_num_batched_tokens
    rng, vocab = random.Random(0), engine.model_config.vocab_size

    sampling = SAMPLED if args.sampled else None

    def ttft() -> float:
        return time_to_first_token(engine, random_prompt(rng, args.tokens, vocab), sampling)

    first_ms = ttft() * 1e3
    print(f"{args.shape}: the first {args.tokens}-token prompt after start-up{' (sampled)' * args.sampled}: "
          f"{first_ms:.2f} ms")
    for _ in range(3):
        ttft()
    wall_ms = statistics.median(ttft() for _ in range(10)) * 1e3
    print(f"{args.shape}: {args.tokens}-token prompt, {budget} tokens a step, time to first token {wall_ms:.2f} ms "
          "(median of 10)")
    kernels = kernel_profile_of(lambda: [ttft() for _ in range(5)], 5)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(10):
        ttft()
    torch.cuda.synchronize()
    profile.disable()
    report = profile_report(profile)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(None, " ".join(sys.argv)), "shape": args.shape,
                       "prompt_tokens": args.tokens, "max_num_batched_tokens": budget, "sampling": sampling,
                       "first_ms": first_ms, "ttft_ms": wall_ms, "kernels_per_request": kernels,
                       "host_profile": report}, f, indent=1)


if __name__ == "__main__":
    main()
