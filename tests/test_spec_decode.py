"""Speculative decoding by prompt lookup: the proposer against a brute-force search, and outputs
equal to plain decoding's (greedy token for token, sampled in distribution) under batching,
chunking, preemption, prefix caching and ``n > 1``."""

from __future__ import annotations

import numpy as np
import torch
import pytest
from helpers import SPEC, TINY_CONFIGS, echo_prompts, make_model_dir
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2_contingency
from parity_helpers import parity_prompts

from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineConfig, SpeculativeConfig
from tokenmill.engine.core.spec_decode import (
    TokenHistory,
    accepted_length,
    propose_ngram,
)

def brute_force_proposal(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest n (max_n down to min_n) whose last-n run occurs earlier ending before the last
    token; of its occurrences the latest; the k tokens after it."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 2, n - 2, -1):  # the occurrence's last index, latest first
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40), k=st.integers(1, 6),
       bounds=st.tuples(st.integers(1, 5), st.integers(1, 5)).map(sorted))
def test_the_proposer_finds_what_a_brute_force_search_finds(tokens: list[int], k: int, bounds: list[int]) -> None:
    min_n, max_n = bounds
    got = propose_ngram(np.asarray(tokens, dtype=np.int64), k, min_n, max_n).tolist()
    assert got == brute_force_proposal(tokens, k, min_n, max_n)


def test_token_history_follows_a_growing_list() -> None:
    history, tokens = TokenHistory(), []
    for step in range(300):
        tokens.extend(range(step % 3 + 1))
        assert history.view(7, tokens).tolist() == tokens
    history.forget(7)
    assert history.view(7, [5, 6]).tolist() == [5, 6]


def test_accepted_length_counts_the_leading_matches() -> None:
    assert accepted_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accepted_length([1, 2, 3], [1, 9, 3, 4]) == 1
    assert accepted_length([1, 2, 3], [0, 2, 3, 4]) == 0
    assert accepted_length([], [5]) == 0


@pytest.mark.parametrize("value,message", [
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, r"num_speculative_tokens must be in \[1, 16\]"),
    ({"num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer"),
    ({"num_speculative_tokens": 2, "method": "eagle"}, "method must be one of"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "must not exceed"),
    ({"num_speculative_tokens": 2, "lookahead": 3}, "unknown key 'lookahead'"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be >= 1"),
    ("{not json", "not valid JSON"),
    ([4], "must be a dict"),
])
def test_a_bad_speculative_config_is_a_clear_error(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


def test_the_config_takes_json_and_vllm_spellings() -> None:
    config = EngineConfig(speculative_config='{"method": "prompt_lookup", "num_speculative_tokens": 3}')
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3, method="ngram")


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.core.kv.num_blocks_in_use == 0
    return [c.token_ids for o in outs for c in o.outputs]


VARIANTS = {
    "batched": dict(max_num_seqs=8, max_num_batched_tokens=2048),
    "chunk-16": dict(max_num_seqs=4, max_num_batched_tokens=16),
    "preempting-pool": dict(max_num_seqs=4, max_num_batched_tokens=48, num_kv_blocks=16),
    "no-prefix-cache": dict(max_num_seqs=8, enable_prefix_caching=False),
}


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_greedy_output_is_unchanged_for_every_architecture(arch: str, tmp_path) -> None:
    make_model_dir(arch, tmp_path)
    plain = LLM(str(tmp_path), device="cpu", dtype="float32", max_num_seqs=8)
    prompts = echo_prompts(plain, parity_prompts()[:6])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = _generate(plain, prompts, params)
    for name, options in VARIANTS.items():
        spec = LLM(str(tmp_path), device="cpu", dtype="float32", speculative_config=SPEC, **options)
        assert _generate(spec, prompts, params) == expected, name
        assert spec.engine.core.stats.spec_decode_num_drafts > 0, name


@pytest.fixture(scope="module")
def embedded() -> tuple[LLM, LLM]:
    """The embedded model with and without speculation (it repeats code it has seen, so drafts stand)."""
    return LLM(device="cpu", max_num_seqs=8), LLM(device="cpu", max_num_seqs=8, speculative_config=SPEC)


CODE = ["def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
        "import os\nimport sys\nimport re\n\nimport os\nimport sys\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n\nclass Point:\n"]


def test_the_embedded_model_gives_the_same_tokens_and_logprobs_in_fewer_steps(embedded) -> None:
    plain, spec = embedded
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=3, n=1)
    a = plain.generate(CODE, params, use_tqdm=False)
    steps_before = spec.engine.core.stats.num_steps
    b = spec.generate(CODE, params, use_tqdm=False)
    for x, y in zip(a, b):
        ours, theirs = x.outputs[0], y.outputs[0]
        assert ours.token_ids == theirs.token_ids and ours.text == theirs.text
        for lp_a, lp_b in zip(ours.logprobs, theirs.logprobs):
            assert lp_a.keys() == lp_b.keys()
            assert all(abs(lp_a[t] - lp_b[t]) < 1e-3 for t in lp_a)
        metrics = y.metrics
        assert metrics.spec_decode_num_drafts > 0 and metrics.spec_decode_num_accepted_tokens > 0
        assert 1 < metrics.spec_decode_mean_accepted_length <= 1 + SPEC["num_speculative_tokens"]
    assert spec.engine.core.stats.num_steps - steps_before < 48  # plain decoding takes one step a token


