"""Where a lone prompt's time to first token goes: the wall time, the GPU's kernel time within it,
and the host's functions (cProfile), for a prompt alone in the engine (nothing cached).

python benchmarks/profile/profile_ttft.py [--shape llama3-8b] [--tokens 100] [--prefix 0] [--max-num-batched-tokens N]
    [--sampled] [--out FILE]   (GPU; the token budget unset: the engine's default; --sampled: top-k, top-p
    and a repetition penalty, as the start-up benchmark's sampled prompt; --prefix N: every prompt starts
    with the same N tokens, cached by an earlier request, as a conversation's next turn does; the very
    first request is timed apart)
"""

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import time
from collections.abc import Iterator

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


@contextlib.contextmanager
def host_time_before_the_forward(engine) -> Iterator[list[float]]:
    """Within, each request's seconds from ``add_request`` to its step's forward being launched
    (validation, tokenizing, scheduling, the step's inputs built and copied): time in which the GPU
    has nothing of the request's to run."""
    times, added = [], []
    runner = engine.core.runner
    add_request, forward = engine.add_request, runner._forward

    def timed_add(*args, **kwargs):
        added.append(time.perf_counter())
        return add_request(*args, **kwargs)

    def timed_forward(*args, **kwargs):
        if added:
            times.append(time.perf_counter() - added.pop())
        return forward(*args, **kwargs)

    engine.add_request, runner._forward = timed_add, timed_forward
    try:
        yield times
    finally:
        del engine.add_request, runner._forward  # the methods again


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--prefix", type=int, default=0, help="tokens of a cached prefix before each prompt's new ones")
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--sampled", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.tokens < 1 or args.prefix < 0:
        parser.error("--tokens must be at least 1 and --prefix at least 0")
    engine = make_engine(args.shape, max_num_seqs=8, max_num_batched_tokens=args.max_num_batched_tokens)
    budget = engine.core.config.max_num_batched_tokens
    rng, vocab = random.Random(0), engine.model_config.vocab_size

    sampling = SAMPLED if args.sampled else None
    prefix = random_prompt(rng, args.prefix, vocab) if args.prefix else []
    if prefix:
        time_to_first_token(engine, prefix)  # its blocks are cached from here on
    after = f" after {args.prefix} cached tokens" if prefix else ""

    def ttft() -> float:
        return time_to_first_token(engine, prefix + random_prompt(rng, args.tokens, vocab), sampling)

    first_ms = ttft() * 1e3
    print(f"{args.shape}: the first {args.tokens}-token prompt{after} after start-up{' (sampled)' * args.sampled}: "
          f"{first_ms:.2f} ms")
    for _ in range(3):
        ttft()
    with host_time_before_the_forward(engine) as before_forward:
        walls = [ttft() for _ in range(10)]
    wall_ms, host_ms = statistics.median(walls) * 1e3, statistics.median(before_forward) * 1e3
    print(f"{args.shape}: {args.tokens}-token prompt{after}, {budget} tokens a step, time to first token {wall_ms:.2f} ms "
          f"(median of 10), of which {host_ms:.2f} ms on the host before the forward's first launch")
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
                       "prompt_tokens": args.tokens, "cached_prefix_tokens": args.prefix,
                       "max_num_batched_tokens": budget, "sampling": sampling,
                       "first_ms": first_ms, "ttft_ms": wall_ms, "host_before_forward_ms": host_ms,
                       "kernels_per_request": kernels,
                       "host_profile": report}, f, indent=1)


if __name__ == "__main__":
    main()
