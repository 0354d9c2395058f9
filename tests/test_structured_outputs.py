"""Structured outputs (xgrammar): every constraint kind gives valid output on the embedded model,
sampled or greedy, beside unconstrained requests that it leaves alone; bad constraints are clear
errors."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

PROMPT = "def parse(text):\n    return"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_num_seqs=32)  # room for a batch of 30 schemas at once


def _texts(llm: LLM, structured: dict, **params) -> list[str]:
    sampling = SamplingParams(structured_outputs=structured, **{"max_tokens": 80, "temperature": 0.8, "seed": 3, **params})
    out = llm.generate([PROMPT], sampling, use_tqdm=False)[0]
    assert all(c.finish_reason == "stop" for c in out.outputs), [c.text for c in out.outputs]
    return [c.text for c in out.outputs]


def test_a_choice_is_one_of_the_strings(llm: LLM) -> None:
    choices = ["yes", "no", "not sure"]
    assert all(text in choices for text in _texts(llm, {"choice": choices}, n=4))


def test_a_regex_matches_whole(llm: LLM) -> None:
    for text in _texts(llm, {"regex": r"[0-9]{3}-[0-9]{4}"}, n=3):
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text


@pytest.mark.parametrize("as_text", [False, True])
def test_a_json_schema_is_followed(llm: LLM, as_text: bool) -> None:
    for text in _texts(llm, {"json": json.dumps(SCHEMA) if as_text else SCHEMA}, n=2):
        value = json.loads(text)
        assert isinstance(value["name"], str) and len(value["name"]) <= 12 and isinstance(value["age"], int)


def _random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
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
        return {"type": "array", "items": _random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    return _random_object(rng, depth + 1)


def _random_object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    properties = {f"field_{i}": _random_schema(rng, depth) for i in range(rng.randint(1, 3))}
    return {"type": "object", "properties": properties,
            "required": rng.sample(sorted(properties), rng.randint(0, len(properties)))}


def test_random_json_schemas_are_followed(llm: LLM) -> None:
    """30 schemas drawn afresh from a seeded generator, in one batch: every output parses and
    validates against its own schema."""
    rng = random.Random(20240516)
    schemas = [_random_object(rng) for _ in range(30)]
    params = [SamplingParams(structured_outputs={"json": schema}, max_tokens=400, temperature=0.8, seed=i)
              for i, schema in enumerate(schemas)]
    outputs = llm.generate([PROMPT] * len(schemas), params, use_tqdm=False)
    for schema, out in zip(schemas, outputs):
        [choice] = out.outputs
        assert choice.finish_reason == "stop", (schema, choice.text)
        jsonschema.validate(json.loads(choice.text), schema)


def test_json_object_and_a_grammar(llm: LLM) -> None:
    assert isinstance(json.loads(_texts(llm, {"json_object": True}, max_tokens=200)[0]), dict)
    for text in _texts(llm, {"grammar": 'root ::= "(" [a-z]+ ")"'}, n=2):
        assert re.fullmatch(r"\([a-z]+\)", text), text


def test_unconstrained_requests_in_the_same_batch_are_unchanged(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPT, PROMPT], [greedy, SamplingParams(max_tokens=20, structured_outputs={"regex": "[a-c]+"})],
                         use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert re.fullmatch("[a-c]+", mixed[1].outputs[0].text)


def test_drafts_are_verified_against_the_grammar(llm: LLM) -> None:
    """Prompt lookup proposes drafts for a constrained request too; each draft's row is masked as
    the grammar stands after the drafts before it, so the output is plain constrained decoding's."""
    spec = LLM(device="cpu", max_num_seqs=8, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    prompt = "x = 'abababababababababab'\ny = '"
    for structured in ({"regex": "(ab){1,9}c"}, {"regex": "(ab|ba){1,7}'"}):
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=structured)
        plain = llm.generate([prompt], params, use_tqdm=False)[0]
        out = spec.generate([prompt], params, use_tqdm=False)[0]
        assert re.fullmatch(structured["regex"], out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
        assert out.metrics.spec_decode_num_drafts > 0
    stats = spec.engine.core.stats
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # some refused


def test_overlapped_steps_mask_once_the_previous_tokens_are_read(caplog) -> None:
    """With steps overlapped, a constrained row's step launches under the one in flight and samples
    once that one's tokens have advanced the matcher: outputs equal one step at a time's, and no
    token ever breaks a grammar (a last token, cut by max_tokens, masked as every other)."""
    overlapped = LLM(device="cpu", max_num_seqs=8)
    one_at_a_time = LLM(device="cpu", max_num_seqs=8, async_scheduling=False)
    held_back = []
    launch = overlapped.engine.core.runner.launch

    def watched(batch, previous=None):
        step = launch(batch, previous)
        held_back.append(step.pending_sample is not None)
        return step

    overlapped.engine.core.runner.launch = watched
    params = [SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": SCHEMA}),
              SamplingParams(temperature=0.9, seed=4, max_tokens=20, structured_outputs={"regex": "[a-z ]+[.]"}),
              SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.2),
              SamplingParams(temperature=0, max_tokens=6, structured_outputs={"regex": "[0-9]{40}"})]
    outs = [run.generate([PROMPT] * len(params), params, use_tqdm=False) for run in (overlapped, one_at_a_time)]
    assert [[c.token_ids for c in o.outputs] for o in outs[0]] == [[c.token_ids for c in o.outputs] for o in outs[1]]
    assert re.fullmatch("[0-9]+", outs[0][-1].outputs[0].text) and outs[0][-1].outputs[0].finish_reason == "length"
    assert sum(held_back) > 10
    assert not [r for r in caplog.records if "broke" in r.getMessage()]


