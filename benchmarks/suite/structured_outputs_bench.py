"""Structured outputs: what a JSON schema costs a batch of requests.

Three figures, for one typical schema (an order: nested objects, an array of items, an enum,
bounded numbers, required fields):

- compile: the first schema compiled for a vocabulary (xgrammar's tokenizer tables built, then the
  schema), another schema cold, and the same schema again (the engine's cache);
- mask: the host and device time of ``apply_grammars`` for 1, 8 and 64 rows in the model's
  vocabulary (matchers part-way through valid documents), xgrammar's thread pool against filling
  row by row, beside the decode step it hides behind;
- throughput: 64 requests through ``LLM.generate``, each with the schema against the same
  requests unconstrained (``ignore_eos``, as many tokens), output tokens per second both ways.

``--shape llama3-8b`` runs a random-weight model of that shape, with the embedded model's
tokenizer (8,192 tokens; the vocabulary's other rows are never allowed by a grammar), or with
``--tokenizer-vocab 128000`` a tokenizer of that size trained on the spot, since the masks' host
cost grows with the tokenizer's vocabulary; without ``--shape``, the embedded model itself.

    python benchmarks/suite/structured_outputs_bench.py [--shape llama3-8b [--tokenizer-vocab 128000]] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.hardware import environment
from tokenmill.bench.shapes import shape_dir
from tokenmill.default_model import DEFAULT_MODEL_DIR
from tokenmill.engine.core.structured_outputs import GrammarCompiler
from tokenmill.layers.grammar_mask import HostBitmask, apply_grammars, fill_masks, mask_logits
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.tokenizer import load_tokenizer

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1},
        "customer": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                     "required": ["name", "email"]},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                           "price": {"type": "number", "minimum": 0}},
            "required": ["sku", "quantity", "price"]}},
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "notes": {"type": "string"},
    },
    "required": ["order_id", "customer", "items", "status"],
}
ORDER = {"order_id": 1042, "customer": {"name": "Ada Lovelace", "email": "ada@example.com"},
         "items": [{"sku": "A-17", "quantity": 2, "price": 9.5}, {"sku": "B-3", "quantity": 1, "price": 120.0}],
         "status": "paid", "notes": "leave at the door"}
OTHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"},
                                                "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["city", "population"]}


def model_dir(shape: str | None, tokenizer_vocab: int | None) -> Path:
    if shape is None:
        return DEFAULT_MODEL_DIR
    path = shape_dir(shape)
    if tokenizer_vocab:
        train_tokenizer(path, tokenizer_vocab)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
    return path


def train_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens learnt from the Python sources on this machine
    (standard library and installed packages): a vocabulary as large as Llama 3's, which is what a grammar's mask
    costs scale with (the embedded model's has 8,192 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        roots = {sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib")}
        for file in sorted(f for root in roots for f in Path(root).rglob("*.py")):
            try:
                yield file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue

    started = time.perf_counter()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    print(f"tokenizer of {tokenizer.get_vocab_size():,} tokens trained in {time.perf_counter() - started:.0f} s")


def compile_times(path: Path, vocab_size: int) -> dict:
    """Seconds to compile on a fresh compiler: the first schema (with the vocabulary's tables),
    a second schema, and the first again (answered from the cache)."""
    compiler = GrammarCompiler(path, vocab_size, ())
    timed = []
    for schema in (ORDER_SCHEMA, OTHER_SCHEMA, ORDER_SCHEMA):
        started = time.perf_counter()
        compiler.submit(StructuredOutputsParams(json=schema)).result()
        timed.append(time.perf_counter() - started)
    compiler.close()
    return {"first_schema_s": timed[0], "cold_s": timed[1], "cached_s": timed[2]}


def mask_times(path: Path, vocab_size: int, device: str, batches: tuple[int, ...]) -> list[dict]:
    """Per-step cost of the masks for matchers at different points of a valid order."""
    import xgrammar

    compiler = GrammarCompiler(path, vocab_size, ())
    compiled = compiler.submit(StructuredOutputsParams(json=ORDER_SCHEMA)).result()
    tokens = load_tokenizer(path)(json.dumps(ORDER, separators=(", ", ": ")), add_special_tokens=False)["input_ids"]
    rows = []
    for batch in batches:
        matchers = []
        for i in range(batch):
            matcher = compiler.matcher(compiled)
            for token in tokens[:(i * 7) % (len(tokens) - 1)]:
                assert matcher.accept_token(token), "the example order must follow its schema"
            matchers.append(matcher)
        constrained = [(i, m, []) for i, m in enumerate(matchers)]
        logits = torch.randn(batch, vocab_size, device=device)
        bitmask = xgrammar.allocate_token_bitmask(batch, vocab_size)
        on_device = bitmask.to(device)
        batched = xgrammar.BatchGrammarMatcher()
        host = HostBitmask()

        def sync() -> None:
            if device == "cuda":
                torch.cuda.synchronize()

        def row_by_row() -> None:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)

        parts = {"apply_grammars_us": lambda: (apply_grammars(logits, constrained, host), sync()),
                 "fill_masks_us": lambda: fill_masks(bitmask, [(i, m) for i, m, _ in constrained]),
                 "fill_row_by_row_us": row_by_row,
                 "fill_thread_pool_us": lambda: batched.batch_fill_next_token_bitmask(matchers, bitmask),
                 "bitmask_to_device_us": lambda: (bitmask.to(device, non_blocking=True), sync()),
                 "mask_logits_us": lambda: (mask_logits(logits, on_device), sync()),
                 "xgrammar_apply_us": lambda: (xgrammar.apply_token_bitmask_inplace(
                     logits, on_device, vocab_size=vocab_size, indices=list(range(batch))), sync())}
        figures = {"name": f"structured_outputs/mask_b{batch}", "batch": batch, "vocab_size": vocab_size}
        for key, fn in parts.items():
            for _ in range(5):
                fn()
            samples = []
            for _ in range(50):
                started = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - started)
            figures[key] = statistics.median(samples) * 1e6
        rows.append(figures)
    compiler.close()
    return rows


def throughput(path: Path, device: str, requests: int, max_tokens: int, profile: str | None) -> dict:
    """The JSON-schema requests, and the same requests unconstrained, each made to give as many
    tokens as its constrained run did, so that both do the same work."""
    llm = LLM(model=str(path), device=device, dtype="bfloat16", random_weights=path != DEFAULT_MODEL_DIR,
              max_num_seqs=requests, max_model_len=2048)
    prompts = [f"Order {1000 + i} as JSON, with its customer, items and status:\n" for i in range(requests)]
    constrained = SamplingParams(temperature=0, max_tokens=max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=ORDER_SCHEMA))
    # Both workloads run once untimed first: the schema compiles, and every kernel a batch of this
    # shape needs is built (timing them cold would time Triton's compiler).
    outputs = llm.generate(prompts, constrained, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate(prompts, plain, use_tqdm=False)
    result, texts = {}, {}
    for key, params in (("json_schema", constrained), ("unconstrained", plain)):
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        result[key] = {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
                       "ms_per_step": seconds / max(lengths) * 1e3}
        texts[key] = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason == "stop"]
    finished = texts["json_schema"]
    result["json_schema"].update(finished_documents=len(finished), valid_json=sum(map(_parses, finished)))
    if profile:  # once more, under the profiler (which slows the host)
        profiler = cProfile.Profile()
        with profiler:
            llm.generate(prompts, constrained, use_tqdm=False)
        profiler.dump_stats(profile)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    ratio = result["json_schema"]["tokens_per_s"] / result["unconstrained"]["tokens_per_s"]
    return {"name": f"structured_outputs/throughput_b{requests}", "requests": requests, "max_tokens": max_tokens,
            **result, "floor": result["unconstrained"]["tokens_per_s"], "fraction_of_floor": ratio}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default=None, help="a random-weight shape (tokenmill/bench/shapes.py)")
    parser.add_argument("--tokenizer-vocab", type=int, default=None,
                        help="with --shape: train a tokenizer of this many tokens instead of the embedded model's")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--profile", default=None, help="write a cProfile of the JSON-schema run here")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    path = model_dir(args.shape, args.tokenizer_vocab)
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    started = time.perf_counter()
    load_tokenizer(path)
    compile_row = {"name": "structured_outputs/compile", "vocab_size": vocab_size,
                   "tokenizer_load_s": time.perf_counter() - started, **compile_times(path, vocab_size)}
    print(f"compile: tokenizer loaded in {compile_row['tokenizer_load_s'] * 1e3:.0f} ms; first schema {compile_row['first_schema_s'] * 1e3:.1f} ms (with the vocabulary's tables), "
          f"another cold {compile_row['cold_s'] * 1e3:.1f} ms, cached {compile_row['cached_s'] * 1e6:.0f} us")
    mask_rows = mask_times(path, vocab_size, args.device, (1, 8, 64))
    for row in mask_rows:
        print(f"mask B={row['batch']}: apply_grammars {row['apply_grammars_us']:.0f} us = fill "
              f"{row['fill_masks_us']:.0f} us (row by row {row['fill_row_by_row_us']:.0f} us, thread pool "
              f"{row['fill_thread_pool_us']:.0f} us) + copy "
              f"{row['bitmask_to_device_us']:.0f} us + mask {row['mask_logits_us']:.0f} us "
              f"(xgrammar's kernel {row['xgrammar_apply_us']:.0f} us)")
    run = throughput(path, args.device, args.requests, args.max_tokens, args.profile)
    plain, schema = run["unconstrained"], run["json_schema"]
    print(f"throughput B={args.requests}: unconstrained {plain['tokens_per_s']:,.0f} tok/s "
          f"({plain['ms_per_step']:.2f} ms/step), JSON schema {schema['tokens_per_s']:,.0f} tok/s "
          f"({schema['ms_per_step']:.2f} ms/step) "
          f"({run['fraction_of_floor']:.1%}); {run['json_schema']['valid_json']} of "
          f"{run['json_schema']['finished_documents']} finished documents parse")
    if args.out:
        env = environment(None, " ".join(sys.argv))
        Path(args.out).write_text(json.dumps({"environment": env, "rows": [compile_row, *mask_rows, run]}, indent=1))


if __name__ == "__main__":
    main()
