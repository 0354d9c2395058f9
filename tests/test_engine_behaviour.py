"""Stopping, detokenization, logprobs, logits pruning and bad input, on a tiny model with a tokenizer."""

from __future__ import annotations

import gc
import json
import logging
import re

import numpy as np
import pytest
import torch

from helpers import frozen_step_cost, make_model_dir, make_model_with_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.engine.core.scheduler import CHUNK_QUANTUM, StepCost, StepWork
from tokenmill.tokenizer import StreamDetokenizer, WindowDetokenizer, make_detokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_with_tokenizer("llama3", tmp_path_factory.mktemp("tiny-with-tokenizer"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32)


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


DETOKENIZERS = pytest.mark.parametrize("detokenizer", [StreamDetokenizer, WindowDetokenizer])


def test_fast_tokenizers_stream(model_dir) -> None:
    from transformers import AutoTokenizer

    assert isinstance(make_detokenizer(AutoTokenizer.from_pretrained(str(model_dir)), []), StreamDetokenizer)


@DETOKENIZERS
def test_detokenizer_never_emits_half_a_character(model_dir, detokenizer) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = "naïve café 日本語 🙂 ✓"
    ids = tok.encode(text)
    # Split multi-byte characters across tokens by encoding byte by byte where possible.
    detok = detokenizer(tok, [])
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@DETOKENIZERS
def test_detokenizer_holds_back_partial_utf8(model_dir, detokenizer) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = tok.get_vocab()
    # The byte-level pieces of "🙂" (F0 9F 99 82), one token per byte.
    byte_tokens = [vocab[c] for c in "ðŁĻĤ"]
    detok = detokenizer(tok, [])
    pieces = [detok.add(i) for i in byte_tokens]
    assert pieces[:3] == ["", "", ""] and pieces[3] == "🙂"


def test_stop_string_ends_text_before_it(llm) -> None:
    full = llm.generate("def fibonacci(n):", greedy(24, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = llm.generate("def fibonacci(n):", greedy(24, stop=[stop], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]
    kept = llm.generate("def fibonacci(n):", greedy(24, stop=stop, include_stop_str_in_output=True, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm) -> None:
    full = llm.generate([5, 6, 7], greedy(12, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop_tok = full.token_ids[2]
    first = full.token_ids.index(stop_tok)
    out = llm.generate([5, 6, 7], greedy(12, stop_token_ids=[stop_tok], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    late = llm.generate([5, 6, 7], greedy(12, stop_token_ids=[stop_tok], min_tokens=first + 2, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= first + 2
    assert stop_tok not in late.token_ids[:first + 1]


def test_eos_list_from_generation_config(tmp_path) -> None:
    make_model_dir("llama3", tmp_path)
    probe = LLM(str(tmp_path), device="cpu", dtype="float32")
    toks = probe.generate([1, 2, 3], greedy(10, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [319, toks[3]]}))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32")
    out = llm.generate([1, 2, 3], greedy(10), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == toks[:toks.index(toks[3]) + 1] and out.finish_reason == "stop"
    ignored = llm.generate([1, 2, 3], greedy(10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == toks and ignored.finish_reason == "length"


def test_logprobs_and_prompt_logprobs(llm) -> None:
    out = llm.generate([[9, 8, 7, 6, 5] * 8], greedy(4, logprobs=3, prompt_logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    for token, lp in zip(comp.token_ids, comp.logprobs):
        assert token in lp and 3 <= len(lp) <= 4
        assert lp[token] == max(lp.values())  # greedy picks the most likely
    assert comp.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(comp.token_ids, comp.logprobs)))
    prompt = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for token, lp in zip(prompt[1:], out.prompt_logprobs[1:]):
        assert token in lp and all(v <= 0 for v in lp.values())


def test_the_token_budget_follows_the_gpus_memory(model_dir, monkeypatch) -> None:
    from types import SimpleNamespace

    from tokenmill.engine.worker.rank import token_budget

    llm = LLM(str(model_dir), device="cpu", dtype="float32")  # unset: the CPU's budget
    assert llm.engine.core.config.max_num_batched_tokens == 2048
    assert llm.engine.core.scheduler.config.max_num_batched_tokens == 2048
    assert token_budget(100, torch.device("cpu")) == 100
    for gib, budget in ((141, 8192), (80, 8192), (48, 2048), (24, 2048)):
        props = SimpleNamespace(total_memory=gib << 30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, props=props: props)
        assert token_budget(None, torch.device("cuda")) == budget
        assert token_budget(512, torch.device("cuda", 1)) == 512


def test_the_step_cost_is_fitted_to_measured_steps_and_sizes_chunks_to_its_target() -> None:
    cost = StepCost(target_s=0.25)
    decoding = StepWork(tokens=1, pairs=100)  # one sequence decoding, 100 tokens in
    assert cost.estimate() is None and cost.prompt_tokens(decoding, 0, 2048) == 2048  # nothing measured yet
    for _ in range(3):  # steps of one size cannot tell the terms apart: the time goes on the work
        cost.observe(StepWork(3, 300), 0.0563)
    fixed, per_token, per_pair = cost.estimate()
    assert fixed == 0 and per_token * 3 + per_pair * 300 == pytest.approx(0.0563)
    assert cost.prompt_tokens(decoding, 0, 2048) == CHUNK_QUANTUM  # about 13 such tokens in 0.25 s: the least
    steps = [StepWork(1, 100), StepWork(50, 2500), StepWork(1, 160), StepWork(257, 120_000), StepWork(129, 200_000)]
    for work in steps:  # 0.05 s a step, 2 ms a token and 1 us a query-key pair
        cost.observe(work, 0.05 + 0.002 * work.tokens + 1e-6 * work.pairs)
    assert cost.estimate() == pytest.approx((0.05, 0.002, 1e-6))
    # 0.198 s left beside the decoding row: 94 tokens at the start of a prompt, 64 a thousand tokens in,
    # where each chunk token reads a thousand keys more.
    assert cost.prompt_tokens(decoding, 0, 2048) == 80
    assert cost.prompt_tokens(decoding, 1000, 2048) == 64
    assert cost.prompt_tokens(decoding, 0, 40) == 40  # never more than the budget
    busy = StepWork(tokens=60, pairs=60 * 2000)  # the decoding rows alone take more than the target
    assert cost.prompt_tokens(busy, 0, 2048) == CHUNK_QUANTUM
    for step in range(60):  # the machine slows to half speed: the fit follows, the old steps fading out
        work = steps[step % len(steps)]
        cost.observe(work, 2 * (0.05 + 0.002 * work.tokens + 1e-6 * work.pairs))
    assert cost.estimate() == pytest.approx((0.1, 0.004, 2e-6), rel=1e-3)
    assert cost.prompt_tokens(decoding, 0, 2048) == 32
    fresh = StepCost(target_s=0.25)
    for work in (StepWork(1, 100), StepWork(8, 800), StepWork(20, 2000), StepWork(4, 500)):
        fresh.observe(work, 0.01 + 0.0001 * work.tokens)  # 0.24 s would hold 2,400 tokens this cheap
    assert fresh.prompt_tokens(decoding, 0, 2048) == 32  # but a step takes at most twice the largest seen (20)


def test_cpu_prompt_chunks_beside_decoding_sequences_keep_to_the_step_target(model_dir, monkeypatch) -> None:
    """A long prompt that arrives while another sequence decodes gets per step only the tokens that the
    step-cost estimate allows beside it (0.05 s + 4 ms a token against 0.25 s: 50 tokens, 48 for the
    chunk beside one decoding row), not the whole budget, which a prompt takes when nothing decodes;
    the tokens are those of chunks sized by the budget alone."""
    g = torch.Generator().manual_seed(3)
    first, second = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (200, 300))

    def run(step_cost: StepCost | None) -> tuple[list[dict[str, int]], dict[str, list[int]]]:
        llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=512,
                  enable_prefix_caching=False)
        engine, scheduler = llm.engine, llm.engine.core.scheduler
        scheduler.step_cost = step_cost
        steps, schedule = [], scheduler.schedule

        def recording():
            batch = schedule()
            steps.append({seq.request_id: n for seq, n in zip(batch.seqs, batch.num_tokens)})
            return batch

        monkeypatch.setattr(scheduler, "schedule", recording)
        engine.add_request("a", first, greedy(40, ignore_eos=True), stream=False)
        finals = [out for _ in range(3) for out in engine.step()]
        engine.add_request("b", second, greedy(8, ignore_eos=True), stream=False)
        while engine.has_unfinished_requests():
            finals += engine.step()
        return steps, {out.request_id: out.outputs[0].token_ids for out in finals}

    steps, tokens = run(frozen_step_cost(0.05, 0.004))
    assert steps[0] == {"a": 200}  # nothing decodes yet: the whole prompt in one step
    chunks = [step for step in steps if step.get("b", 0) > 1]
    assert [step["b"] for step in chunks] == [48] * 6 + [12]
    assert all(step.get("a") == 1 for step in chunks)  # the first decodes in every one of them
    unlimited_steps, unlimited_tokens = run(None)
    assert [step["b"] for step in unlimited_steps if step.get("b", 0) > 1] == [300]
    assert tokens == unlimited_tokens and len(tokens["a"]) == 40 and len(tokens["b"]) == 8


def test_prompt_only_chunks_run_no_lm_head(model_dir, monkeypatch) -> None:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_batched_tokens=16)
    rows = []
    original = llm.engine.core.runner.model.head_logits
    monkeypatch.setattr(llm.engine.core.runner.model, "head_logits", lambda h: rows.append(h.shape[0]) or original(h))
    llm.generate([list(range(1, 60))], greedy(3, ignore_eos=True), use_tqdm=False)
    # 59 prompt tokens in chunks of 16: 3 chunks with no LM head, then one row per step.
    assert rows == [1, 1, 1]
    assert llm.engine.core.stats.num_steps == 6


def test_chat_applies_the_template(llm) -> None:
    out = llm.chat([{"role": "user", "content": "hi"}], greedy(4, ignore_eos=True), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids) == "<|user|>\nhi<|end|>\n<|assistant|>\n"


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "empty"),
    ([1, 2, 100000], SamplingParams(), "outside the vocabulary"),
    ([-1], SamplingParams(), "outside the vocabulary"),
    ([1] * 600, SamplingParams(), "max_model_len"),
])
def test_bad_prompts_raise_and_the_engine_keeps_serving(llm, prompt, params, message) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3], prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.kv.num_blocks_in_use == 0
    assert len(llm.generate([[1, 2, 3]], greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(n=0), "n must"), (dict(min_p=2.0), "min_p"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(stop=[""]), "stop"),
])
def test_bad_sampling_params_raise(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompts_in_the_core_leave_the_garbage_collectors_walk(llm) -> None:
    """Each full collection walks every tracked container: the core's copies of long prompts must
    not be among them (they are tuples of ints, untracked once a collection has met them)."""
    engine = llm.engine
    engine.add_request("gc", [7, 8, 9] * 100, greedy(4, n=2, ignore_eos=True))
    engine.step()
    seqs = engine.core.requests["gc"].seqs
    gc.collect()
    assert seqs[0].prompt_token_ids is seqs[1].prompt_token_ids  # one copy for the request's choices
    assert list(seqs[0].prompt_token_ids) == [7, 8, 9] * 100
    assert not gc.is_tracked(seqs[0].prompt_token_ids)
    while engine.has_unfinished_requests():
        engine.step()


def test_abort_frees_blocks(llm) -> None:
    engine = llm.engine
    engine.add_request("a", [1, 2, 3] * 10, greedy(50, ignore_eos=True))
    engine.add_request("b", [4, 5, 6] * 10, greedy(50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.core.kv.num_blocks_in_use > 0
    out = engine.abort_request("a")  # a step is in flight: its pending token is dropped
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].token_ids and all(t >= 0 for t in out.outputs[0].token_ids)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.kv.num_blocks_in_use == 0
    assert engine.abort_request("a") is None


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_that_ends_with_its_prompts_step_leaves_the_prompt_cached(model_dir, overlap) -> None:
    """One token asked for, or a stop on the first: the request ends in the step that computes its
    prompt, and the next prompt with the same start finds those blocks (with the same results as
    computing them again)."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=4, async_scheduling=overlap)
    fresh = LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=4, enable_prefix_caching=False)
    kv, vocab = llm.engine.core.kv, llm.engine.model_config.vocab_size
    ended_at_once = [greedy(1), greedy(4, stop_token_ids=list(range(vocab)))]
    for n, params in enumerate(ended_at_once):
        prompt = [(7 * i + n) % 50 + 3 for i in range(40)]  # two full blocks of 16 and 8 tokens more
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 1
        hits = kv.hit_tokens
        longer = prompt + [9, 8, 7, 6, 5]
        cached = llm.generate([longer], greedy(8, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
        assert kv.hit_tokens - hits == 32, "the prompt's blocks were not cached when its request ended"
        assert cached == fresh.generate([longer], greedy(8, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids


def test_unknown_model_directory_errors_are_clear(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="not supported; supported: LlamaForCausalLM"):
        LLM(str(tmp_path))
    make_model_dir("qwen2", tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(tmp_path))


def test_random_weights_cpu_kv_sizing(model_dir) -> None:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=2, cpu_kv_cache_gib=0.001)
    per_block = 2 * 2 * 16 * 2 * 32 * 4
    assert llm.engine.core.kv.pools[0].num_blocks == min(int(0.001 * (1 << 30)) // per_block, 2 * 512 // 16)
    assert [t.shape[2] for t in llm.engine.core.runner.kv_tensors] == [llm.engine.core.kv.pools[0].num_blocks]


def test_penalties_steer_away_from_seen_tokens(llm) -> None:
    prompt = [7, 8, 9, 10]
    plain = llm.generate([prompt], greedy(24, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(plain + prompt)) < len(plain + prompt), "the baseline must repeat for the test to mean anything"
    params = [greedy(24, ignore_eos=True, repetition_penalty=1e4),
              greedy(24, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0)]
    strict, soft = (o.outputs[0].token_ids for o in llm.generate([prompt, prompt], params, use_tqdm=False))
    assert len(set(strict + prompt)) == len(strict + prompt), "a huge repetition penalty never repeats"
    assert soft != plain


def test_overlapped_steps_match_one_step_at_a_time(model_dir) -> None:
    """Async scheduling launches step N+1 before step N's tokens are read; stops that land
    meanwhile (stop ids, stop strings, max_tokens), n > 1, seeds and logprobs must give exactly
    what one step at a time gives, and leave no block behind (preemption under overlap: the
    parity tests, which run overlapped by default)."""
    def run(async_scheduling: bool, params):
        llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=3, max_num_batched_tokens=24,
                  num_kv_blocks=12, async_scheduling=async_scheduling)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.core.kv.num_blocks_in_use == 0 and not llm.engine.has_unfinished_requests()
        return llm, [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)
                     for o in outs for c in o.outputs]

    def same(a, b) -> bool:  # logprobs may differ in the last bits: batches are composed differently
        return a[:4] == b[:4] and (a[4] is None) == (b[4] is None) and all(
            x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-5 for t in x) for x, y in zip(a[4] or [], b[4] or []))

    prompts = [[1, 2, 3] * 5, [7, 8, 9, 10] * 9, [11] * 3, [4, 5] * 20]
    _, free_run = run(False, greedy(24, ignore_eos=True))
    params = [
        greedy(24, stop_token_ids=[free_run[0][0][5]]),
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12, logprobs=2),
        greedy(30, stop=[free_run[2][1][4:7]], ignore_eos=True),
        greedy(25, ignore_eos=True, min_tokens=5),
        # Penalties sample once the step before is read: counts as of every earlier token.
        greedy(20, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
        SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True, frequency_penalty=1.5),
    ]
    prompts += [[2, 3, 2, 3, 6] * 4, [9, 9, 8] * 6]
    _, one_at_a_time = run(False, params)
    _, overlapped = run(True, params)
    assert len(overlapped) == len(one_at_a_time) and all(map(same, overlapped, one_at_a_time))
    assert [o[2] for o in overlapped][:2] == ["stop", "length"]


def test_plain_tokens_end_up_as_the_general_path_takes_them(model_dir, monkeypatch) -> None:
    """``EngineCore._accept_plain`` takes a lone sequence's token that ends nothing without the
    general path. With it turned off (every token through the general path) a batch that mixes plain
    requests with stop tokens, stop strings, length limits, n > 1, logprobs and min_tokens gives the
    same outputs and counts the same tokens."""
    from tokenmill.engine.core.engine_core import EngineCore

    prompts = [[1, 2, 3] * 5, [7, 8, 9, 10] * 9, [11] * 3, [4, 5] * 20, [2, 3, 2, 3, 6] * 4]
    probe = LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=8)
    free = probe.generate(prompts[:3], greedy(20, ignore_eos=True), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    stop_at = next(i for i in range(4, len(tokens)) if tokens[i] not in tokens[:i])  # (while all run)
    params = [greedy(20, stop_token_ids=[tokens[stop_at]], ignore_eos=True),
              greedy(20, stop=[free[1].outputs[0].text[3:6]], ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=9),
              greedy(12, logprobs=2),
              greedy(16, min_tokens=10)]
    taken = []
    plain = EngineCore._accept_plain

    def counting(self, result, pending_index):
        rest = plain(self, result, pending_index)
        taken.append(len(result.sampled_seqs) - len(rest))
        return rest

    def run() -> tuple[list, int]:
        llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=8)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return ([(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for o in outs for c in o.outputs],
                llm.engine.core.stats.generation_tokens)

    monkeypatch.setattr(EngineCore, "_accept_plain", counting)
    fast = run()
    assert sum(taken) > 0, "the plain path must take tokens for this test to compare anything"
    monkeypatch.setattr(EngineCore, "_accept_plain", lambda self, result, pending_index: range(len(result.sampled_seqs)))
    assert run() == fast
    assert fast[0][0][:3] == (tokens[:stop_at + 1], fast[0][0][1], "stop") and fast[0][1][2] == "stop"


def test_penalised_steps_overlap_and_count_every_token(llm, model_dir) -> None:
    """Penalties read token counts kept on the device, each step's sample added in place after it:
    a penalised step launches under the one in flight and samples at once (nothing held back), and
    its tokens equal those of steps run one at a time, which count from the host's tokens. Two
    penalised sequences of one request (n=2, seeded) and a plain one share the batch; a new
    request's row reuses one freed by a finished sequence."""
    engine = llm.engine
    held_back = []
    launch = engine.core.runner.launch

    def watched(batch, previous=None):
        step = launch(batch, previous)
        held_back.append(step.pending_sample is not None)
        return step

    prompts = [[1, 2, 3] * 4, [5, 6, 7, 5]]
    params = [SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=12, ignore_eos=True, repetition_penalty=1.5,
                             frequency_penalty=0.4, presence_penalty=0.3),
              greedy(10, ignore_eos=True)]
    engine.core.runner.launch = watched
    try:
        overlapped = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]  # rows reused the 2nd time
    finally:
        engine.core.runner.launch = launch
    assert len(held_back) > 10 and not any(held_back)
    one_at_a_time = LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
                        async_scheduling=False).generate(prompts, params, use_tqdm=False)
    expected = [[c.token_ids for c in out.outputs] for out in one_at_a_time]
    for run in overlapped:
        assert [[c.token_ids for c in out.outputs] for out in run] == expected


@pytest.mark.parametrize("arch", ["default", "gemma3", "gemma4-kv-shared", "gemma4-multimodal"])
def test_warm_up_leaves_the_cache_and_results_alone(arch: str, model_dir, tmp_path) -> None:
    """The start-up warm-up (run on CUDA to compile kernels) runs prefill-shaped forwards that write
    only to the padding slot, for every architecture (Gemma's sliding and global layers, KV-shared
    layers reading another's cache): the KV cache and later results are unchanged. Its sampled
    steps count tokens in the penalties' table, whose rows a later penalised request reads clean."""
    if arch != "default":
        make_model_dir(arch, tmp_path)
        model_dir = tmp_path
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=6, max_num_batched_tokens=100)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6] * 4]
    kinds = (greedy(8), greedy(8, repetition_penalty=1.5, frequency_penalty=0.5))

    def results() -> list[list[int]]:
        return [llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids for params in kinds]

    before = results()
    caches = [t.clone() for t in llm.engine.core.runner.kv_tensors]
    llm.engine.core.runner.warm_up(100, llm.engine.max_model_len)
    assert all(torch.equal(t, c) for t, c in zip(llm.engine.core.runner.kv_tensors, caches))
    # The warm-up's penalised sequence (prompt [0, 1]) took a row of the table, as a request would.
    assert any(row.nonzero().flatten().tolist() == [0, 1] for row in llm.engine.core.runner.penalties.prompt)
    assert results() == before


def test_overlap_under_preemption_and_streaming(model_dir) -> None:
    """A pool too small for four growing sequences forces preemptions while steps overlap:
    results equal the one-at-a-time run, and no streamed output ever shows a pending token."""
    prompts = [[5 + i, 6, 7, 8] * 5 for i in range(4)]
    params = greedy(60, ignore_eos=True)
    results = {}
    for overlap in (False, True):
        llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=10,
                  async_scheduling=overlap)
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params, stream=True)
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                ids = out.outputs[0].token_ids
                assert all(t >= 0 for t in ids), "a placeholder leaked into an output"
                assert len(ids) <= 60
                if out.finished:
                    final[out.request_id] = ids
        assert engine.core.scheduler.num_preemptions > 0
        assert engine.core.kv.num_blocks_in_use == 0
        results[overlap] = final
    assert results[True] == results[False]
    assert all(len(ids) == 60 for ids in results[True].values())


