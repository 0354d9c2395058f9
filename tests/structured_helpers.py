"""Structured-output test material shared by the CPU and GPU tests: random JSON schemas, tiny
grammars of every kind with their own checks, and the seeded mix of speculation, grammars,
penalties, quantized KV caches and preemption."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import jsonschema

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.tokenizer import load_tokenizer

PROMPT = "def parse(text):\n    return"


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A JSON schema of nested objects and arrays, enums, bounded numbers and strings, some fields
    required; small enough that any output that follows it fits the test's token budget."""
    kind = rng.choice(["integer", "number", "string", "boolean", "enum"] + ["object", "array"] * (depth < 2))
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        low = round(rng.uniform(-10, 10), 2)
        return {"type": "number", "minimum": low, "maximum": low + rng.choice([0.5, 3, 100])}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 6)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", 3, 2.5, None, True, "a b"], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    properties = {f"field_{i}": random_schema(rng, depth) for i in range(rng.randint(1, 3))}
    return {"type": "object", "properties": properties,
            "required": rng.sample(sorted(properties), rng.randint(0, len(properties)))}


TINY_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}, "tag": {"enum": ["ab", "ba"]}}, "required": ["name", "n"]}
TINY_EBNF = 'root ::= "(" word (" " word)? ")"\nword ::= [a-z] [a-z]? [a-z]?'


def valid_json(text: str) -> bool:
    try:  # (xgrammar's strings allow raw control characters, which strict parsing refuses)
        jsonschema.validate(json.loads(text, strict=False), TINY_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# Each kind: its constraint, a check of a whole output that does not ask xgrammar, and an output
# it allows (prompts repeat it, each time followed by the stop token, so drafts propose it and
# then the stop token).
TINY_GRAMMARS = {
    "json": ({"json": TINY_SCHEMA}, valid_json, '{"name": "ab", "n": 7}'),
    "regex": ({"regex": "(ab|ba){1,4}c"}, lambda t: re.fullmatch("(ab|ba){1,4}c", t) is not None, "ababc"),
    "choice": ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so"), "maybe so"),
    "grammar": ({"grammar": TINY_EBNF}, lambda t: re.fullmatch(r"\([a-z]{1,3}( [a-z]{1,3})?\)", t) is not None,
                "(ab cd)"),
}


def random_requests(rng: random.Random, tokenizer: Any,
                     eos: int) -> list[tuple[list[int], SamplingParams, str | None]]:
    """A mix of constrained requests of every kind (and some unconstrained), greedy or seeded, with and
    without penalties, ignore_eos and n > 1; each prompt makes prompt lookup propose the rest of a
    valid output and then the stop token."""
    requests = []
    for _ in range(rng.randint(4, 7)):
        kind = rng.choice([*TINY_GRAMMARS, None])
        example = TINY_GRAMMARS[kind][2] if kind else "the quick brown fox"
        ids = tokenizer(example, add_special_tokens=False)["input_ids"]
        prompt = (ids + [eos]) * rng.randint(1, 3) + ids[:rng.randint(0, len(ids) - 1)]
        penalties = rng.choice([{}, {}, {"repetition_penalty": 1.3},
                                {"presence_penalty": 0.5, "frequency_penalty": 0.5}])
        sampling = rng.choice([{"temperature": 0}, {"temperature": 1.0, "seed": rng.randrange(1000)}])
        params = SamplingParams(max_tokens=rng.randint(24, 48), ignore_eos=rng.random() < 0.3, n=rng.choice([1, 1, 2]),
                                structured_outputs=TINY_GRAMMARS[kind][0] if kind else None, **penalties, **sampling)
        requests.append((prompt, params, kind))
    return requests


def check_constrained(tokenizer: Any, matcher: Any, kind: str, token_ids: list[int], eos: int) -> None:
    """The output up to its first stop token follows the grammar: xgrammar takes each of its tokens,
    and, complete, it passes its kind's own check. (Past a stop token, under ignore_eos, the output
    is free.)"""
    end = token_ids.index(eos) if eos in token_ids else len(token_ids)
    assert all(matcher.accept_token(t) for t in token_ids[:end]), (kind, token_ids)
    if end < len(token_ids):
        text = tokenizer.decode(token_ids[:end])
        assert matcher.is_completed() and TINY_GRAMMARS[kind][1](text), (kind, text)


def compile_for_check(compiler: Any, spec: StructuredOutputsParams) -> Any:
    if spec.json is not None:
        return compiler.compile_json_schema(json.dumps(spec.json), any_whitespace=False)
    if spec.regex is not None:
        return compiler.compile_regex(spec.regex)
    if spec.choice is not None:
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
    return compiler.compile_grammar(spec.grammar)


def mix_compiler(tiny_model: Path) -> Any:
    """An xgrammar compiler of the tiny model's vocabulary, to check the mix's outputs with."""
    import xgrammar

    tokenizer = load_tokenizer(tiny_model)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer),
                                                   stop_token_ids=[tokenizer.eos_token_id])
    return xgrammar.GrammarCompiler(info)


def mix_round(tiny_model: Path, seed: int, compiler: Any, seen: dict[str, int], device: str = "cpu") -> None:
    """One round of the mix below, drawn from ``seed``; ``seen`` counts what the rounds exercised."""
    import xgrammar

    rng = random.Random(seed)
    tokenizer = load_tokenizer(tiny_model)
    eos = tokenizer.eos_token_id
    requests = random_requests(rng, tokenizer, eos)
    # A small pool holds the longest sequence and a few blocks more: the others preempt one another.
    longest = max(len(prompt) + p.max_tokens for prompt, p, _ in requests)
    options = dict(device=device, dtype="float32", max_num_seqs=rng.choice([4, 8]), block_size=4,
                   kv_cache_dtype=["auto", "int8", "fp8"][seed % 3], num_kv_blocks=rng.choice([None, longest // 4 + 5]),
                   max_num_batched_tokens=rng.choice([32, 256]))
    plain = LLM(str(tiny_model), **options)
    spec = LLM(str(tiny_model), **options, speculative_config={
        "method": "ngram", "num_speculative_tokens": rng.randint(2, 6), "prompt_lookup_max": 3})
    assert plain.engine.core.model_config.eos_token_ids == (eos,)
    prompts, params = [r[0] for r in requests], [r[1] for r in requests]
    outs = [[[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
            for llm in (plain, spec)]
    for llm in (plain, spec):
        assert llm.engine.core.stats.num_failed_steps == 0, seed
        assert llm.engine.core.kv.num_blocks_in_use == 0, seed
    assert outs[0] == outs[1], seed
    for (_, p, kind), choices in zip(requests, outs[1]):
        if kind is not None:
            compiled = compile_for_check(compiler, p.structured_outputs)
            for token_ids in choices:
                check_constrained(tokenizer, xgrammar.GrammarMatcher(compiled), kind, token_ids, eos)
                seen["past a stop token"] += eos in token_ids[:-1]
    seen["drafts"] += spec.engine.core.stats.spec_decode_num_drafts
    seen["preemptions"] += plain.engine.core.stats.num_preemptions + spec.engine.core.stats.num_preemptions
    seen[options["kv_cache_dtype"]] += 1
