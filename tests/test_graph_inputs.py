"""The CUDA graphs' input staging (the graphs themselves run on the GPU only, tests/test_gpu_engine.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tokenmill.engine.cuda_graphs import stage_step_inputs
from tokenmill.layers.attention import AttentionMetadata


def test_a_steps_inputs_fill_the_static_buffers_and_padding_writes_nowhere() -> None:
    groups, capacity, max_blocks = 2, 8, 6
    static = SimpleNamespace(input_ids=torch.full((capacity,), 7), positions=torch.full((capacity,), 7),
                             slot_mapping=torch.full((groups, capacity), 5),
                             block_tables=torch.full((groups, capacity, max_blocks), 9, dtype=torch.int32))
    ids, positions = torch.tensor([11, 12, 13]), torch.tensor([40, 41, 42])
    slots = (torch.tensor([100, 101, 102]), torch.tensor([200, 201, 202]))
    tables = (torch.tensor([[1, 2, 3]] * 3, dtype=torch.int32), torch.tensor([[4, 5, 6]] * 3, dtype=torch.int32))
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(4, dtype=torch.int32),
                             seq_lens=torch.tensor([41, 42, 43], dtype=torch.int32), block_tables=tables,
                             max_query_len=1)
    stage_step_inputs(static, ids, positions, meta, padded=5)
    assert static.input_ids[:3].tolist() == [11, 12, 13] and static.positions[:3].tolist() == [40, 41, 42]
    for g in range(groups):
        assert static.slot_mapping[g].tolist() == slots[g].tolist() + [-1, -1, 5, 5, 5]
        assert torch.equal(static.block_tables[g, :3, :3], tables[g])
        assert (static.block_tables[g, 3:] == 9).all() and (static.block_tables[g, :, 3:] == 9).all()
