"""Structured outputs on the device: each step's token bitmask filled from the sequences' grammar
matchers (and their drafts), and the logits masked by it. The matchers themselves, and compiling
their grammars, are the engine core's (``engine/core/structured_outputs.py``)."""

from __future__ import annotations

import functools
import re
import time
from typing import Any

import torch


def grammar_error_reason(exc: Exception) -> str:
    """xgrammar's message without its C++ location and assertion text."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    line = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", line)
    return re.sub(r"^Check failed: \(.*?\) is false:\s*", "", line)


# What starting xgrammar's thread pool costs the host (H200 host, 8 threads: about 250 us for any
# batch; benchmarks/suite/structured_outputs_bench.py measures it).
POOL_START_S = 250e-6


@functools.cache
def _thread_pool() -> Any:
    import xgrammar

    return xgrammar.BatchGrammarMatcher()


def fill_masks(bitmask: torch.Tensor, rows: list[tuple[int, Any]]) -> dict[int, Exception]:
    """Fill each ``(row, matcher)``'s bitmask row. One row costs from microseconds to a millisecond
    (the grammar's state and the vocabulary's size decide), so rows are filled in turn for as long
    as that has cost less than starting the thread pool, and the rest by the pool: never more than
    twice the better of the two, without knowing the costs beforehand. Returns the matchers that
    raised, by their place in ``rows``, with the error (their rows hold anything): if the pool
    raises, the rest are filled in turn to tell which."""
    failed: dict[int, Exception] = {}
    started = time.perf_counter()
    pooled = False
    for i, (row, matcher) in enumerate(rows):
        if not pooled and len(rows) - i > 1 and time.perf_counter() - started > POOL_START_S:
            pooled = True
            rest = rows[i:]
            try:
                _thread_pool().batch_fill_next_token_bitmask([m for _, m in rest], bitmask, [r for r, _ in rest])
                return failed
            except Exception:
                pass
        try:
            matcher.fill_next_token_bitmask(bitmask, row)
        except Exception as exc:
            failed[i] = exc
    return failed


class HostBitmask:
    """The grammars' bitmask on the host, pinned and reused from step to step: pinning memory each
    step cost 0.45 ms on the H200's host. Fills write whole rows and the rows no grammar fills are
    set to allow every token, so nothing is cleared; before refilling, it waits for the last copy
    out of it (long done by then: the engine reads a step's tokens, after that copy, before it
    samples again)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def rows(self, count: int, vocab_size: int, pinned: bool) -> torch.Tensor:
        import xgrammar

        shape = xgrammar.get_bitmask_shape(count, vocab_size)
        if self._buffer is None or self._buffer.shape[0] < count or self._buffer.shape[1] != shape[1]:
            self._buffer = torch.empty(shape, dtype=xgrammar.bitmask_dtype, pin_memory=pinned)
        elif self._copied is not None:
            self._copied.synchronize()
        return self._buffer[:count]

    def to(self, bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
        on_device = bitmask.to(device, non_blocking=True)
        if device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return on_device


def apply_grammars(
    logits: torch.Tensor, constrained: list[tuple[int, Any, list[int]]], host: HostBitmask
) -> dict[int, str]:
    """Set to -inf, in place, every token that a grammar forbids next (xgrammar's packed bitmask, one
    row of bits per row of logits). Each ``(row, matcher, drafts)`` masks ``row`` and, with drafts
    (speculative decoding), the rows after them (``mask_drafts``).

    A matcher that raises (filling a mask, taking or rolling back a draft) fails its own sequence
    alone: returns those, by their place in ``constrained``, with the reason. Their rows allow
    every token, and their samples must not be used."""
    bitmask = host.rows(logits.shape[0], logits.shape[-1], pinned=logits.is_cuda)
    errors = fill_masks(bitmask, [(row, matcher) for row, matcher, _ in constrained])
    masked = []
    for i, (row, matcher, drafts) in enumerate(constrained):
        if i in errors:
            continue
        if drafts:
            try:
                masked += mask_drafts(bitmask, row, matcher, drafts)
            except Exception as exc:
                errors[i] = exc
                continue
        masked.append(row)
    if len(masked) < len(bitmask):  # (one index op: a tensor's item assignments cost microseconds each)
        bitmask[sorted(set(range(len(bitmask))) - set(masked))] = -1  # every token allowed
    mask_logits(logits, host.to(bitmask, logits.device))
    return {i: f"{type(exc).__name__}: {grammar_error_reason(exc)}" for i, exc in errors.items()}


def mask_drafts(bitmask: torch.Tensor, row: int, matcher: Any, drafts: list[int]) -> list[int]:
    """Fill the row after each draft as the grammar stands once the drafts up to it are taken, and
    return those rows; the matcher is rolled back to where it was. It stops at a draft the grammar
    refuses (the sample before it cannot be that draft, so the rows after it are never kept), and
    after a stop token: the matcher has terminated, and the sequence ends there, or, ignoring eos,
    goes on unconstrained, as it would without drafts."""
    filled, taken = [], 0
    try:
        for token in drafts:
            if not matcher.accept_token(token):
                break
            taken += 1
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, row + taken)
            filled.append(row + taken)
    finally:
        if taken:
            matcher.rollback(taken)
    return filled


@functools.cache
def _bit_shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """``logits[i, t] = -inf`` where bit ``t % 32`` of ``bitmask[i, t // 32]`` is 0, in plain torch:
    xgrammar's Triton kernel compiles again for each new batch-size class, on the request path."""
    bits = (bitmask.unsqueeze(-1) >> _bit_shifts(bitmask.device)) & 1
    logits.masked_fill_(bits.view(bitmask.shape[0], -1)[:, : logits.shape[-1]] == 0, float("-inf"))
