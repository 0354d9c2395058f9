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

On the CPU a step's time grows with its tokens (a forward there is bound by its
FLOPs, which the token budget does not bound in time), so a scheduler given a
``StepCost`` lets prompt chunks beside decoding sequences take only the tokens
that keep a step near ``CPU_STEP_TARGET_S``; with nothing decoding a prompt still
takes the whole budget. The GPU scheduler has none: its budget is tuned there.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from dataclasses import dataclass

from tokenmill.engine.core.kv_cache_manager import KVCacheManager
from tokenmill.engine.sequence import Sequence, SequenceStatus
from tokenmill.engine.step import ScheduledStep

# How long a CPU step carrying prompt chunks beside decoding sequences should take. A CPU forward
# costs in proportion to its work: one 2,047-token chunk of a 0.5B model took 7-17 s on two cores,
# and every stream beside it stood still that long. A quarter second keeps those streams at four
# tokens a second or more (about reading speed, so a reader sees no stall), while a decode step of
# such a model (0.05-0.15 s there) still leaves a prompt half of each step or more.
CPU_STEP_TARGET_S = 0.25
# Prompt chunks beside decoding sequences are whole multiples of this many tokens (a KV block at the
# default block size), and never fewer: a chunk changes only when the estimate moves by a good
# share, not with every measurement's noise, and a prompt still advances when the decoding
# sequences alone take the whole target.
CHUNK_QUANTUM = 16
# The fit's terms (fixed, per token, per pair), scaled to like sizes; and the subsets of them it may
# keep (a token always costs something; a step's fixed cost and its pairs' may not show), those
# without the fixed term first: where steps cannot tell the terms apart (all of one size) the time
# goes on the work, which overstates a larger step's cost, so that chunks err small.
_SCALE = (1.0, 1e-3, 1e-6)
_TERMS = ((1, 2), (1,), (0, 1, 2), (0, 1))
# A step may carry at most this many times the tokens of the largest of the last ``_RECENT`` steps
# measured: the fit is trusted only near the sizes it has seen (from steps of tens of tokens, where
# the fixed cost dominates, the cost of a token is known too roughly to take hundreds on it), so
# chunks grow step by step, each size measured before the next.
_GROWTH = 2
_RECENT = 8


def _det(m: list[list[float]]) -> float:
    if len(m) == 1:
        return m[0][0]
    if len(m) == 2:
        return m[0][0] * m[1][1] - m[0][1] * m[1][0]
    (a, b, c), (d, e, f), (g, h, i) = m
    return a * (e * i - f * h) - b * (d * i - f * g) + c * (d * h - e * g)


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """``m x = v`` for up to three unknowns, by Cramer's rule (microseconds, where numpy's solvers
    take tens); None where ``m``, a Gram matrix, is singular to rounding (its terms collinear)."""
    det = _det(m)
    if det <= 1e-9 * math.prod(m[i][i] for i in range(len(m))):
        return None
    return [
        _det([[v[r] if c == j else m[r][c] for c in range(len(m))] for r in range(len(m))]) / det for j in range(len(m))
    ]


@dataclass(frozen=True)
class StepWork:
    """What a step computes, as far as its time on the CPU goes: its tokens (each projection's rows)
    and its query-key pairs (attention's scores: each sequence's new tokens times the keys they
    read, which grow as a long prompt's chunks go deeper: 256 tokens took 0.16 s at the start of a
    prompt and 0.68 s 1,536 tokens into it, with the embedded model on two cores)."""

    tokens: int
    pairs: int

    @classmethod
    def of(cls, seqs: list[Sequence], num_tokens: list[int]) -> StepWork:
        """The work of ``num_tokens`` new tokens of each of ``seqs``, before the step computes them."""
        pairs = sum(n * (seq.num_computed_tokens + n) for seq, n in zip(seqs, num_tokens))
        return cls(sum(num_tokens), pairs)


