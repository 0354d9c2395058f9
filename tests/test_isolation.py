"""One request's bad input, or a failed step, never touches another request, and the
offline ``LLM`` keeps working afterwards with nothing leaked."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.llm import EngineError

from helpers import assert_clean, make_model_with_tokenizer
from tokenmill.default_model import DEFAULT_MODEL_DIR
from tokenmill.tokenizer import load_tokenizer, render_chat


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_with_tokenizer("qwen3", tmp_path_factory.mktemp("tiny-isolation"))


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
               max_model_len=128)


def works(llm: LLM) -> None:
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert_clean(llm)


POISON = {
    "stop id outside the vocabulary, with min_tokens": (
        lambda: ([1, 2], SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=[99999])), "stop_token_ids"),
    "prompt + max_tokens over max_model_len": (lambda: ([1] * 100, SamplingParams(max_tokens=100)),
                                               "maximum context length"),
    "lone surrogate in the prompt": (lambda: ("ab\ud800", SamplingParams()), "not valid Unicode"),
    "prompt id of the wrong type": (lambda: ([1, "2"], SamplingParams()), "outside the vocabulary"),
    "logprobs over the vocabulary": (lambda: ([1], SamplingParams(logprobs=10**6)), "vocabulary size"),
    "min_tokens over the context": (lambda: ([1, 2], SamplingParams(max_tokens=None, min_tokens=500)),
                                    "min_tokens"),
}


@pytest.mark.parametrize("case", sorted(POISON))
def test_poisoned_request_is_refused_and_the_engine_keeps_serving(llm: LLM, case: str) -> None:
    make, message = POISON[case]
    prompt, params = make()
    good = [9, 8, 7]
    with pytest.raises(ValueError, match=message):
        llm.generate([good, prompt], params, use_tqdm=False)  # the good one is not left queued either
    assert_clean(llm)
    works(llm)


@pytest.mark.parametrize("bad", [
    dict(temperature=float("nan")), dict(repetition_penalty=float("nan")), dict(temperature=None),
    dict(max_tokens="x"), dict(stop=123), dict(top_k=2.5), dict(max_tokens=1.5), dict(seed="x"), dict(stop=[1]),
    dict(stop_token_ids="ab"), dict(seed=2**64), dict(stop="ab\ud800"), dict(repetition_penalty=1e-45),
    dict(temperature=1e300), dict(min_tokens=2**63),
])
def test_bad_sampling_params_are_value_errors(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_a_huge_top_k_is_clamped_to_the_vocabulary(llm: LLM) -> None:
    """``top_k`` of 10**400 used to overflow inside the step and fail the whole batch: now
    it is refused (it cannot cross to the engine's process), and any 64-bit one is clamped."""
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=10**400)
    params = SamplingParams(temperature=1.0, top_k=2**63 - 1, max_tokens=3, seed=0, ignore_eos=True)
    out = llm.generate([[3, 4, 5]], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert_clean(llm)


@pytest.mark.parametrize("options, message", [
    (dict(max_model_len=0), "max_model_len"), (dict(max_model_len=-5), "max_model_len"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(no_such_option=1), "unknown engine option"),
])
def test_bad_engine_options(model_dir, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), device="cpu", **options)


def test_failed_step_fails_its_requests_and_the_next_generate_works(llm: LLM,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    runner = llm.engine.core.runner
    real_launch = runner.launch
    calls = iter([True])

    def failing_once(*args: object) -> object:
        if next(calls, False):
            raise RuntimeError("injected device fault")
        return real_launch(*args)

    monkeypatch.setattr(runner, "launch", failing_once)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with pytest.raises(EngineError, match="injected device fault"):
        llm.generate([[1, 2, 3], [4, 5, 6]], params, use_tqdm=False)
    assert_clean(llm)
    assert llm.engine.core.stats.num_failed_steps >= 1
    works(llm)


def test_a_request_that_can_never_be_scheduled_ends_with_an_error(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """If nothing runs and the first waiting sequence cannot get blocks from an empty pool,
    it never will: the request ends with an error instead of ``generate`` spinning forever."""
    monkeypatch.setattr(llm.engine.core.kv, "allocate", lambda seq, n: False)
    with pytest.raises(EngineError, match="can never run"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    monkeypatch.undo()
    assert_clean(llm)
    works(llm)


def test_a_request_with_nothing_to_run_ends_with_an_error(llm: LLM) -> None:
    """A request none of whose sequences runs or waits, and that never ended (``n`` = 0, put past the
    checks as ``sp.n = 0`` once was), ends with an error instead of the engine stepping on forever
    (driven here a bounded number of steps, as ``generate`` would step it unbounded)."""
    params = SamplingParams(max_tokens=2)
    object.__setattr__(params, "n", 0)
    llm.engine.add_request("stuck", [1, 2, 3], params, stream=False)
    outputs = [out for _ in range(5) if llm.engine.has_unfinished_requests() for out in llm.engine.step()]
    assert not llm.engine.has_unfinished_requests()
    [out] = outputs
    assert out.finished and out.error is not None and "could never finish" in out.error
    assert_clean(llm)
    works(llm)


def test_chat_roles_go_to_the_template(llm: LLM) -> None:
    """Any role reaches the chat template, which decides: this one takes every role, the
    embedded model's refuses all but four, and its refusal is a ValueError."""
    out = llm.chat([{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
                   SamplingParams(max_tokens=2), use_tqdm=False)
    assert out[0].outputs[0].finish_reason is not None
    with pytest.raises(ValueError, match="chat template cannot render"):
        render_chat(load_tokenizer(DEFAULT_MODEL_DIR), [{"role": "narrator", "content": "x"}])
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], SamplingParams(max_tokens=2))
    assert_clean(llm)
