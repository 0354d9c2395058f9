"""vLLM's request fields in the engine: ``logit_bias``, priority scheduling, and
``logprobs`` / ``prompt_logprobs`` = -1 (the whole vocabulary)."""

from __future__ import annotations

import dataclasses
import math

import msgspec
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.frontend.llm_engine import LLMEngine
from tokenmill.engine.messages import AddRequest, CoreInput
from tokenmill.layers.sampler import Sampler, SamplingBatch
from tokenmill.outputs import RequestOutput

from helpers import VOCAB, assert_clean, make_model_with_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_with_tokenizer("qwen3", tmp_path_factory.mktemp("tiny-vllm-fields"))


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
               max_model_len=128, max_logprobs=-1)


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def with_bias(params: SamplingParams, bias: object) -> SamplingParams:
    return dataclasses.replace(params, logit_bias=bias)


# ---------------------------------------------------------------- logit_bias
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)])
def test_plus_100_forces_the_token_every_step(llm: LLM, params: SamplingParams) -> None:
    assert tokens(llm, [PROMPT], with_bias(params, {42: 100}))[0] == [42] * 6


def test_minus_100_bans_the_greedy_token(llm: LLM) -> None:
    (plain,) = tokens(llm, [PROMPT], GREEDY)
    (banned,) = tokens(llm, [PROMPT], with_bias(GREEDY, {plain[0]: -100}))
    assert plain[0] not in banned


def test_a_bias_overrides_the_greedy_ids_a_cuda_graph_took() -> None:
    """On the GPU a decode graph hands the sampler its argmax; a biased row must not use it."""
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]])
    full = lambda v, dt=torch.float32: torch.full((2,), v, dtype=dt)  # noqa: E731
    batch = SamplingBatch(
        temperature=full(0.0), inv_temperature=full(0.0), top_k=full(0, torch.int64), top_p=full(1.0), min_p=full(0.0),
        repetition_penalty=full(1.0), presence_penalty=full(0.0), frequency_penalty=full(0.0),
        generators=[None, None], num_logprobs=0, all_greedy=True,
        logit_bias=(torch.tensor([1]), torch.tensor([2]), torch.tensor([1.5])))
    out = Sampler()(logits, batch, greedy_ids=torch.tensor([1, 1]))
    assert out.token_ids.tolist() == [1, 2]
    assert out.logprobs[:, 0].tolist() == pytest.approx(logits.log_softmax(-1)[[0, 1], [1, 2]].tolist())
    assert logits[1, 2] == 1.0  # the caller's logits are left as they were


def test_a_biased_request_leaves_its_neighbour_alone(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=6, ignore_eos=True)
    for params in (GREEDY, seeded):
        alone = tokens(llm, [PROMPT], params)
        beside = tokens(llm, [[9, 10, 11], PROMPT], [with_bias(params, {42: 100, 7: -50}), params])
        assert beside[1] == alone[0] and beside[0] == [42] * 6


def test_bias_keeps_the_raw_logprobs(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
    plain = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    biased = llm.generate([PROMPT], with_bias(params, {plain.token_ids[0]: 1.0}), use_tqdm=False)[0].outputs[0]
    assert biased.token_ids == plain.token_ids  # a bias toward the greedy token keeps it greedy
    assert biased.logprobs == [pytest.approx(entry) for entry in plain.logprobs]


@pytest.mark.parametrize("bias, message", [
    ({VOCAB: 1.0}, rf"logit_bias has token ids outside the vocabulary \[0, {VOCAB}\): \[{VOCAB}\]"),
    ({2**63: 1.0}, "logit_bias must be"),
    ({-1: 1.0}, "logit_bias must be"),
    ({"5": 1.0}, "logit_bias must be"),
    ({5: "1"}, "logit_bias must be"),
    ({5: 100.01}, "logit_bias must be"),
    ({5: float("inf")}, "logit_bias must be"),
    ([5, 1.0], "logit_bias must be"),
])
def test_bad_logit_bias_is_a_value_error(llm: LLM, bias: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2], PROMPT], [GREEDY, with_bias(GREEDY, bias)], use_tqdm=False)
    assert_clean(llm)


def test_logit_bias_crosses_to_the_core_process() -> None:
    """The server's core gets requests as msgpack: integer keys and the priority survive it."""
    request = AddRequest("r", PROMPT, with_bias(GREEDY, {3: 1.5, 7: -100}), 1.0, priority=-4)
    decoded = msgspec.msgpack.Decoder(CoreInput).decode(msgspec.msgpack.Encoder().encode(request))
    assert decoded.params.logit_bias == {3: 1.5, 7: -100.0} and decoded.priority == -4