class StepCost:
    """What a CPU step costs: ``fixed + per_token * tokens + per_pair * pairs`` seconds (``StepWork``),
    fitted by least squares to the steps measured so far, each older step weighing ``DECAY`` as much
    as the one after it (so the fit follows the machine's load), every term kept >= 0; and from it
    how many prompt tokens a step beside decoding sequences may carry to take ``target_s``. The
    engine core feeds it each step's work and time (``observe``); a test feeds it steps of its own,
    so that the chunks come out the same every run."""

    DECAY = 0.8

    def __init__(self, target_s: float = CPU_STEP_TARGET_S) -> None:
        self.target_s = target_s
        # Decayed sums over the steps of x xᵀ, x t and t², x the step's scaled terms and t its time.
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xt = [0.0] * 3
        self._tt = 0.0
        self._recent: deque[int] = deque(maxlen=_RECENT)  # the last steps' tokens

    def observe(self, work: StepWork, seconds: float) -> None:
        """One step's work and its time."""
        d = self.DECAY
        x = (_SCALE[0], work.tokens * _SCALE[1], work.pairs * _SCALE[2])
        for i in range(3):
            for j in range(3):
                self._xx[i][j] = self._xx[i][j] * d + x[i] * x[j]
            self._xt[i] = self._xt[i] * d + x[i] * seconds
        self._tt = self._tt * d + seconds * seconds
        self._recent.append(work.tokens)

    def estimate(self) -> tuple[float, float, float] | None:
        """(fixed, per-token, per-pair) seconds; None before any step. The least-squares fit over the
        terms that come out >= 0: of the subsets of terms whose own fit has none < 0, the one that
        fits best (a later one in ``_TERMS`` only where it fits clearly better)."""
        if self._tt == 0.0:
            return None
        best, best_residual = None, math.inf
        for terms in _TERMS:
            xx = [[self._xx[i][j] for j in terms] for i in terms]
            xt = [self._xt[i] for i in terms]
            coef = _solve(xx, xt)
            if coef is None or min(coef) < 0:
                continue
            # Σ w (t - x·c)² = Σ w t² - 2 c·Σ w x t + cᵀ (Σ w x xᵀ) c
            residual = (
                self._tt
                - 2 * sum(c * v for c, v in zip(coef, xt))
                + sum(coef[a] * xx[a][b] * coef[b] for a in range(len(terms)) for b in range(len(terms)))
            )
            if residual < best_residual - 1e-9 * self._tt:
                best, best_residual = dict(zip(terms, coef)), residual
        if best is None:  # every step took no tokens: nothing to go on
            return None
        fixed, per_token, per_pair = (best.get(i, 0.0) * _SCALE[i] for i in range(3))
        return fixed, per_token, per_pair

    def prompt_tokens(self, decoding: StepWork, context: int, budget: int) -> int:
        """The prompt tokens a step may carry beside the ``decoding`` sequences' work, as a chunk of a
        prompt ``context`` tokens in, for the step to take about ``target_s``: a multiple of
        ``CHUNK_QUANTUM``, at least one quantum, at most ``budget`` and ``_GROWTH`` times the largest
        recent step (all of the budget before anything was measured)."""
        estimate = self.estimate()
        if estimate is None:
            return budget
        fixed, per_token, per_pair = estimate
        # fixed + per_token (T + q) + per_pair (P + q (context + q)) = target, for q >= 0
        left = self.target_s - fixed - per_token * decoding.tokens - per_pair * decoding.pairs
        linear = per_token + per_pair * context
        if left <= 0:
            tokens = 0
        elif per_pair > 0:
            tokens = int(2 * left / (linear + math.sqrt(linear * linear + 4 * per_pair * left)))
        elif linear > 0:
            tokens = int(left / linear)
        else:
            tokens = budget
        tokens = min(tokens, _GROWTH * max(self._recent) - decoding.tokens)
        return min(budget, max(CHUNK_QUANTUM, tokens // CHUNK_QUANTUM * CHUNK_QUANTUM))


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


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, step_cost: StepCost | None = None) -> None:
        """``step_cost`` (the CPU's): prompt chunks beside decoding sequences are sized from it."""
        self.config = config
        self.kv = kv
        self.step_cost = step_cost
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

    def schedule(self) -> ScheduledStep:
        batch = ScheduledStep()
        wave_start = not self.running
        budget = self.config.max_num_batched_tokens
        prompt_budget = budget if self.step_cost is None else self._prompt_budget(budget)
        limited = prompt_budget < budget
        i = 0
        running, allocate, seqs, num_tokens = self.running, self.kv.allocate, batch.seqs, batch.num_tokens
        while i < len(running) and budget > 0:  # (every step, every running sequence: kept lean)
            seq = running[i]
            drafts = seq.draft_token_ids
            if drafts:  # drafts take what is left of the budget after the known token
                del drafts[max(0, budget - (len(seq.token_ids) - seq.num_computed_tokens)) :]
            num_new = len(seq.token_ids) + len(drafts) - seq.num_computed_tokens
            if num_new > budget:
                num_new = budget
            if limited and num_new > 1 + len(drafts):  # a prompt's chunk, beside sequences that decode
                num_new = min(num_new, prompt_budget)
                if num_new == 0:
                    i += 1
                    continue
                prompt_budget -= num_new
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
            self._admit(batch, min(budget, prompt_budget))
        return batch

    def _prompt_budget(self, budget: int) -> int:
        """The prompt tokens this step may carry: ``budget`` unless running sequences decode beside a
        prompt to compute, and then what ``step_cost`` allows beside their work, as a chunk of the
        first running prompt (or of a new one)."""
        decoding, num_tokens, context = [], [], None
        for seq in self.running:
            known = len(seq.token_ids) - seq.num_computed_tokens
            if known <= 1:
                decoding.append(seq)
                num_tokens.append(known + len(seq.draft_token_ids))
            elif context is None:
                context = seq.num_computed_tokens
        admits = self.waiting and len(self.running) < self.config.max_num_seqs
        if not decoding or (context is None and not admits):
            return budget
        assert self.step_cost is not None  # ``schedule`` asks only when there is one
        return self.step_cost.prompt_tokens(StepWork.of(decoding, num_tokens), context or 0, budget)

    def _admit(self, batch: ScheduledStep, budget: int) -> None:
        """Admit waiting sequences with at most ``budget`` prompt tokens in all; in static mode this
        runs only when nothing is running, so a wave is admitted at once and runs to completion."""
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