def test_masks_filled_by_the_thread_pool_equal_those_filled_in_turn(monkeypatch) -> None:
    """The filler hands rows to xgrammar's thread pool once filling them in turn has cost more than
    the pool's start: forced either way, every row's mask is the same, and masks differ by state."""
    import torch
    import xgrammar

    from tokenmill.default_model import DEFAULT_MODEL_DIR
    from tokenmill.engine import structured_outputs
    from tokenmill.tokenizer import load_tokenizer

    compiler = structured_outputs.GrammarCompiler(DEFAULT_MODEL_DIR, 8192, ())
    compiled = compiler.submit(StructuredOutputsParams(json=SCHEMA)).result()
    document = load_tokenizer(DEFAULT_MODEL_DIR)('{"name": "Ada", "age": 36}', add_special_tokens=False)["input_ids"]
    rows = []
    for i in range(len(document)):
        matcher = compiler.matcher(compiled)
        assert all(matcher.accept_token(token) for token in document[:i])
        rows.append((i, matcher))
    masks = []
    for start in (float("inf"), -1.0):
        monkeypatch.setattr(structured_outputs, "POOL_START_S", start)
        bitmask = xgrammar.allocate_token_bitmask(len(rows), 8192)
        structured_outputs.fill_masks(bitmask, rows)
        masks.append(bitmask)
    assert torch.equal(masks[0], masks[1])
    assert len({tuple(row.tolist()) for row in masks[0]}) > 3


@pytest.mark.parametrize("vocab_size", [64, 8192, 1000])
def test_masking_logits_matches_xgrammar(vocab_size: int) -> None:
    import torch
    import xgrammar

    from tokenmill.engine.structured_outputs import mask_logits

    generator = torch.Generator().manual_seed(vocab_size)
    bitmask = torch.randint(-2**31, 2**31 - 1, xgrammar.get_bitmask_shape(5, vocab_size), dtype=torch.int32,
                            generator=generator)
    bitmask[1] = -1  # a row that allows everything
    logits = torch.randn(5, vocab_size, generator=generator)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab_size)
    mask_logits(logits, bitmask)
    assert torch.equal(logits, expected)
    assert logits[1].isfinite().all() and 0.3 < logits.isinf().float().mean() < 0.7


@pytest.mark.parametrize("structured", [{"regex": "(unclosed"}, {"json": "{not json"}, {"grammar": "root ::= ("},
                                        {"json": {"type": "no-such-type"}}])
def test_a_constraint_that_does_not_parse_is_refused_before_it_runs(llm: LLM, structured: dict) -> None:
    with pytest.raises(ValueError, match="structured_outputs.(regex|json|grammar) is not valid"):
        llm.generate([PROMPT], SamplingParams(structured_outputs=structured), use_tqdm=False)
    assert llm.generate([PROMPT], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids


def test_a_constraint_that_does_not_compile_fails_its_request_only(llm: LLM, monkeypatch) -> None:
    """(Parsing catches what it can; a failure in the engine's compile still ends only its request.)"""
    monkeypatch.setattr("tokenmill.engine.input_processor.check_constraint", lambda spec: None)
    with pytest.raises(ValueError, match="structured_outputs cannot be compiled"):
        llm.generate([PROMPT], SamplingParams(structured_outputs={"regex": "(unclosed"}), use_tqdm=False)
    assert llm.generate([PROMPT], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("value,message", [
    ({}, "exactly one of"), ({"regex": "a", "choice": ["b"]}, "exactly one of"), ({"choice": []}, "be choice"),
    ({"choice": ["a", ""]}, "be choice"), ({"json": 3}, "be json: a JSON schema"), ({"regex": ""}, "be regex"),
    ({"json_object": "yes"}, "be json_object"), ({"schema": {}}, "unknown field 'schema'"),
    ("a regex", "structured_outputs must be"),
])
def test_bad_structured_outputs_are_clear_errors(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=value)


def test_the_params_round_trip_through_the_core_messages() -> None:
    import msgspec

    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert again.structured_outputs == params.structured_outputs


def test_a_constraint_that_compiles_too_long_fails_its_request_only(monkeypatch) -> None:
    import time

    from tokenmill.engine import core
    from tokenmill.engine.structured_outputs import GrammarCompiler

    compile_ = GrammarCompiler._compile
    monkeypatch.setattr(GrammarCompiler, "_compile", lambda self, spec: (time.sleep(0.5), compile_(self, spec))[1])
    monkeypatch.setattr(core, "GRAMMAR_TIMEOUT_S", 0.1)
    llm = LLM(device="cpu", max_num_seqs=4)
    with pytest.raises(ValueError, match="took longer than"):
        llm.generate([PROMPT], SamplingParams(structured_outputs={"regex": "[a-z]+"}), use_tqdm=False)
    assert llm.generate([PROMPT], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids


def test_a_request_aborted_while_its_constraint_compiles_ends_quietly(llm: LLM) -> None:
    """Its sequences were never queued: the abort ends them without touching the scheduler's queue
    (it raised there once), and the engine serves on with nothing left behind."""
    engine = llm.engine
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    engine.add_request("compiling", PROMPT, params, stream=False)
    assert engine.core._compiling and not engine.core.scheduler.waiting
    engine.abort_request("compiling")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.scheduler.num_waiting_requests == engine.core.scheduler.num_running_requests == 0
    assert llm.generate([PROMPT], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
