"""Speculative decoding by prompt lookup on a rewrite workload: the embedded model asked to write
out again a function it was just shown, where most of the output repeats the input.

The functions come from the embedded model's held-out files (``tokenmill/bench/held_out.py``):
the first ``--prompts`` top-level functions or methods of 60–250 tokens, in file order. Each prompt
is the function, then ``# The same function again:`` and its first line; the model continues
greedily for as many tokens as the rest of the function has, plus 16. Every request runs alone
(batch 1), without speculation and then with it; the outputs must be equal token for token.

Reported: tokens per forward (tokens generated over forwards, where a verifying forward gives
its accepted drafts and one token more), the acceptance rate (accepted over proposed drafts),
and the median request latency both ways.

    python benchmarks/suite/spec_decode_rewrite.py [--device cuda] [--k 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.bench.hardware import environment
from tokenmill.bench.held_out import held_out_texts
from tokenmill.default_model import DEFAULT_MODEL_DIR
from tokenmill.tokenizer import load_tokenizer

MARKER = "# The same function again:"


def rewrite_prompts(count: int) -> list[tuple[str, int]]:
    """``(prompt, max_tokens)`` for the first ``count`` functions of 60–250 tokens."""
    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    prompts: list[tuple[str, int]] = []
    for _, text in held_out_texts():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.split("\n")
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
                continue
            source = "\n".join(lines[node.lineno - 1:node.end_lineno])
            n = len(tokenizer(source, add_special_tokens=False, verbose=False)["input_ids"])
            if not 60 <= n <= 250:
                continue
            head = lines[node.lineno - 1]
            prompts.append((f"{source}\n\n\n{MARKER}\n{head}\n", n + 16))
            if len(prompts) == count:
                return prompts
    return prompts


def run(llm: LLM, prompts: list[tuple[str, int]]) -> list[dict]:
    rows = []
    for prompt, max_tokens in prompts:
        started = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
        seconds = time.perf_counter() - started
        completion, metrics = out.outputs[0], out.metrics
        rows.append({"tokens": completion.token_ids, "seconds": seconds,
                     "drafts": metrics.spec_decode_num_drafts, "draft_tokens": metrics.spec_decode_num_draft_tokens,
                     "accepted": metrics.spec_decode_num_accepted_tokens})
    return rows


def divergence_gaps(llm: LLM, prompts: list[tuple[str, int]], plain: list[dict], spec: list[dict]) -> list[float]:
    """For each output that differs with speculation, the gap between plain decoding's two most
    likely tokens where the outputs part: a near tie there means the verify forward's different
    batch shape (and so rounding in reduced precision) chose the other token, not a wrong draft."""
    gaps = []
    for (prompt, max_tokens), a, b in zip(prompts, plain, spec):
        if a["tokens"] == b["tokens"]:
            continue
        at = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
                  min(len(a["tokens"]), len(b["tokens"])))
        params = SamplingParams(temperature=0, max_tokens=at + 1, logprobs=2)
        top = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].logprobs[at]
        first, second = sorted(top.values(), reverse=True)[:2]
        gaps.append(first - second)
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    prompts = rewrite_prompts(args.prompts)
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
                   "prompt_lookup_min": args.lookup_min}
    plain_llm = LLM(device=args.device, max_num_seqs=1)
    spec_llm = LLM(device=args.device, max_num_seqs=1, speculative_config=spec_config)
    run(plain_llm, prompts[:2])  # warm-up
    run(spec_llm, prompts[:2])
    plain, spec = run(plain_llm, prompts), run(spec_llm, prompts)
    mismatched = sum(a["tokens"] != b["tokens"] for a, b in zip(plain, spec))
    gaps = divergence_gaps(plain_llm, prompts, plain, spec)
    tokens = sum(len(r["tokens"]) for r in spec)
    accepted = sum(r["accepted"] for r in spec)
    draft_tokens = sum(r["draft_tokens"] for r in spec)
    plain_ms = statistics.median(r["seconds"] / len(r["tokens"]) for r in plain) * 1e3
    spec_ms = statistics.median(r["seconds"] / len(r["tokens"]) for r in spec) * 1e3
    summary = {
        "name": f"spec_decode/rewrite/k{args.k}", "prompts": len(prompts), "generated_tokens": tokens,
        "tokens_per_forward": tokens / (tokens - accepted), "acceptance_rate": accepted / max(draft_tokens, 1),
        "plain_ms_per_token": plain_ms, "spec_ms_per_token": spec_ms, "speedup": plain_ms / spec_ms,
        "outputs_mismatched": mismatched, "logprob_gaps_at_divergence": gaps, "speculative_config": spec_config,
    }
    print(f"{len(prompts)} prompts, {tokens} tokens: {summary['tokens_per_forward']:.2f} tokens per forward, "
          f"acceptance {summary['acceptance_rate']:.1%}; batch 1: {plain_ms:.2f} -> {spec_ms:.2f} ms per token "
          f"({summary['speedup']:.2f}x); outputs that differ: {mismatched}"
          + (f" (top-two logprob gap where they part: {', '.join(f'{g:.3g}' for g in gaps)})" if gaps else ""))
    if args.out:
        env = {**environment(None, " ".join(sys.argv)), "device": str(spec_llm.engine.core.device)}
        Path(args.out).write_text(json.dumps({"environment": env, "rows": [summary]}, indent=1))


if __name__ == "__main__":
    main()
