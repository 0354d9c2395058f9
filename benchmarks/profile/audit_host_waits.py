"""Where the host waits for the GPU inside the engine's steps, per request feature.

A step's host work overlaps the GPU's only while the host issues no call that waits for queued
kernels: a blocking copy (``torch.tensor(..., device=...)``, an item assignment ``t[ids] = value``
on a device tensor, whose value PyTorch copies over synchronously), ``.item()``, ``.tolist()`` or
``nonzero`` on a device tensor. Each such wait lets the GPU run dry while the host catches up. CUDA's
sync check (``torch.cuda.set_sync_debug_mode("warn")``) reports every one; this script runs requests
of each feature through an engine with it on and names the engine's lines that waited, with their
count per step. The step's one intended wait, for its sampled tokens, is an event's, which the
check does not report.

python benchmarks/profile/audit_host_waits.py [--shape llama3.2-1b] [--requests 8] [--max-tokens 24] [--out FILE]
    (GPU; random weights; every case after a warm-up run of the same case)
"""

import argparse
import collections
import random
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from tokenmill import SamplingParams
from tokenmill.bench.hardware import write_rows
from tokenmill.bench.offline import make_engine, random_prompt

PACKAGE = str(Path(__file__).resolve().parents[2] / "tokenmill")
# Each case's sampling parameters besides max_tokens and ignore_eos.
CASES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0},
    "greedy_logprobs": {"temperature": 0, "logprobs": 5},
    "prompt_logprobs": {"temperature": 0, "prompt_logprobs": 2},
    "sampled": {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "min_p": 0.05},
    "seeded": {"temperature": 1.0, "seed": 7},
    "penalties": {"temperature": 1.0, "repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.2},
    "logit_bias": {"temperature": 1.0, "logit_bias": {11: 2.0, 12: -3.0}},
    "min_tokens": {"temperature": 1.0, "min_tokens": 16, "stop_token_ids": [3, 4]},
    "n2": {"temperature": 1.0, "n": 2},
}


def engine_site() -> str:
    """The innermost frame in the engine's package (the line that waited), or the innermost of all."""
    frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.endswith("warnings.py")]  # (not this hook)
    frame = ([f for f in frames if f.filename.startswith(PACKAGE)] or frames)[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"


def audit(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[int, collections.Counter]:
    """Steps taken and the waits by site, over ``prompts`` run to completion."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"audit-{random.random()}-{i}", prompt, params, stream=False)
    sites: collections.Counter = collections.Counter()
    steps = 0
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *_: sites.update(
            [engine_site()] if "synchronizing" in str(message) else [])
        torch.cuda.set_sync_debug_mode("warn")
        try:
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return steps, sites


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--speculative", action="store_true",
                        help="also the greedy case with speculative decoding by prompt lookup")
    parser.add_argument("--out")
    args = parser.parse_args()
    rng = random.Random(0)
    engines = {"": make_engine(args.shape, max_num_seqs=64)}
    if args.speculative:
        engines["spec_"] = make_engine(args.shape, max_num_seqs=64, speculative_config={
            "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    rows = []
    for prefix, engine in engines.items():
        vocab = engine.model_config.vocab_size
        for name, options in CASES.items() if not prefix else [("greedy", CASES["greedy"])]:
            params = SamplingParams(**options, max_tokens=args.max_tokens, ignore_eos=True)
            # A repeating prompt, so that prompt lookup finds drafts; and one past the largest prefill
            # graph, whose steps run eagerly.
            prompts = [random_prompt(rng, 40, vocab) * 5 for _ in range(args.requests - 1)]
            prompts.append(random_prompt(rng, 3000, vocab))
            audit(engine, prompts, params)  # warm-up: first launches may load modules
            steps, sites = audit(engine, prompts, params)
            total = sum(sites.values())
            rows.append({"name": f"host_waits/{args.shape}/{prefix}{name}", "steps": steps, "waits": total,
                         "waits_per_step": total / max(steps, 1), "sites": dict(sites.most_common())})
            print(f"{prefix}{name:<18} {steps:4d} steps {total:5d} waits ({total / max(steps, 1):.2f} a step)"
                  + "".join(f"\n    {n:5d}  {site}" for site, n in sites.most_common(6)))
    if args.out:
        write_rows(args.out, None, rows)


if __name__ == "__main__":
    main()