def test_the_start_up_log_says_what_start_up_took(model_dir, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.core.builder"):
        LLM(str(model_dir), device="cpu", dtype="float32")
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")]
    assert len(ready) == 1
    assert re.search(r"; start-up weights \d+\.\d s, KV cache and CUDA graphs \d+\.\d s$", ready[0]), ready[0]


def test_a_steps_sequences_go_longest_context_first(llm, monkeypatch) -> None:
    """Attention's programs start in the batch's order, so a step hands the forward its sequences
    longest context first whatever order they were scheduled in; in a step of prompt chunks and
    one-token queries the chunks come first, and the two kinds attend apart (``num_chunk_seqs``).
    Each request's tokens are those it gets alone."""
    steps = []
    forward = llm.engine.core.runner._forward

    def watched(plan, tensors):
        steps.append((plan.arrays["seq_lens"].tolist(), np.diff(plan.arrays["query_start_loc"]).tolist(),
                      plan.num_chunk_seqs))
        return forward(plan, tensors)

    prompts = [[3, 4] * 2, [5, 6, 7] * 5, [8] * 9, [9, 10] * 3]  # shortest first
    monkeypatch.setattr(llm.engine.core.runner, "_forward", watched)
    engine, tokens = llm.engine, {}
    for i, prompt in enumerate(prompts[:2]):
        engine.add_request(f"r{i}", prompt, greedy(6, ignore_eos=True), stream=False)
    engine.step()
    engine.step()  # the first two decode when the others arrive: a step of chunks and one-token queries
    for i, prompt in enumerate(prompts[2:], 2):
        engine.add_request(f"r{i}", prompt, greedy(6, ignore_eos=True), stream=False)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    assert any(0 < num_chunk_seqs < len(contexts) for contexts, _, num_chunk_seqs in steps)
    for contexts, query_lens, num_chunk_seqs in steps:
        chunks = sum(1 for n in query_lens if n > 1)
        assert num_chunk_seqs == (chunks if chunks < len(query_lens) else 0)
        assert all(n > 1 for n in query_lens[:chunks])  # chunks first, then the one-token queries
        assert contexts[:chunks] == sorted(contexts[:chunks], reverse=True)
        assert contexts[chunks:] == sorted(contexts[chunks:], reverse=True)
    alone = [llm.generate([p], greedy(6, ignore_eos=True), use_tqdm=False)[0] for p in prompts]
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == [o.outputs[0].token_ids for o in alone]


def test_get_stats_counts_what_the_engine_did(model_dir) -> None:
    """``LLM.get_stats()`` (what ``/metrics`` shows): the tokens computed and generated, the steps, the
    prefix cache's hits on a repeated prompt, and the KV cache back to empty once every request ends."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_seqs=4, kv_cache_dtype="int8")
    before = llm.get_stats()
    assert before.num_steps == before.generation_tokens == 0 and before.kv_capacity_tokens > 0
    params = greedy(max_tokens=7, ignore_eos=True)
    outputs = llm.generate([list(range(1, 40)), list(range(50, 60))], params, use_tqdm=False)
    outputs += llm.generate([list(range(1, 40))], params, use_tqdm=False)  # its blocks are cached now
    stats = llm.get_stats()
    assert stats.generation_tokens == sum(len(o.outputs[0].token_ids) for o in outputs) == 21
    assert stats.prefix_cache_queries >= 39 and stats.prefix_cache_hits >= 32  # (two blocks of 16)
    assert stats.prompt_tokens == 39 + 10 + 39 - stats.prefix_cache_hits
    assert stats.num_steps >= 7 and stats.num_graph_steps == 0  # (no CUDA graphs on the CPU)
    assert stats.num_running == stats.num_waiting == stats.kv_blocks_in_use == 0 and stats.kv_usage == 0
    assert stats.kv_cache_dtype == "int8" and stats.num_failed_steps == stats.spec_decode_num_drafts == 0
