"""KV caches of several shapes: the layout a config maps to, how memory splits between groups,
and sliding-window groups that hold only their window."""

from __future__ import annotations

import pytest
import torch

from helpers import make_model_dir
from tokenmill import LLM, SamplingParams
from tokenmill.engine.worker.rank import kv_block_counts
from tokenmill.models.registry import load_model_config
from tokenmill.loader.kv_layout import KVLayout, KVSpec

FULL, SLIDING = KVSpec(2, 32), KVSpec(2, 32, sliding_window=24)


def test_layers_group_by_spec_and_shared_layers_own_nothing() -> None:
    wide = KVSpec(1, 64)
    layout = KVLayout((SLIDING, wide, SLIDING, wide, SLIDING), source=(0, 1, 2, 3, 2))
    assert layout.groups == (SLIDING, wide)
    assert layout.layer_group == (0, 1, 0, 1, 0)
    assert layout.owners(0) == [0, 2] and layout.owners(1) == [1, 3]
    per_layer = 2 * 2 * 32 * 2  # K and V, 2 heads of 32, bf16
    assert layout.bytes_per_token(torch.bfloat16) == 4 * per_layer
    assert layout.full_length_bytes_per_token(torch.bfloat16) == 5 * per_layer
    with pytest.raises(ValueError, match="layer 1 cannot read the cache of layer 0"):
        KVLayout((SLIDING, wide), source=(0, 0))  # a different shape
    with pytest.raises(ValueError, match="layer 0 cannot read the cache of layer 1"):
        KVLayout((FULL, FULL), source=(1, 1))  # a later layer


def test_gemma3_layers_split_into_a_sliding_and_a_full_group(tmp_path) -> None:
    make_model_dir("gemma3", tmp_path)
    layout = load_model_config(tmp_path).kv_layout()
    assert [spec.sliding_window for spec in layout.groups] == [24, None]
    assert layout.layer_group == (0, 1, 0)


def test_memory_goes_to_full_groups_beyond_what_windows_can_use() -> None:
    layout = KVLayout((SLIDING, SLIDING, FULL), source=(0, 1, 2))
    block = 16 * FULL.bytes_per_token(torch.float32)
    sliding_cap = 4 * (2 + 2) + 3 + 1  # 4 sequences x (window 23 tokens + a block either side) + a chunk, null
    counts = kv_block_counts(layout, torch.float32, 16, budget_bytes=3000 * block, num_blocks=None, max_num_seqs=4,
                             max_num_batched_tokens=48, max_len=100_000)
    assert counts[0] == sliding_cap  # two layers per sliding block
    assert counts[1] == (3000 - 2 * sliding_cap) // 1
    # A budget too small for the caps: every group holds the same number of tokens.
    counts = kv_block_counts(layout, torch.float32, 16, budget_bytes=30 * block, num_blocks=None, max_num_seqs=4,
                             max_num_batched_tokens=48, max_len=100_000)
    assert counts == [10, 10]
    # A fixed count is the full groups'; a sliding group adds its null block, up to its cap.
    assert kv_block_counts(layout, torch.float32, 16, None, 7, 4, 48, 100_000) == [8, 7]
    assert kv_block_counts(layout, torch.float32, 16, None, 70, 4, 48, 100_000) == [sliding_cap, 70]


def test_a_sliding_only_model_holds_its_window_however_long_it_generates(tmp_path) -> None:
    """mistral-window slides on every layer (window 24, blocks of 16): one sequence never holds more
    than the window, a step's chunk and a block either side, over a 300-token generation."""
    make_model_dir("mistral-window", tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=16, max_num_seqs=1,
              max_num_batched_tokens=16, num_kv_blocks=64)
    engine = llm.engine
    engine.add_request("long", [5, 6, 7, 8] * 10, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    held = []
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        held.append(engine.core.kv.num_blocks_in_use)
    assert len(outputs[-1].outputs[0].token_ids) == 300
    assert max(held) <= -(-(24 - 1 + 16) // 16) + 1
    assert engine.core.kv.num_blocks_in_use == 0


def test_step_floor_counts_only_what_windows_let_layers_read(tmp_path) -> None:
    """gemma3 (tiny): layers 0 and 2 slide over 24 tokens, layer 1 sees everything."""
    from tokenmill.bench.shapes import StepCostModel
    from tokenmill.engine.worker.model_runner import build_model

    make_model_dir("gemma3", tmp_path)
    cfg = load_model_config(tmp_path)
    cost = StepCostModel.of(build_model(cfg, None, torch.float32, torch.device("cpu"), 512), cfg)
    per_layer = FULL.bytes_per_token(torch.float32)
    bytes_ = cost.step([1], [400], 1, torch.float32).bytes
    assert bytes_ - cost.weight_bytes(4) == per_layer * (400 + 2 * 24 + 3)  # reads, then the new token's K/V
    layout = cfg.kv_layout()
    assert layout.bytes_held(400, torch.float32) == per_layer * (400 + 2 * 24)
    assert layout.full_length_bytes_per_token(torch.float32) * 400 == per_layer * 1200
