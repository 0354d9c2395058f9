"""SequenceRows: the step inputs the model runner keeps per sequence (tables are covered by the KV
manager's property test in test_block_pool_properties.py; here the sampling columns and the rows'
life: taken, written again, reclaimed, grown)."""

from __future__ import annotations

import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.sequence import Sequence, SequenceStatus
from tokenmill.engine.worker.sequence_rows import (
    GRAMMAR, LOGIT_BIAS, LOGPROBS, MIN_TOKENS, PENALTIES, PROMPT_LOGPROBS, SEEDED, SequenceRows)
from tokenmill.layers.sampler import inverse_temperature
from tokenmill.sampling_params import SamplingParams

VOCAB = 1000

params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1e-7, 0.5, 1.0, 2.0]),
    top_k=st.sampled_from([-1, 0, 1, 50, VOCAB, 5 * VOCAB]),
    top_p=st.sampled_from([0.1, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.2]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    presence_penalty=st.sampled_from([0.0, -1.5]),
    frequency_penalty=st.sampled_from([0.0, 0.7]),
    prompt_logprobs=st.sampled_from([None, 0, 2]),
    logprobs=st.sampled_from([None, 0, 3]),
    min_tokens=st.sampled_from([0, 4]),
    logit_bias=st.sampled_from([None, {}, {5: 1.5}]),
)


def make_seq(i: int, params: SamplingParams, blocks: int = 1) -> Sequence:
    seq = Sequence(i, str(i), 0, [1, 2, 3], params, time.time())
    seq.status = SequenceStatus.RUNNING
    seq.block_tables = [list(range(10 * i, 10 * i + blocks))]
    return seq


@settings(max_examples=60, deadline=None)
@given(st.lists(params_strategy, min_size=1, max_size=9), st.data())
def test_sampling_columns_are_each_rows_parameters(params: list[SamplingParams], data: st.DataObject) -> None:
    """Every column of every sampled row is its sequence's value (top-k 0 off, clamped to the
    vocabulary), rows repeated for a sequence's drafts, in the dtypes the sampler takes."""
    rows = SequenceRows(num_groups=1, vocab_size=VOCAB, capacity=2)
    seqs = [make_seq(i, p) for i, p in enumerate(params)]
    index = rows.rows_of(seqs)
    repeats = data.draw(st.lists(st.integers(1, 3), min_size=len(seqs), max_size=len(seqs)))
    columns = rows.sampling_columns(np.repeat(index, repeats))
    expanded = [p for p, n in zip(params, repeats) for _ in range(n)]
    temperature = np.array([p.temperature for p in expanded], dtype=np.float32)
    assert columns["temperature"].dtype == np.float32 and columns["top_k"].dtype == np.int64
    np.testing.assert_array_equal(columns["temperature"], temperature)
    # float32's own 1 / max(t, 1e-6) where t > 0 (the host computes it in float64, then rounds)
    floor = np.float32(1e-6)
    want = np.where(temperature > 0, np.float32(1) / np.maximum(temperature, floor), np.float32(0)).astype(np.float32)
    np.testing.assert_array_equal(columns["inv_temperature"], want)
    assert all(inverse_temperature(t) == w for t, w in zip(temperature.tolist(), want.tolist()))
    np.testing.assert_array_equal(columns["top_k"], [min(max(p.top_k, 0), VOCAB) for p in expanded])
    for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        np.testing.assert_array_equal(columns[name], np.array([getattr(p, name) for p in expanded], np.float32))
    # Each row's flags say what its sampling needs besides the columns (a step none of whose rows sets
    # one builds no per-sequence lists).
    wanted = {PROMPT_LOGPROBS: [p.prompt_logprobs is not None for p in params],
              LOGPROBS: [p.logprobs is not None for p in params], MIN_TOKENS: [p.min_tokens > 0 for p in params],
              LOGIT_BIAS: [bool(p.logit_bias) for p in params], PENALTIES: [p.uses_penalties for p in params],
              SEEDED: [False] * len(params), GRAMMAR: [False] * len(params)}
    for flag, expected in wanted.items():
        np.testing.assert_array_equal(rows.flags[index] & flag > 0, expected)
    union = 0
    for flag, expected in wanted.items():
        union |= flag if any(expected) else 0
    assert rows.union_flags(index) == union


def test_rows_are_reclaimed_from_sequences_that_stopped_running_then_grown() -> None:
    rows = SequenceRows(num_groups=2, vocab_size=VOCAB, capacity=2)
    first = [make_seq(i, SamplingParams(temperature=1.0 + i), blocks=2) for i in range(2)]
    for seq in first:
        seq.block_tables.append([7, 8])
    assert sorted(rows.rows_of(first).tolist()) == [0, 1]
    first[0].status = SequenceStatus.FINISHED
    newcomer = make_seq(5, SamplingParams(temperature=0.0), blocks=3)
    newcomer.block_tables.append([4, 5, 6])
    index = rows.rows_of([first[1], newcomer])
    assert index[1] == first[0].row  # the finished sequence's row, written for the newcomer
    tables = rows.block_tables(index)
    assert tables[:, 1].tolist() == [[50, 51, 52], [4, 5, 6]]
    assert tables[:, 0].tolist() == [[10, 11, 0], [7, 8, 0]]
    # No row free and none reclaimable: the arrays double, the rows kept.
    third = make_seq(6, SamplingParams(temperature=0.5))
    third.block_tables.append([9])
    index = rows.rows_of([first[1], newcomer, third])
    assert len(rows.owners) == 4 and len(set(index.tolist())) == 3
    assert rows.sampling_columns(index)["temperature"].tolist() == [2.0, 0.0, 0.5]
    # The KV manager changed a table: written again, zero past its new end.
    newcomer.block_tables = [[50], [4]]
    newcomer.tables_changed()
    assert rows.block_tables(rows.rows_of([newcomer])).tolist() == [[[50]], [[4]]]
    assert rows.tables[:, newcomer.row, :3].tolist() == [[50, 0, 0], [4, 0, 0]]
