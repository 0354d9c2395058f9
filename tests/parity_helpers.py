"""Token parity with transformers, shared by the model tests: the parity prompts, transformers'
greedy reference, and the engine run (batched, chunked, preempted, prefix-cached) compared with it.

Greedy tokens must equal transformers' greedy ``generate`` in float32. Where they differ, the first
differing position must be a tie in the reference's logits: the two tokens' logits within
``TIE_TOL`` of each other (float32 noise from a different summation order is ~1e-6 at these logit
scales); the rest of that sequence is then not compared. Per-token logprobs must agree within
``LOGPROB_TOL``."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import VOCAB

from tokenmill import LLM, SamplingParams
from tokenmill.models.registry import load_model_config

TIE_TOL = 1e-4
LOGPROB_TOL = 1e-4
MAX_TOKENS = 12


def parity_prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    shared = rand(48)
    return [rand(1), rand(7), rand(16), shared + rand(5), rand(33), shared + rand(20), rand(64),
            shared + rand(52), rand(100), rand(17)]


def reference_generate(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                         do_sample=False, return_dict_in_generate=True, output_logits=True,
                         eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack([step[0] for step in out.logits]).float()
    return tokens, logits


def assert_matches_reference(ours: list[int], ours_logprobs: list[dict[int, float]],
                             ref: list[int], ref_logits: torch.Tensor) -> None:
    ref_logprobs = ref_logits.log_softmax(-1)
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            gap = (ref_logits[i, b] - ref_logits[i, a]).abs().item()
            assert gap < TIE_TOL, f"token {i}: ours {a}, transformers {b}, logit gap {gap} is no tie"
            return
        assert abs(ours_logprobs[i][a] - ref_logprobs[i, a].item()) < LOGPROB_TOL


def preempting_pool(model_dir: Path) -> int:
    """KV blocks that make the parity prompts preempt (4 at a time, chunks of 48, blocks of 16): a
    model whose every layer slides frees the blocks its window passed, so it needs a smaller pool."""
    groups = load_model_config(model_dir).kv_layout().groups
    return 12 if all(spec.sliding_window is not None for spec in groups) else 16


def assert_engine_matches(model: torch.nn.Module, model_dir: Path) -> None:
    """The engine on ``model_dir`` (batched, chunked, preempted, prefix-cached) against ``model``."""
    prompts = parity_prompts()
    llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=16, max_num_seqs=4,
              max_num_batched_tokens=48, num_kv_blocks=preempting_pool(model_dir))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert stats.prefix_cache_hits > 0, "prompts sharing a prefix were meant to hit the prefix cache"
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        assert len(completion.token_ids) == MAX_TOKENS
        assert completion.finish_reason == "length"
        ref, ref_logits = reference_generate(model, prompt)
        assert_matches_reference(completion.token_ids, completion.logprobs, ref, ref_logits)
    assert llm.get_stats().kv_blocks_in_use == 0
