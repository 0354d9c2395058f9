"""Who runs this step and how many tokens each: continuous batching with
chunked prefill and preemption by recompute.

Every step the running sequences are served first, in the order they were
admitted (a decode takes one token; an unfinished prefill takes what is left
of the token budget); then waiting sequences are admitted while
``max_num_seqs``, the token budget and free blocks allow. When blocks run out
the most recently admitted running sequence is preempted: its blocks go back
(full ones stay in the prefix cache) and it waits at the head of the queue to
recompute its prompt and output so far.

A decoding sequence may carry drafts (speculative decoding): it then takes its
known token and as many of its drafts as the budget leaves room for.

Under the ``priority`` policy (vLLM's) both queues are kept in (priority, arrival)
order, lower first: admission follows it, the running are served in it, and the
victim of a preemption is the last in it, which then waits at its place in the
queue. Keeping ``running`` sorted makes the victim the last running sequence, as
under ``fcfs``, so a victim is never one already scheduled in this step.
"""

from __future__ import annotations

import bisect
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
    policy: str = "fcfs"  # "fcfs" | "priority"

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.policy!r}")
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
        self._by_priority = config.policy == "priority"
        # Under "priority": each queued or running sequence's place, (priority, arrival, seq_id);
        # the seq id breaks ties between requests that arrived at once, and between n choices.
        self._order: dict[Sequence, tuple[int, float, int]] = {}
        # Sequences running and waiting by request, and the requests with some waiting and none
        # running: kept as sequences move, so the engine's gauges cost nothing per step however
        # long the queue (counting it each step cost ~0.2 us a waiting request).
        self._running_by_request: dict[str, int] = {}
        self._waiting_by_request: dict[str, int] = {}
        self._num_waiting_only = 0

    @property
    def num_running_requests(self) -> int:
        """Requests with a sequence running."""
        return len(self._running_by_request)

    @property
    def num_waiting_requests(self) -> int:
        """Requests with a sequence waiting and none running."""
        return self._num_waiting_only

    def _count(self, seq: Sequence, running: int, waiting: int) -> None:
        """``seq``'s request has ``running`` more sequences running and ``waiting`` more waiting."""
        rid, by_running, by_waiting = seq.request_id, self._running_by_request, self._waiting_by_request
        before = rid in by_waiting and rid not in by_running
        for counts, change in ((by_running, running), (by_waiting, waiting)):
            if change:
                left = counts.get(rid, 0) + change
                if left:
                    counts[rid] = left
                else:
                    del counts[rid]
        self._num_waiting_only += (rid in by_waiting and rid not in by_running) - before

    def add(self, seq: Sequence, priority: int = 0) -> None:
        """Queue a new sequence; ``priority`` (lower first) counts only under the priority policy."""
        if self._by_priority:
            self._order[seq] = (priority, seq.arrival_time, seq.seq_id)
            self._insert(self.waiting, seq)
        else:
            self.waiting.append(seq)
        self._count(seq, 0, 1)

    def _insert(self, queue: deque[Sequence] | list[Sequence], seq: Sequence) -> None:
        """Put ``seq`` at its place in a queue kept in priority order."""
        bisect.insort(queue, seq, key=self._order.__getitem__)

    def _preempt(self, seq: Sequence) -> None:
        """Send a running sequence just taken off ``running`` back to the queue."""
        self._count(seq, -1, 1)
        self.kv.free(seq)
        seq.draft_token_ids.clear()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self._by_priority:
            self._insert(self.waiting, seq)
        else:
            self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        wave_start = not self.running
        budget = self.config.max_num_batched_tokens
        i = 0
        running, allocate, seqs, num_tokens = self.running, self.kv.allocate, batch.seqs, batch.num_tokens
        while i < len(running) and budget > 0:  # (every step, every running sequence: kept lean)
            seq = running[i]
            drafts = seq.draft_token_ids
            if drafts:  # drafts take what is left of the budget after the known token
                del drafts[max(0, budget - (len(seq.token_ids) - seq.num_computed_tokens)):]
            num_new = len(seq.token_ids) + len(drafts) - seq.num_computed_tokens
            if num_new > budget:
                num_new = budget
            while not allocate(seq, num_new):
                victim = running.pop()
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            else:
                seqs.append(seq)
                num_tokens.append(num_new)
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
            self._count(seq, 1, -1)
            self.kv.record_lookup(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            if self._by_priority:
                self._insert(self.running, seq)
            else:
                self.running.append(seq)
            if num_new > 0:
                batch.seqs.append(seq)
                batch.num_tokens.append(num_new)
                budget -= num_new

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._count(seq, -1, 0)
        elif seq.status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass  # never queued: its constraint was still compiling
            else:
                self._count(seq, 0, -1)
        self.kv.free(seq)
        seq.draft_token_ids.clear()
        self._order.pop(seq, None)
        seq.status = SequenceStatus.FINISHED
