"""The token counts that repetition, presence and frequency penalties read, kept on the device.

Rebuilding each penalised row's counts every step copied all its prompt and output tokens to the
device (hundreds of thousands of ids a step at batch 256) and made the step wait for the previous
step's tokens on the host. Here each running sequence that uses penalties owns a row of a table:
filled once from its prompt and output when it first samples, then each step's sampled ids are
added in place, in stream order after the sampling that drew them, so a step's penalties see every
token before it without any host copy of one.
"""

from __future__ import annotations

import torch

from tokenmill.engine.sequence import Sequence, SequenceStatus
from tokenmill.engine.worker.host_staging import to_device

_ZEROS, _DISCARD = 0, 1  # the row read for rows without penalties, and the row their samples go to


class PenaltyCounts:
    def __init__(self, vocab_size: int, device: torch.device, max_seqs: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.max_rows = 2 + max_seqs  # only running sequences hold a row
        self.slots: dict[Sequence, int] = {}
        self.counts = torch.zeros((0, vocab_size), dtype=torch.float32, device=device)
        self.prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)

    def rows(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """For each sampling row's sequence: the row to read its counts from and the row to add its
        sample to (the shared zero and discard rows for a sequence without penalties). Sequences
        sampling for the first time get a row; rows of sequences no longer running are reused."""
        current = set(seqs)
        for seq in [s for s in self.slots if s.status is not SequenceStatus.RUNNING and s not in current]:
            del self.slots[seq]
        new = list(dict.fromkeys(s for s in seqs if s.params.uses_penalties and s not in self.slots))
        if new or not len(self.counts):
            self._admit(new)
        read = [self.slots.get(s, _ZEROS) for s in seqs]
        add = [self.slots.get(s, _DISCARD) for s in seqs]
        both = to_device([read, add], torch.int64, self.device)
        return both[0], both[1]

    def add(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count each row's sampled token (enqueued after the sampling, before the next step's)."""
        # One scatter of atomic adds: an accumulating ``index_put_`` sorts its indices first (five
        # kernels, ~20 us a step at batch 1 on the H200).
        flat = rows * self.vocab_size + token_ids
        self.counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))

    def _admit(self, seqs: list[Sequence]) -> None:
        short = 2 + len(self.slots) + len(seqs) - len(self.counts)  # (the first call makes the shared rows)
        if short > 0:
            self._grow(short)
        free = sorted(set(range(2, len(self.counts))) - set(self.slots.values()))
        for seq, slot in zip(seqs, free):
            self.slots[seq] = slot
            self.counts[slot].zero_()
            self.prompt[slot].zero_()
            # ``index_fill_`` takes the value as a kernel argument; an item assignment (``t[ids] = True``)
            # copies it to the device synchronously, and the host waits for every queued kernel.
            self.prompt[slot].index_fill_(0, to_device(seq.prompt_token_ids, torch.int64, self.device), True)
            # (A sequence first samples, or samples again after preemption, with no token pending.)
            outputs = seq.output_token_ids
            if outputs:
                ids = to_device(outputs, torch.int64, self.device)
                self.counts[slot].scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))

    def _grow(self, at_least: int) -> None:
        rows = max(min(2 * len(self.counts), self.max_rows), len(self.counts) + at_least)
        counts = torch.zeros((rows, self.vocab_size), dtype=torch.float32, device=self.device)
        prompt = torch.zeros((rows, self.vocab_size), dtype=torch.bool, device=self.device)
        counts[: len(self.counts)] = self.counts
        prompt[: len(self.prompt)] = self.prompt
        self.counts, self.prompt = counts, prompt