# ------------------------------------------------------------------ priority
def run_in_finish_order(engine: LLMEngine) -> list[RequestOutput]:
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    return finished


def test_priority_policy_serves_lower_values_first(model_dir) -> None:
    engine = LLMEngine(EngineConfig(str(model_dir), device="cpu", dtype="float32", max_num_seqs=1,
                                    max_model_len=128, scheduling_policy="priority"))
    for request_id, priority in (("five", 5), ("zero", 0), ("one", 1)):
        engine.add_request(request_id, PROMPT, GREEDY, stream=False, priority=priority)
    assert [out.request_id for out in run_in_finish_order(engine)] == ["zero", "one", "five"]


def test_fcfs_refuses_a_priority(llm: LLM) -> None:
    with pytest.raises(ValueError, match="priority needs scheduling_policy='priority'"):
        llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False, priority=[0, 1])
    assert_clean(llm)
    (out,) = llm.generate([PROMPT], GREEDY, use_tqdm=False, priority=[0])  # the default is fine
    assert out.outputs[0].token_ids == tokens(llm, [PROMPT], GREEDY)[0]


@pytest.mark.parametrize("priority, message", [
    ([0], "got 1 priority for 2 prompts"), (3, "priority must be"), ([0, 2**63], "priority must be"),
    ([0, 1.0], "priority must be"),
])
def test_bad_priority_is_a_value_error(llm: LLM, priority: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False, priority=priority)
    assert_clean(llm)


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "newest")])
def test_preemption_takes_the_last_in_priority_order(model_dir, llm: LLM, policy: str, victim: str) -> None:
    """Three sequences outgrow a pool of 8 blocks of 4 tokens. Under fcfs the newest is
    preempted; under priority the one with the largest priority value, though older."""
    engine = LLMEngine(EngineConfig(str(model_dir), device="cpu", dtype="float32", max_num_seqs=3, block_size=4,
                                    num_kv_blocks=8, max_model_len=32, enable_prefix_caching=False,
                                    scheduling_policy=policy))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    priorities = {"high": 0, "low": 2, "newest": 1} if policy == "priority" else {"high": 0, "low": 0, "newest": 0}
    for i, (request_id, priority) in enumerate(priorities.items()):
        engine.add_request(request_id, [20 + i, 21, 22, 23], params, stream=False, priority=priority)
    seqs = {request_id: request.seqs[0] for request_id, request in engine.core.requests.items()}
    while engine.core.stats.num_preemptions == 0:
        engine.step()
    assert {rid for rid, seq in seqs.items() if seq.num_preemptions} == {victim}
    finals = {out.request_id: out.outputs[0].token_ids for out in run_in_finish_order(engine)}
    for i, request_id in enumerate(priorities):  # the recompute changes no token
        assert finals[request_id] == tokens(llm, [[20 + i, 21, 22, 23]], params)[0]


# ------------------------------------------------------------- logprobs = -1
def test_max_logprobs_bounds_what_a_request_may_ask(model_dir) -> None:
    """vLLM's max_logprobs (default 20): the whole vocabulary only when it is -1."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64)
    for params in (SamplingParams(logprobs=-1), SamplingParams(prompt_logprobs=21), SamplingParams(logprobs=21)):
        with pytest.raises(ValueError, match=r"gives at most 20 logprobs a position \(its max_logprobs"):
            llm.generate([PROMPT], params, use_tqdm=False)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, logprobs=20, prompt_logprobs=20), use_tqdm=False)[0]
    assert all(len(entry) >= 20 for entry in out.outputs[0].logprobs)
    with pytest.raises(ValueError, match="max_logprobs must be >= -1"):
        LLM(str(model_dir), device="cpu", max_logprobs=-2)


def test_logprobs_minus_one_gives_the_whole_vocabulary(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=-1, prompt_logprobs=-1)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    choice = out.outputs[0]
    assert len(choice.logprobs) == 3
    for token, entry in zip(choice.token_ids, choice.logprobs):
        assert len(entry) == VOCAB and token in entry
        assert max(entry.values()) == entry[token]  # greedy
        assert math.fsum(math.exp(v) for v in entry.values()) == pytest.approx(1, abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for token, entry in zip(PROMPT[1:], out.prompt_logprobs[1:]):
        assert len(entry) == VOCAB and token in entry
        assert math.fsum(math.exp(v) for v in entry.values()) == pytest.approx(1, abs=1e-4)
    assert_clean(llm)
