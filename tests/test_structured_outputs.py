"""Structured outputs (xgrammar): every constraint kind gives valid output on the embedded model,
sampled or greedy, beside unconstrained requests that it leaves alone; bad constraints are clear
errors. On a tiny model: grammars under speculation, penalties, quantized KV caches and preemption;
a grammar that raises fails its own request alone; compiles on a bounded pool with time limits, a
cache bounded by bytes, and a size limit on constraints."""

from __future__ import annotations

import collections
import json
import random
import re
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from helpers import SPEC, assert_clean
from structured_helpers import PROMPT, TINY_EBNF, TINY_GRAMMARS, mix_compiler, mix_round, random_object

from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.llm import EngineError
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.tokenizer import load_tokenizer

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


def test_random_json_schemas_are_followed(llm: LLM) -> None:
    """30 schemas drawn afresh from a seeded generator, in one batch: every output parses and
    validates against its own schema."""
    rng = random.Random(20240516)
    schemas = [random_object(rng) for _ in range(30)]
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
    from tokenmill.engine.core import structured_outputs
    from tokenmill.layers import grammar_mask
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
        monkeypatch.setattr(grammar_mask, "POOL_START_S", start)
        bitmask = xgrammar.allocate_token_bitmask(len(rows), 8192)
        grammar_mask.fill_masks(bitmask, rows)
        masks.append(bitmask)
    assert torch.equal(masks[0], masks[1])
    assert len({tuple(row.tolist()) for row in masks[0]}) > 3


@pytest.mark.parametrize("vocab_size", [64, 8192, 1000])
def test_masking_logits_matches_xgrammar(vocab_size: int) -> None:
    import torch
    import xgrammar

    from tokenmill.layers.grammar_mask import mask_logits

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
    monkeypatch.setattr("tokenmill.engine.frontend.input_processor.check_constraint", lambda spec, max_bytes: None)
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


def test_a_request_aborted_while_its_constraint_compiles_ends_quietly(llm: LLM) -> None:
    """Its sequences were never queued: the abort ends them without touching the scheduler's queue
    (it raised there once), and the engine serves on with nothing left behind."""
    engine = llm.engine
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    engine.add_request("compiling", PROMPT, params, stream=False)
    assert len(engine.core.grammars) and not engine.core.scheduler.waiting
    engine.abort_request("compiling")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.scheduler.num_waiting_requests == engine.core.scheduler.num_running_requests == 0
    assert llm.generate([PROMPT], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from server.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_speculation_grammars_penalties_quantized_kv_and_preemption_together(tiny_model: Path, caplog) -> None:
    """Rounds of a seeded random mix on a tiny model, each with speculation on and off (the same engine
    options otherwise: a KV cache in the model's dtype, int8 or fp8, a pool that forces preemption or
    not): no step fails, every constrained output follows its grammar, and the tokens are the same.
    Between them the rounds take drafts that are stop tokens, go past a grammar's end under ignore_eos,
    preempt, and use each KV cache dtype."""
    compiler, seen = mix_compiler(tiny_model), collections.Counter()
    for seed in range(8):
        mix_round(tiny_model, seed, compiler, seen)
    assert all(seen[what] for what in ("past a stop token", "drafts", "preemptions", "auto", "int8", "fp8")), seen
    assert not [r for r in caplog.records if "broke" in r.getMessage()]


class _FailingMatcher:
    """A real matcher whose ``method`` raises once it has run ``after`` times: a grammar that fails
    inside a step, at the point the test picks."""

    def __init__(self, matcher: Any, method: str, after: int) -> None:
        self._matcher, self._method, self._left = matcher, method, after

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._matcher, name)
        if name != self._method:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._left -= 1
            if self._left < 0:
                raise RuntimeError(f"injected failure in {name}")
            return attr(*args, **kwargs)
        return call


