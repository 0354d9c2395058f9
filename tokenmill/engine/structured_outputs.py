"""Constrained decoding with xgrammar: constraints compiled off the step loop, one matcher per
sequence, and each step's token bitmask.

A request's constraint (``SamplingParams.structured_outputs``) compiles on a worker thread, cached
by the constraint, while the request waits outside the scheduler; an invalid one fails the request
with xgrammar's words. Each sequence then holds a ``GrammarMatcher``: before a step samples it, its
row of the bitmask allows only the tokens that keep the output valid (and each draft's row, as
the grammar stands after the drafts before it), and every token it accepts advances it. Once the
output is complete only the stop tokens remain allowed.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tokenmill.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

GRAMMAR_TIMEOUT_S = 30.0  # a constraint still compiling after this fails its request (the compile goes on)


def check_constraint(spec: StructuredOutputsParams) -> None:
    """Parse the constraint (no tokenizer needed), so a malformed schema, regex or grammar is a
    ValueError naming it before the request is sent, not a failure inside the engine."""
    import xgrammar

    try:
        if spec.json is not None:
            xgrammar.Grammar.from_json_schema(spec.json if isinstance(spec.json, str) else json.dumps(spec.json))
        elif spec.regex is not None:
            xgrammar.Grammar.from_regex(spec.regex)
        elif spec.grammar is not None:
            xgrammar.Grammar.from_ebnf(spec.grammar)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises several kinds; all mean a bad constraint
        kind = "json" if spec.json is not None else "regex" if spec.regex is not None else "grammar"
        raise ValueError(f"structured_outputs.{kind} is not valid: {grammar_error_reason(exc)}") from None


def grammar_error_reason(exc: Exception) -> str:
    """xgrammar's message without its C++ location and assertion text."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    line = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", line)
    return re.sub(r"^Check failed: \(.*?\) is false:\s*", "", line)


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary on a worker thread, each distinct one once."""

    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiler: Any = None
        self._cache: dict[str, Future] = {}

    def submit(self, spec: StructuredOutputsParams) -> Future:
        key = spec.key()
        future = self._cache.get(key)
        if future is None:
            future = self._cache[key] = self._executor.submit(self._compile, spec)
        return future

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        # JSON comes out compact (one space after ':' and ','): free whitespace lets a model pad forever.
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            return compiler.compile_json_schema(schema, any_whitespace=False)
        if spec.json_object:  # any JSON object, as OpenAI's json_object means
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:  # each choice a quoted EBNF literal (JSON's escapes)
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        return compiler.compile_grammar(spec.grammar)

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar

            from tokenmill.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(self.model_dir)
            if tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer, and this model ships none")
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler

    def matcher(self, compiled: Any) -> Any:
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


# What starting xgrammar's thread pool costs the host (H200 host, 8 threads: about 250 us for any
# batch; benchmarks/structured_outputs_bench.py measures it).
POOL_START_S = 250e-6


@functools.cache
def _thread_pool() -> Any:
    import xgrammar

    return xgrammar.BatchGrammarMatcher()


def fill_masks(bitmask: torch.Tensor, rows: list[tuple[int, Any]]) -> None:
    """Fill each ``(row, matcher)``'s bitmask row. One row costs from microseconds to a millisecond
    (the grammar's state and the vocabulary's size decide), so rows are filled in turn for as long
    as that has cost less than starting the thread pool, and the rest by the pool: never more than
    twice the better of the two, without knowing the costs beforehand."""
    started = time.perf_counter()
    for i, (row, matcher) in enumerate(rows):
        if len(rows) - i > 1 and time.perf_counter() - started > POOL_START_S:
            rest = rows[i:]
            _thread_pool().batch_fill_next_token_bitmask([m for _, m in rest], bitmask, [r for r, _ in rest])
            return
        matcher.fill_next_token_bitmask(bitmask, row)


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


def apply_grammars(logits: torch.Tensor, constrained: list[tuple[int, Any, list[int]]], host: HostBitmask) -> None:
    """Set to -inf, in place, every token that a grammar forbids next (xgrammar's packed bitmask, one
    row of bits per row of logits). Each ``(row, matcher, drafts)`` masks ``row``, then, with drafts
    (speculative decoding), the row after each draft as the matcher stands once that draft is taken:
    drafts are taken in turn and rolled back after. Rows after a draft the grammar refuses are left
    as they are: the sample before them cannot be that draft, so they are never kept."""
    bitmask = host.rows(logits.shape[0], logits.shape[-1], pinned=logits.is_cuda)
    fill_masks(bitmask, [(row, matcher) for row, matcher, _ in constrained])
    masked = [row for row, _, _ in constrained]
    for row, matcher, drafts in constrained:
        taken = 0
        for token in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            taken += 1
            matcher.fill_next_token_bitmask(bitmask, row + taken)
            masked.append(row + taken)
        if taken:
            matcher.rollback(taken)
    if len(masked) < len(bitmask):  # (one index op: a tensor's item assignments cost microseconds each)
        bitmask[sorted(set(range(len(bitmask))) - set(masked))] = -1  # every token allowed
    mask_logits(logits, host.to(bitmask, logits.device))


@functools.cache
def _bit_shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """``logits[i, t] = -inf`` where bit ``t % 32`` of ``bitmask[i, t // 32]`` is 0, in plain torch:
    xgrammar's Triton kernel compiles again for each new batch-size class, on the request path."""
    bits = (bitmask.unsqueeze(-1) >> _bit_shifts(bitmask.device)) & 1
    logits.masked_fill_(bits.view(bitmask.shape[0], -1)[:, :logits.shape[-1]] == 0, float("-inf"))
