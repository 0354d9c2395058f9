"""Per-sequence step inputs kept in host arrays between steps.

Building a step's block tables and sampling columns from every sequence's Python objects cost
microseconds a sequence a step (at batch 256, a fifth of the host's step). Here each running
sequence owns a row of a few arrays: its sampling parameters, written once, and its block tables,
written again only after the KV manager changes them (``Sequence.tables_changed``). A step then
takes its sequences' rows with one index array.

Rows are not released when a sequence ends: a sequence whose row is not its own any more (or that
never had one) takes a free row, and when none is free, the rows of sequences no longer running
are reclaimed (the arrays grow when that frees none).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from tokenmill.engine.sequence import Sequence, SequenceStatus
from tokenmill.layers.sampler import inverse_temperature
from tokenmill.sampling_params import SamplingParams

# A row's float32 sampling parameters, in their order as the rows of one array (the inverse
# temperature the sampler takes is computed once, when the sequence takes its row); its top-k is kept
# apart as int64 (0 is off; larger than the vocabulary means all of it).
FLOAT_COLUMNS = (
    "temperature",
    "inv_temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


# What a row needs besides its numeric sampling columns, one bit each: a step whose rows set none
# of them samples without looking at its sequences one by one.
PROMPT_LOGPROBS, LOGPROBS, MIN_TOKENS, LOGIT_BIAS, SEEDED, PENALTIES, GRAMMAR = (1 << i for i in range(7))


def row_flags(seq: Sequence) -> int:
    """``seq``'s bits of the flags above (a grammar is attached before a sequence is first scheduled)."""
    params = seq.params
    return (
        (PROMPT_LOGPROBS if params.prompt_logprobs is not None else 0)
        | (LOGPROBS if params.logprobs is not None else 0)
        | (MIN_TOKENS if params.min_tokens else 0)
        | (LOGIT_BIAS if params.logit_bias else 0)
        | (SEEDED if seq.generator is not None else 0)
        | (PENALTIES if params.uses_penalties else 0)
        | (GRAMMAR if seq.matcher is not None else 0)
    )


def float_row(params: SamplingParams) -> tuple[float, ...]:
    """``params``' values in ``FLOAT_COLUMNS``' order."""
    return (
        params.temperature,
        inverse_temperature(params.temperature),
        params.top_p,
        params.min_p,
        params.repetition_penalty,
        params.presence_penalty,
        params.frequency_penalty,
    )


def clamped_top_k(params: SamplingParams, vocab_size: int) -> int:
    """``params.top_k`` with -1 (off) as 0 and at most the vocabulary."""
    return min(max(params.top_k, 0), vocab_size)


@dataclass
class SamplingColumns:
    """The sampling parameters of a step's sampled rows: the float32 ones as the rows of one array, so
    that they cross to the device in one piece, and top-k. ``columns[name]`` is one parameter's."""

    floats: np.ndarray  # [len(FLOAT_COLUMNS), rows] float32
    top_k: np.ndarray  # [rows] int64

    def __getitem__(self, name: str) -> np.ndarray:
        return self.top_k if name == "top_k" else self.floats[FLOAT_COLUMNS.index(name)]


class SequenceRows:
    def __init__(self, num_groups: int, vocab_size: int, capacity: int = 64) -> None:
        self.vocab_size = vocab_size
        self.owners: list[Sequence | None] = [None] * capacity
        self.free = list(range(capacity))
        self.floats = np.zeros((len(FLOAT_COLUMNS), capacity), dtype=np.float32)
        self.top_k = np.zeros(capacity, dtype=np.int64)
        self.flags = np.zeros(capacity, dtype=np.uint8)
        self.tables = np.zeros((num_groups, capacity, 1), dtype=np.int32)
        self.table_lens = np.zeros(capacity, dtype=np.int64)

    def rows_of(self, seqs: list[Sequence]) -> np.ndarray:
        """Each sequence's row, brought up to date; a sequence without one takes one."""
        owners = self.owners
        for seq in seqs:
            row = seq.row
            if row is None or owners[row] is not seq:
                self._take(seq)
            elif seq.tables_stale:
                self._write_tables(seq, row)
        return np.fromiter(map(attrgetter("row"), seqs), dtype=np.int64, count=len(seqs))

    def block_tables(self, rows: np.ndarray) -> np.ndarray:
        """``[groups, len(rows), longest table]`` int32, zero past each sequence's table."""
        return self.tables[:, rows, : max(1, int(self.table_lens[rows].max(initial=0)))]

    def sampling_columns(self, rows: np.ndarray) -> SamplingColumns:
        """The sampling parameters of ``rows`` (a sequence's row once for each of its sampled rows)."""
        return SamplingColumns(self.floats[:, rows], self.top_k[rows])

    def union_flags(self, rows: np.ndarray) -> int:
        """Every flag any of ``rows`` sets."""
        return int(np.bitwise_or.reduce(self.flags[rows])) if len(rows) else 0

    def _take(self, seq: Sequence) -> None:
        if not self.free:
            self._reclaim()
        row = seq.row = self.free.pop()
        self.owners[row] = seq
        self.floats[:, row] = float_row(seq.params)
        self.top_k[row] = clamped_top_k(seq.params, self.vocab_size)
        self.flags[row] = row_flags(seq)
        self._write_tables(seq, row)

    def _write_tables(self, seq: Sequence, row: int) -> None:
        length = len(seq.block_tables[0]) if seq.block_tables else 0
        if length > self.tables.shape[2]:
            grown = np.zeros((*self.tables.shape[:2], max(length, 2 * self.tables.shape[2])), dtype=np.int32)
            grown[:, :, : self.tables.shape[2]] = self.tables
            self.tables = grown
        if length:
            self.tables[:, row, :length] = seq.block_tables
        self.tables[:, row, length : self.table_lens[row]] = 0
        self.table_lens[row] = length
        seq.tables_stale = False

    def _reclaim(self) -> None:
        """Free the rows of sequences that no longer run; double the arrays if that frees none."""
        self.free = [
            row for row, seq in enumerate(self.owners) if seq is None or seq.status is not SequenceStatus.RUNNING
        ]
        for row in self.free:
            self.owners[row] = None
        if self.free:
            return
        old = len(self.owners)
        self.owners += [None] * old
        self.free = list(range(old, 2 * old))
        self.floats = np.concatenate([self.floats, np.zeros_like(self.floats)], axis=1)
        self.top_k = np.concatenate([self.top_k, np.zeros_like(self.top_k)])
        self.flags = np.concatenate([self.flags, np.zeros_like(self.flags)])
        self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)], axis=1)
        self.table_lens = np.concatenate([self.table_lens, np.zeros_like(self.table_lens)])
