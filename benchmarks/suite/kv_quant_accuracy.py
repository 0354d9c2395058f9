"""What a quantized KV cache, or Q8_0 or FP8 weights, cost in accuracy, on the embedded model and its
held-out files.

The embedded model's validation files (``corpus_files.txt``, split ``val``) are read from this
Python's standard library, joined as in training (each document after an ``<|endoftext|>``) and
cut into the first ``--tokens`` tokens. Perplexity: every window of ``--window`` tokens (the
training context) is one prompt scored by the engine's prompt logprobs, each ``kv_cache_dtype``
against ``auto``. Greedy agreement: ``--prompts`` windows' first 64 tokens continued greedily for
64 tokens; the share of positions whose token equals ``auto``'s.

    python benchmarks/suite/kv_quant_accuracy.py [--device cpu] [--only auto,q8_0] [--out FILE]

``fp8_weights`` is ``quantization="fp8"`` (a scale a row) with rows as they are, as the CPU and the
GPU up to 64 rows compute it; ``fp8_weights_fp8_rows`` the same with every projection's rows quantized
to e4m3 per token (``reference.fp8_linear``), as the GPU's FP8 tensor cores compute more rows (the
scored prompts here, decoding batches past 64).

``q8_0_int8_rows`` is Q8_0 weights with every projection's rows quantized to int8 in blocks of 32
too (Q8_0 times Q8_0, as llama.cpp multiplies them; the candidate kernels of
``benchmarks/studies/study_q8_a8.py``), simulated in the torch reference (CPU only): the rows quantized
and dequantized exactly, then multiplied in float32.

(On another Python version the standard library's files differ a little from the ones the model
was trained on; every dtype is scored on the same tokens, so the comparison holds.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.hardware import environment
from tokenmill.bench.held_out import held_out_texts
from tokenmill.default_model import DEFAULT_MODEL_DIR
from tokenmill.kernels import q8_0, reference
from tokenmill.tokenizer import load_tokenizer

# Each variant's row name and engine options; the first is the baseline.
VARIANTS = {name: (f"kv_quant_accuracy/{name}", {"kv_cache_dtype": name}) for name in ("auto", "int8", "fp8", "fp8_e5m2")}
VARIANTS["q8_0"] = ("weight_quant_accuracy/q8_0", {"quantization": "q8_0"})
VARIANTS["q8_0_int8_rows"] = ("weight_quant_accuracy/q8_0_int8_rows", {"quantization": "q8_0"})
VARIANTS["fp8_weights"] = ("weight_quant_accuracy/fp8", {"quantization": "fp8"})
VARIANTS["fp8_weights_fp8_rows"] = ("weight_quant_accuracy/fp8_fp8_rows", {"quantization": "fp8"})
# Variants simulated in the torch reference (CPU only), and how.
SIMULATED = {"q8_0_int8_rows": lambda: projections_on_int8_rows(), "fp8_weights_fp8_rows": lambda: fp8_rows()}
EOS = "<|endoftext|>"


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """``x``'s rows quantized to int8 in blocks of 32 (scale: the block's largest magnitude over 127,
    each value rounded half away from zero) and back, in float32."""
    blocks = x.float().unflatten(-1, (-1, q8_0.BLOCK))
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    v = blocks / torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((v.abs() + 0.5).floor() * v.sign() * scale).flatten(-2)


@contextlib.contextmanager
def projections_on_int8_rows() -> Iterator[None]:
    """The reference's Q8_0 projections on ``int8_rows`` of their input, in float32."""
    originals = {name: getattr(reference, name) for name in ("linear", "linear_residual", "norm_linear")}

    def linear(x, weight, bias):
        if not isinstance(weight, q8_0.Q8Weight):
            return originals["linear"](x, weight, bias)
        out = torch.nn.functional.linear(int8_rows(x), q8_0.dense(weight, torch.float32),
                                         None if bias is None else bias.float())
        return out.to(x.dtype)

    def linear_residual(x, weight, bias, residual):
        return linear(x, weight, bias) + residual

    def norm_linear(x, norm_weight, eps, weight, bias, gated=False, weighting="llama", activation="silu"):
        out = linear(reference.NORMS[weighting](x, norm_weight, eps), weight, bias)
        return reference.GATED_ACTIVATIONS[activation](out) if gated else out

    for name, fn in (("linear", linear), ("linear_residual", linear_residual), ("norm_linear", norm_linear)):
        setattr(reference, name, fn)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(reference, name, fn)


@contextlib.contextmanager
def fp8_rows() -> Iterator[None]:
    """The reference's FP8 projections on rows quantized per token, as FP8 tensor cores read them."""
    original = reference.fp8_weight_linear
    reference.fp8_weight_linear = reference.fp8_linear
    try:
        yield
    finally:
        reference.fp8_weight_linear = original


def validation_tokens(limit: int) -> list[int]:
    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids = [eos]
    for _, text in held_out_texts():
        ids += tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] + [eos]
        if len(ids) >= limit:
            break
    return ids[:limit]


def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    nll, count = 0.0, 0
    for out in llm.generate(windows, params, use_tqdm=False):
        for position, logprobs in enumerate(out.prompt_logprobs[1:], start=1):
            nll -= logprobs[out.prompt_token_ids[position]]
            count += 1
    return math.exp(nll / count)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=48_000)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--only", default=None, help="comma-separated variants (the first is the baseline); "
                                                      f"known: {', '.join(VARIANTS)}")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    names = list(VARIANTS) if args.only is None else args.only.split(",")
    ids = validation_tokens(args.tokens)
    windows = [ids[i:i + args.window] for i in range(0, len(ids) - 1, args.window)]
    prompts = [w[:64] for w in windows[:args.prompts]]
    greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    rows, base_tokens, base_ppl = [], None, None
    for name in names:
        started = time.perf_counter()
        row_name, options = VARIANTS[name]
        if name in SIMULATED and args.device != "cpu":
            parser.error(f"{name} is simulated in the torch reference: --device cpu")
        with SIMULATED[name]() if name in SIMULATED else contextlib.nullcontext():
            llm = LLM(device=args.device, max_model_len=args.window + 64, **options)
            ppl = perplexity(llm, windows)
            tokens = np.array([o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)])
        base_tokens = tokens if base_tokens is None else base_tokens
        base_ppl = ppl if base_ppl is None else base_ppl
        row = {"name": row_name, **options, "perplexity": ppl,
               "perplexity_change": ppl / base_ppl - 1, "greedy_tokens_unchanged": float((tokens == base_tokens).mean()),
               "scored_tokens": sum(len(w) - 1 for w in windows), "seconds": time.perf_counter() - started}
        rows.append(row)
        print(f"{name:20s} perplexity {ppl:.4f} ({row['perplexity_change']:+.3%})   greedy tokens unchanged "
              f"{row['greedy_tokens_unchanged']:.1%}", flush=True)
    if args.out:
        env = {**environment(None, " ".join(sys.argv)), "device": args.device}
        Path(args.out).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
