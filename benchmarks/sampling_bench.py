"""Sampled requests against greedy ones: what top-k/top-p cost a step, and the standard workload
through the engine with each kind of sampling.

- masks: ``apply_top_k_top_p`` over Qwen3's vocabulary (151,936) for 1, 64 and 256 rows, on flat
  logits (random: the nucleus holds most of the vocabulary) and peaked ones (×8: a few tokens),
  sorting each row and, for top-k rows, ordering only the k largest (what the engine runs);
- workload: Qwen3-0.6B's shape (random weights), 256 requests with prompt and output lengths
  uniform in [100, 1024], greedy, ``temperature=1``, ``top_p=0.9``, ``top_k=50``, both, and greedy
  with ``repetition_penalty=1.1``, in one engine, each beside its step floors
  (``tokenmill/bench/offline.py``).

    python benchmarks/sampling_bench.py [--shape qwen3-0.6b] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tokenmill.bench.hardware import environment, measure_ceilings, time_cuda
from tokenmill.bench.offline import make_engine, run_workload, standard_workload
from tokenmill.layers.sampler import apply_top_k_top_p

VOCAB = 151936
SAMPLINGS = {"greedy": {}, "temperature": {"temperature": 1.0}, "top_p": {"temperature": 1.0, "top_p": 0.9},
             "top_k": {"temperature": 1.0, "top_k": 50},
             "top_k_top_p": {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
             "repetition_penalty": {"repetition_penalty": 1.1}}


def mask_rows(ceilings) -> list[dict]:
    rows = []
    for batch in (1, 64, 256):
        for spread in ("flat", "peaked"):
            logits = torch.randn(batch, VOCAB, device="cuda") * (8.0 if spread == "peaked" else 1.0)
            for name, k, p in (("top_p", 0, 0.9), ("top_k", 50, 1.0), ("top_k_top_p", 50, 0.9)):
                top_k = torch.full((batch,), k, dtype=torch.int64, device="cuda")
                top_p = torch.full((batch,), p, device="cuda")
                # Every row of a top-k batch in order (a sort), and only its k largest (the engine's path).
                for order, max_top_k in (("sort", 0), ("partial", k)):
                    if order == "partial" and not k:
                        continue
                    seconds = time_cuda(lambda: apply_top_k_top_p(logits, top_k, top_p, max_top_k))
                    floor = ceilings.floor(2 * logits.numel() * 4, 0.0)  # the logits read, the masked ones written
                    rows.append({"name": f"sampling/mask/{name}/{order}/{spread}/b{batch}", "batch": batch,
                                 "vocab": VOCAB, "us": seconds * 1e6, "floor_us": floor * 1e6,
                                 "fraction_of_floor": floor / seconds})
    return rows


def workload_rows(shape: str, ceilings) -> list[dict]:
    engine = make_engine(shape, max_num_seqs=256, max_num_batched_tokens=8192)
    workload = standard_workload(vocab=engine.model_config.vocab_size)
    run_workload(engine, ceilings, workload[:32])  # warm-up
    rows = []
    for name, sampling in SAMPLINGS.items():
        result = run_workload(engine, ceilings, workload, sampling)
        rows.append({"name": f"sampling/workload/{shape}/{name}", "sampling": sampling, **result})
    greedy = rows[0]["output_tok_per_s"]
    for row in rows:
        row["of_greedy"] = row["output_tok_per_s"] / greedy
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ceilings = measure_ceilings()
    rows = mask_rows(ceilings)
    for row in rows:
        print(f"{row['name']:40s} {row['us']:8.1f} us (floor {row['floor_us']:.1f} us)")
    rows += workload_rows(args.shape, ceilings)
    for row in rows[-len(SAMPLINGS):]:
        print(f"{row['name']:40s} {row['output_tok_per_s']:9,.0f} out tok/s ({row['of_greedy']:.1%} of greedy, "
              f"{row['fraction_of_floor']:.0%} of floor)")
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": environment(ceilings, " ".join(sys.argv)),
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