def test_n_choices_stops_and_seeded_samples_are_kept(embedded) -> None:
    plain, spec = embedded
    for params in (SamplingParams(temperature=0, max_tokens=30, n=2, stop=["\n\n"]),
                   SamplingParams(temperature=0, max_tokens=7, min_tokens=5, stop_token_ids=[10]),
                   SamplingParams(temperature=0.8, max_tokens=20, n=3, seed=11),
                   SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=3, logprobs=2)):
        a = plain.generate(CODE, params, use_tqdm=False)
        b = spec.generate(CODE, params, use_tqdm=False)
        b_again = spec.generate(CODE, params, use_tqdm=False)
        ids = lambda outs: [[c.token_ids for c in o.outputs] for o in outs]
        assert ids(b) == ids(b_again)  # seeded (or greedy): reproducible with speculation
        # A seeded sequence's generator is wound back to the last token kept, so each token costs
        # one draw as in plain decoding: seeded samples are those of plain decoding too.
        assert ids(a) == ids(b)
        assert [[c.finish_reason for c in o.outputs] for o in a] == [[c.finish_reason for c in o.outputs] for o in b]


def test_sampled_tokens_follow_the_distribution_of_plain_decoding() -> None:
    """Two-sample chi-square on the second and third sampled tokens (the ones drafts decide), 600
    samples each way: the seeds differ, the distributions must not."""
    prompt = CODE[0]
    samples = {}
    for name, options in (("plain", {}), ("spec", {"speculative_config": {**SPEC, "disable_by_batch_size": 1024}})):
        llm = LLM(device="cpu", max_num_seqs=200, **options)
        params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=600, seed=5 if name == "spec" else 6)
        outs = llm.generate([prompt], params, use_tqdm=False)
        samples[name] = [c.token_ids for o in outs for c in o.outputs]
        if name == "spec":
            assert llm.engine.core.stats.spec_decode_num_accepted_tokens > 0
    for position in (1, 2):
        counts: dict[int, list[int]] = {}
        for column, name in enumerate(("plain", "spec")):
            for tokens in samples[name]:
                counts.setdefault(tokens[position], [0, 0])[column] += 1
        common = [c for c in counts.values() if sum(c) >= 10]
        rare = [sum(c[i] for c in counts.values() if sum(c) < 10) for i in (0, 1)]
        table = common + ([rare] if sum(rare) else [])
        assert len(table) >= 2
        assert chi2_contingency(np.asarray(table)).pvalue > 1e-3, position


class _EagerGraph:
    """Stands in for a captured CUDA graph on the CPU: replaying runs the captured forward eagerly
    over the same static buffers, so the padding of verify steps is checked without a GPU."""

    def __init__(self, graphs, key: tuple[int, int, int]) -> None:
        self.graphs, self.key = graphs, key

    def replay(self) -> None:
        self.graphs._forward(*self.key)


@pytest.mark.parametrize("arch", ["llama3", "gemma3"])
def test_verify_steps_padded_for_graphs_give_the_same_tokens(arch: str, tmp_path) -> None:
    from tokenmill.engine.worker.cuda_graphs import DecodeGraphs

    make_model_dir(arch, tmp_path)
    plain = LLM(str(tmp_path), device="cpu", dtype="float32", max_num_seqs=8)
    prompts = echo_prompts(plain, parity_prompts()[:6])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    expected = plain.generate(prompts, params, use_tqdm=False)

    spec = LLM(str(tmp_path), device="cpu", dtype="float32", max_num_seqs=8, block_size=4,
               speculative_config={**SPEC, "disable_by_batch_size": 9})
    runner, core = spec.engine.core.runner, spec.engine.core
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.num_kv_groups, 8, -(-core.max_model_len // 4), 4,
                          core.model_config.vocab_size, torch.float32, torch.device("cpu"), verify_len=5,
                          max_verify_seqs=8)
    graphs.graphs = {key: _EagerGraph(graphs, key) for key in graphs._keys()}
    runner.graphs = graphs
    got = spec.generate(prompts, params, use_tqdm=False)
    assert graphs.verify_replays > 0
    for a, b in zip(expected, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(lp_a[t] - lp_b[t]) < 1e-4 for t in lp_a)
