"""The same request gives the same tokens whatever the engine does around it:
prefix caching on or off, any chunk budget, alone or batched, after preemption;
greedy, and seeded under temperature sampling."""

from __future__ import annotations

import pytest

from helpers import frozen_step_cost, make_model_dir
from parity_helpers import parity_prompts
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=10, ignore_eos=True, seed=1234)

VARIANTS = {
    "baseline": dict(max_num_seqs=8, max_num_batched_tokens=2048),
    "no-prefix-cache": dict(max_num_seqs=8, max_num_batched_tokens=2048, enable_prefix_caching=False),
    "chunk-16": dict(max_num_seqs=8, max_num_batched_tokens=16),
    "chunk-40": dict(max_num_seqs=4, max_num_batched_tokens=40),
    "preempting-pool": dict(max_num_seqs=4, max_num_batched_tokens=48, num_kv_blocks=16),
    # The CPU's prompt chunks beside decoding sequences, sized by a step cost (20 tokens in the target):
    # 16 tokens a step, shared by the prompts in it.
    "cpu-step-target": dict(max_num_seqs=8, max_num_batched_tokens=64, step_cost=(0.05, 0.01)),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3")
    make_model_dir("llama3", path)
    return str(path)


def run(model_dir: str, params: SamplingParams, one_at_a_time: bool = False,
        step_cost: tuple[float, float] | None = None, **options) -> list[list[int]]:
    """``step_cost``: (fixed, per-token) seconds that size the prompt chunks beside decoding sequences,
    in place of the engine's own measurements."""
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=16, **options)
    if step_cost is not None:
        llm.engine.core.scheduler.step_cost = frozen_step_cost(*step_cost)
    prompts = parity_prompts()
    if one_at_a_time:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.core.kv.num_blocks_in_use == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_same_tokens_under_every_engine_variant(model_dir: str, params: SamplingParams) -> None:
    expected = run(model_dir, params, one_at_a_time=True, max_num_seqs=1)
    for name, options in VARIANTS.items():
        assert run(model_dir, params, **options) == expected, name


def test_seed_changes_the_sample(model_dir: str) -> None:
    other = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, max_tokens=10, ignore_eos=True, seed=99)
    assert run(model_dir, other, max_num_seqs=8) != run(model_dir, SEEDED, max_num_seqs=8)


def test_n_choices_are_distinct_and_reproducible(model_dir: str) -> None:
    llm = LLM(model_dir, device="cpu", dtype="float32")
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, ignore_eos=True, seed=7)
    first = llm.generate([parity_prompts()[3]], params, use_tqdm=False)[0]
    again = llm.generate([parity_prompts()[3]], params, use_tqdm=False)[0]
    choices = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c) for c in choices}) > 1
    assert choices == [c.token_ids for c in again.outputs]
