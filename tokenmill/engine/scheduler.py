"""Who runs this step and how many tokens each: continuous batching with
chunked prefill and preemption by recompute.

Every step the running sequences are served first, in the order they were
admitted (a decode takes one token; an unfinished prefill takes what is left
of the token budget); then waiting sequences are admitted while
``max_num_seqs``, the token budget and free blocks allow. When blocks run out
the most recently admitted running sequence is preempted: its blocks go back
(full ones stay in the prefix cache) and it waits at the head of the queue to
recompute its prompt and output so far.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    static_batching: bool = False  # waves: admit only when nothing is running

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass
class ScheduledBatch:
    """This step's sequences and how many tokens of each to compute."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        wave_start = not self.running
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_tokens.append(num_new)
                budget -= num_new
                i += 1
        if batch.num_preempted == 0 and (wave_start or not self.config.static_batching):
            self._admit(batch, budget)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        """Admit waiting sequences; in static mode this runs only when nothing is running,
        so a wave is admitted at once and runs to completion."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            if budget <= 0 and not self.config.static_batching:
                break
            seq = self.waiting[0]
            cached = self.kv.match_prefix(seq)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.allocate(seq, num_new):
                self.kv.free(seq)  # a waiting sequence holds no blocks
                break
            self.waiting.popleft()
            self.kv.record_lookup(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            if num_new > 0:
                batch.seqs.append(seq)
                batch.num_tokens.append(num_new)
                budget -= num_new

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
