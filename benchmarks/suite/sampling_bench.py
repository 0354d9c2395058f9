"""Sampled requests against greedy ones: what drawing a token costs a step, and the standard
workload through the engine with each kind of sampling.

- step: a token per row from Qwen3's vocabulary (151,936) for 1, 64 and 256 rows, on flat logits
  (random: the nucleus holds most of the vocabulary) and peaked ones (x8: a few tokens), for
  each kind of sampling: the noise, each row's top-k threshold, then the race over the candidates
  (``race``, what the engine runs on the GPU) or the reference's sort of every row (``sort``),
  beside greedy's argmax and the floor of reading the logits once; and the penalties, fused in one
  pass (``fused``) and as torch ops (``torch``);
- latency: Llama-3-8B's shape, batch-1 decode steps greedy, with ``top_p=0.95``, and with
  ``top_k=50`` and ``repetition_penalty=1.1``, against greedy's in the same engine;
- workload: Qwen3-0.6B's shape (random weights), 256 requests with prompt and output lengths
  uniform in [100, 1024], greedy, ``temperature=1``, ``top_p=0.9``, ``top_k=50``, both, and greedy
  with ``repetition_penalty=1.1``, in one engine, each beside its step floors
  (``tokenmill/bench/offline.py``).

    python benchmarks/suite/sampling_bench.py [--shape qwen3-0.6b] [--out FILE]
"""

from __future__ import annotations

import argparse

import torch

from tokenmill.bench.hardware import measure_ceilings, time_cuda, write_rows
from tokenmill.bench.offline import decode_steps, make_engine, release, run_workload, standard_workload
from tokenmill.kernels import reference, triton_ops
from tokenmill.layers.sampler import largest_logits

VOCAB = 151936
SAMPLINGS = {"greedy": {}, "temperature": {"temperature": 1.0}, "top_p": {"temperature": 1.0, "top_p": 0.9},
             "top_k": {"temperature": 1.0, "top_k": 50},
             "top_k_top_p": {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
             "repetition_penalty": {"repetition_penalty": 1.1}}
STEP_KINDS = (("temperature", 0, 1.0), ("top_p", 0, 0.9), ("top_k", 50, 1.0), ("top_k_top_p", 50, 0.9),
              ("small_top_p", 0, 0.2))


def step_rows(ceilings) -> list[dict]:
    rows = []
    for batch in (1, 64, 256):
        for spread in ("flat", "peaked"):
            logits = torch.randn(batch, VOCAB, device="cuda") * (8.0 if spread == "peaked" else 1.0)
            floor = ceilings.floor(logits.numel() * 4, 0.0)  # the logits read once

            def row(name: str, seconds: float) -> dict:
                return {"name": f"sampling/step/{name}/{spread}/b{batch}", "batch": batch, "vocab": VOCAB,
                        "us": seconds * 1e6, "floor_us": floor * 1e6, "fraction_of_floor": floor / seconds}

            rows.append(row("greedy", time_cuda(lambda: triton_ops.argmax_rows(logits))))
            ones = torch.ones(batch, device="cuda")
            greedy = triton_ops.argmax_rows(logits)
            for name, k, p in STEP_KINDS:
                top_k = torch.full((batch,), k, dtype=torch.int64, device="cuda")
                top_p, min_p = torch.full((batch,), p, device="cuda"), torch.zeros(batch, device="cuda")
                for impl, ops in (("race", triton_ops), ("sort", reference)):
                    def draw(ops=ops) -> torch.Tensor:
                        noise = torch.empty_like(logits).exponential_()
                        return ops.sample(logits, noise, ones, top_k, largest_logits(logits, k), top_p, min_p,
                                          greedy)

                    rows.append(row(f"{name}/{impl}", time_cuda(draw)))
            counts = torch.randint(0, 3, (batch + 2, VOCAB), device="cuda").float()
            prompt = torch.rand(batch + 2, VOCAB, device="cuda") < 0.01
            read, penalty = torch.arange(batch, device="cuda"), torch.full((batch,), 1.1, device="cuda")
            for impl, ops in (("fused", triton_ops), ("torch", reference)):
                rows.append(row(f"repetition_penalty/{impl}", time_cuda(
                    lambda ops=ops: ops.apply_penalties(logits, counts, prompt, read, penalty, min_p, min_p))))
    return rows


LATENCY_SAMPLINGS = {"greedy": {}, "top_p": {"temperature": 1.0, "top_p": 0.95},
                     "top_k_repetition_penalty": {"temperature": 1.0, "top_k": 50, "repetition_penalty": 1.1}}


def latency_rows(ceilings, shape: str = "llama3-8b") -> list[dict]:
    engine = make_engine(shape, max_num_seqs=8)
    prompt = list(range(1, 129))
    decode_steps(engine, ceilings, [prompt], 16)  # warm-up
    rows = [{"name": f"sampling/latency/{shape}/{name}", "batch": 1, "sampling": sampling,
             **decode_steps(engine, ceilings, [prompt], 128, sampling)} for name, sampling in LATENCY_SAMPLINGS.items()]
    for row in rows:
        row["of_greedy"] = rows[0]["ms_per_step"] / row["ms_per_step"]
    del engine
    release()
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
    rows = step_rows(ceilings)
    for row in rows:
        print(f"{row['name']:44s} {row['us']:8.1f} us (floor {row['floor_us']:.1f} us)")
    rows += latency_rows(ceilings)
    for row in rows[-len(LATENCY_SAMPLINGS):]:
        print(f"{row['name']:44s} {row['ms_per_step']:6.3f} ms per token (floor {row['floor_ms']:.3f} ms, "
              f"greedy's time / this {row['of_greedy']:.1%})")
    rows += workload_rows(args.shape, ceilings)
    for row in rows[-len(SAMPLINGS):]:
        print(f"{row['name']:40s} {row['output_tok_per_s']:9,.0f} out tok/s ({row['of_greedy']:.1%} of greedy, "
              f"{row['fraction_of_floor']:.0%} of floor)")
    if args.out:
        write_rows(args.out, ceilings, rows)


if __name__ == "__main__":
    main()