def _run_to_the_end(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    """Each request's last output, failed or finished, driving the engine step by step (``generate``
    stops at the first error)."""
    for request_id, (prompt, params) in requests.items():
        llm.engine.add_request(request_id, prompt, params, stream=False)
    last = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            last[out.request_id] = out
    return last


class _RaisingPool:
    """xgrammar's thread pool when a matcher of the batch raises."""

    def batch_fill_next_token_bitmask(self, *args: Any) -> None:
        raise RuntimeError("a matcher of the batch failed")


@pytest.mark.parametrize("method,after,pooled", [("fill_next_token_bitmask", 2, False),
                                                 ("fill_next_token_bitmask", 2, True), ("accept_token", 3, False),
                                                 ("rollback", 0, False)])
def test_a_grammar_that_raises_in_a_step_fails_its_own_request_alone(tiny_model: Path, monkeypatch, method: str,
                                                                     after: int, pooled: bool) -> None:
    """A matcher that raises while the step masks (row by row, or in xgrammar's thread pool), takes a
    token or a draft, or rolls drafts back: its request ends with an engine error, and every other
    request of the step, constrained or not, gets the tokens it gets alone."""
    from tokenmill.layers import grammar_mask
    from tokenmill.outputs import ERROR_ENGINE

    if pooled:  # every mask is the pool's, and the pool raises: the rows are filled again one by one
        monkeypatch.setattr(grammar_mask, "POOL_START_S", -1.0)
        monkeypatch.setattr(grammar_mask, "_thread_pool", _RaisingPool)
    tokenizer = load_tokenizer(tiny_model)
    eos = tokenizer.eos_token_id
    requests = {}
    for kind in [*TINY_GRAMMARS, None]:
        example = TINY_GRAMMARS[kind][2] if kind else "the quick brown fox"
        ids = tokenizer(example, add_special_tokens=False)["input_ids"]
        requests[str(kind)] = ((ids + [eos]) * 2 + ids[:2], SamplingParams(
            temperature=0, max_tokens=32, structured_outputs=TINY_GRAMMARS[kind][0] if kind else None))
    llm = LLM(str(tiny_model), device="cpu", dtype="float32", max_num_seqs=8, speculative_config=SPEC)
    alone = {request_id: _run_to_the_end(llm, {request_id: request})[request_id]
             for request_id, request in requests.items()}
    grammars = llm.engine.core.grammars.compiler
    victim = grammars.submit(StructuredOutputsParams(**TINY_GRAMMARS["regex"][0])).result()
    make_matcher = grammars.matcher
    monkeypatch.setattr(grammars, "matcher", lambda compiled: _FailingMatcher(make_matcher(compiled), method, after)
                        if compiled is victim else make_matcher(compiled))
    outs = _run_to_the_end(llm, requests)
    assert "structured output" in outs["regex"].error and outs["regex"].error_kind == ERROR_ENGINE
    for request_id, out in outs.items():
        if request_id != "regex":
            assert out.error is None and out.outputs[0].token_ids == alone[request_id].outputs[0].token_ids
    assert llm.engine.core.stats.num_failed_steps == 0
    assert llm.engine.core.stats.spec_decode_num_drafts > 0
    assert_clean(llm)


# ------------------------------------------- compiles on a bounded pool, a bounded cache, a size limit
def _hold_compiles(monkeypatch, held: Any) -> tuple[threading.Event, list[StructuredOutputsParams]]:
    """Make the compiles of the constraints that ``held`` picks wait for the event returned; the list
    gets every constraint a worker compiles."""
    from tokenmill.engine.core.structured_outputs import GrammarCompiler

    release, compiled = threading.Event(), []
    compile_ = GrammarCompiler._compile

    def compile_held(self: GrammarCompiler, spec: StructuredOutputsParams) -> Any:
        compiled.append(spec)
        if held(spec):
            release.wait()
        return compile_(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", compile_held)
    return release, compiled


def _tiny_compiler(model_dir: Path, **options: Any) -> Any:
    from tokenmill.engine.core.structured_outputs import GrammarCompiler

    tokenizer = load_tokenizer(model_dir)
    return GrammarCompiler(model_dir, len(tokenizer), (tokenizer.eos_token_id,), **options)


def test_slow_compiles_do_not_hold_up_a_quick_one(tiny_model: Path, monkeypatch) -> None:
    """Three compiles that do not end (until the test lets them) leave a worker of the default four to
    a trivial choice, which compiles while they still run."""
    release, _ = _hold_compiles(monkeypatch, lambda spec: spec.regex is not None)
    compiler = _tiny_compiler(tiny_model)
    try:
        slow = [compiler.submit(StructuredOutputsParams(regex=f"slow{i}")) for i in range(3)]
        assert compiler.submit(StructuredOutputsParams(choice=["yes", "no"])).result(timeout=60) is not None
        assert all(job.started is not None and not job.done() for job in slow)
    finally:
        release.set()
    assert all(job.result(timeout=60) is not None for job in slow)


def test_the_time_limits_count_from_the_compiles_start() -> None:
    """Time queued behind other compiles is not a request's fault: it has its own, shorter limit,
    and the compile's own limit counts from its start (or from the request, if it came later)."""
    from tokenmill.engine.core.structured_outputs import CompileJob, GrammarCompiler

    compiler = GrammarCompiler(Path("unused"), 100, (), workers=2)
    compiler.timeout_s, compiler.queue_timeout_s = 30.0, 10.0
    job = CompileJob("key")
    assert compiler.overdue(job, waiting_since=100.0, now=110.0) is None
    assert "no grammar compile worker was free for 10 s (all 2 were compiling" in compiler.overdue(job, 100.0, 110.5)
    job.started = 125.0  # 25 s in the queue, then a worker
    assert compiler.overdue(job, 100.0, 155.0) is None
    assert "took longer than 30 s" in compiler.overdue(job, 100.0, 155.5)
    assert compiler.overdue(job, 140.0, 170.0) is None  # a request that came once it ran: from its coming
    assert "took longer than 30 s" in compiler.overdue(job, 140.0, 170.5)
    compiler.close()


def test_a_compile_that_waits_or_runs_too_long_fails_its_request_as_unavailable(tiny_model: Path, monkeypatch) -> None:
    """With one worker busy, a request whose compile queues past the limit fails as the engine's
    limit ("unavailable": a retry may succeed), and its compile, wanted by nobody now, never runs; one
    whose compile runs past the limit fails the same way. The others go on."""
    from tokenmill.outputs import ERROR_UNAVAILABLE

    held_regex = TINY_GRAMMARS["regex"][0]["regex"]
    release, compiled = _hold_compiles(monkeypatch, lambda spec: spec.regex == held_regex)
    llm = LLM(str(tiny_model), device="cpu", dtype="float32", max_num_seqs=4, grammar_compile_workers=1)
    grammars, engine = llm.engine.core.grammars.compiler, llm.engine
    grammars.queue_timeout_s = 0.0
    greedy = dict(temperature=0, max_tokens=16)
    requests = {"held": SamplingParams(**greedy, structured_outputs=TINY_GRAMMARS["regex"][0]),
                "queued": SamplingParams(**greedy, structured_outputs=TINY_GRAMMARS["choice"][0]),
                "free": SamplingParams(**greedy)}
    for request_id, params in requests.items():
        engine.add_request(request_id, "ab", params, stream=False)
    last = {}
    try:
        while "queued" not in last:
            last.update((out.request_id, out) for out in engine.step())
    finally:
        release.set()
    while engine.has_unfinished_requests():
        last.update((out.request_id, out) for out in engine.step())
    queued = last["queued"]
    assert queued.error_kind == ERROR_UNAVAILABLE and "no grammar compile worker was free" in queued.error
    assert [spec.regex for spec in compiled] == [held_regex]  # the choice's compile was dropped
    assert last["free"].error is None and last["held"].error is None
    assert TINY_GRAMMARS["regex"][1](last["held"].outputs[0].text)

    release, _ = _hold_compiles(monkeypatch, lambda spec: spec.grammar is not None)
    grammars.timeout_s = 0.0
    try:
        with pytest.raises(EngineError, match="took longer than 0 s"):
            llm.generate(["ab"], SamplingParams(structured_outputs={"grammar": TINY_EBNF}), use_tqdm=False)
    finally:
        release.set()
    assert llm.generate(["ab"], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    assert_clean(llm)


def _schema_of(index: int) -> dict[str, Any]:
    """Distinct schemas of about the same compiled size."""
    return {"type": "object", "properties": {f"field_{index}_{i}": {"type": "integer"} for i in range(12)}}


def test_the_compiled_grammar_cache_is_bounded_by_bytes_and_keeps_the_newest(tiny_model: Path) -> None:
    size = _tiny_compiler(tiny_model).submit(StructuredOutputsParams(json=_schema_of(-1))).result().memory_size_bytes
    limit = int(3.5 * size)
    compiler = _tiny_compiler(tiny_model, cache_bytes=limit)
    first = compiler.submit(StructuredOutputsParams(json=_schema_of(0))).result()
    for index in range(1, 12):
        newest = compiler.submit(StructuredOutputsParams(json=_schema_of(index))).result()
        assert 0 < compiler.cache_bytes <= limit
    hit = compiler.submit(StructuredOutputsParams(json=_schema_of(11)))
    assert hit.done() and hit.result() is newest
    assert compiler.submit(StructuredOutputsParams(json=_schema_of(0))).result() is not first  # evicted
    assert compiler._compiler.get_cache_size_bytes() == 0  # xgrammar keeps nothing of its own
    none_kept = _tiny_compiler(tiny_model, cache_bytes=0)
    again = [none_kept.submit(StructuredOutputsParams(json=_schema_of(0))).result() for _ in range(2)]
    assert again[0] is not again[1] and none_kept.cache_bytes == 0


@pytest.mark.parametrize("structured,kind", [
    ({"json": {"type": "object", "description": "x" * 300}}, "json"),
    ({"json": json.dumps({"enum": ["y" * 300]})}, "json"),
    ({"regex": "a" * 201}, "regex"), ({"grammar": 'root ::= "' + "b" * 200 + '"'}, "grammar"),
    ({"choice": ["ab" * 20] * 6}, "choice"), ({"choice": ["é" * 101]}, "choice"),  # 202 bytes of UTF-8
])
def test_a_constraint_larger_than_the_limit_is_refused(tiny_model: Path, structured: dict, kind: str) -> None:
    llm = LLM(str(tiny_model), device="cpu", dtype="float32", max_num_seqs=2, max_structured_output_bytes=200)
    with pytest.raises(ValueError, match=rf"structured_outputs.{kind} is \d+ bytes, more than this engine's limit of "
                                         r"200 \(the max_structured_output_bytes option\)"):
        llm.generate(["ab"], SamplingParams(structured_outputs=structured), use_tqdm=False)
    within = {"choice": ["é" * 100]}  # 200 bytes: at the limit
    assert llm.generate(["ab"], SamplingParams(max_tokens=4, structured_outputs=within), use_tqdm=False)
