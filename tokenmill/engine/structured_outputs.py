"""Constrained decoding with xgrammar: constraints compiled off the step loop, one matcher per
sequence, and each step's token bitmask.

A request's constraint (``SamplingParams.structured_outputs``) compiles on a small pool of worker
threads, each distinct constraint once, while the request waits outside the scheduler; an invalid
one fails the request with xgrammar's words, and one that waits too long for a worker or compiles
too long fails it as the server's failure (a retry may succeed). Compiled grammars are kept in a
cache bounded by bytes. Each sequence then holds a ``GrammarMatcher``: before a step samples it,
its row of the bitmask allows only the tokens that keep the output valid (and each draft's row, as
the grammar stands after the drafts before it), and every token it accepts advances it. Once the
output is complete only the stop tokens remain allowed. A matcher that raises fails its own
sequence's request, never the step.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tokenmill.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Defaults of the engine's options. Compile time grows faster than a constraint's size (a 2-core host,
# xgrammar 0.2.9: JSON schemas of 20, 50, 100 and 200 KiB took 0.1, 0.7, 5.5 and 25 s; the forced-call
# grammar of 32 distinct tools, 77 KiB, 0.1 s, of 128 tools, 313 KiB, 0.6 s): 128 KiB keeps a schema's
# compile to seconds and lets through tool sets of about fifty tools. A compiled 200-property schema
# takes 1-2 MB as xgrammar counts (an 8k vocabulary; more for larger ones), the process about 1.3
# times that: 300 distinct ones grew it by 395 MiB with no limit, by 342 MiB under a 256 MiB one.
# Four workers: three slow compiles still leave one to the quick ones (each compile also runs up to
# eight threads of xgrammar's own).
DEFAULT_COMPILE_WORKERS = 4
DEFAULT_CACHE_BYTES = 256 << 20
DEFAULT_MAX_CONSTRAINT_BYTES = 128 << 10
# A request whose constraint has been compiling this long (since its compile started, or since the
# request came if it came later) stops waiting and fails; the compile goes on for the others.
GRAMMAR_TIMEOUT_S = 30.0
# A request whose constraint has not started compiling after this long (every worker busy with
# others) stops waiting and fails.
GRAMMAR_QUEUE_TIMEOUT_S = 30.0


def constraint_bytes(spec: StructuredOutputsParams) -> tuple[str, int]:
    """The constraint's field and the UTF-8 size of its text (a schema given as a dict as its JSON;
    choices all together): what the engine's ``max_structured_output_bytes`` bounds."""
    if spec.json is not None:
        return "json", len((spec.json if isinstance(spec.json, str) else json.dumps(spec.json)).encode())
    if spec.regex is not None:
        return "regex", len(spec.regex.encode())
    if spec.grammar is not None:
        return "grammar", len(spec.grammar.encode())
    if spec.choice is not None:
        return "choice", sum(len(c.encode()) for c in spec.choice)
    return "json_object", 0


def check_constraint(spec: StructuredOutputsParams, max_bytes: int) -> None:
    """Refuse a constraint larger than ``max_bytes`` (its compile time grows faster than its size),
    then parse it (no tokenizer needed), so a malformed schema, regex or grammar is a ValueError
    naming it before the request is sent, not a failure inside the engine."""
    import xgrammar

    kind, size = constraint_bytes(spec)
    if size > max_bytes:
        raise ValueError(
            f"structured_outputs.{kind} is {size} bytes, more than this engine's limit of {max_bytes} "
            "(the max_structured_output_bytes option)"
        )
    try:
        if spec.json is not None:
            xgrammar.Grammar.from_json_schema(spec.json if isinstance(spec.json, str) else json.dumps(spec.json))
        elif spec.regex is not None:
            xgrammar.Grammar.from_regex(spec.regex)
        elif spec.grammar is not None:
            xgrammar.Grammar.from_ebnf(spec.grammar)
    except Exception as exc:
        kind = "json" if spec.json is not None else "regex" if spec.regex is not None else "grammar"
        raise ValueError(f"structured_outputs.{kind} is not valid: {grammar_error_reason(exc)}") from None


def grammar_error_reason(exc: Exception) -> str:
    """xgrammar's message without its C++ location and assertion text."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    line = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", line)
    return re.sub(r"^Check failed: \(.*?\) is false:\s*", "", line)


class CompileJob(Future):
    """One constraint's compile, shared by every request that waits for it: its result is the
    compiled grammar. ``started`` is when a worker took it up (None while it queues), ``waiters``
    how many requests still want it."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.started: float | None = None
        self.waiters = 0


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary on ``workers`` threads, each distinct one once
    at a time. Compiled grammars stay in a least-recently-used cache of at most ``cache_bytes`` (as
    xgrammar measures each), so a stream of distinct schemas cannot grow the process without end;
    xgrammar's own cache is off, as it would keep what this one lets go."""

    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        workers: int = DEFAULT_COMPILE_WORKERS,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.workers = workers
        self.cache_limit = cache_bytes
        self.cache_bytes = 0  # what the cached grammars hold
        self.timeout_s = GRAMMAR_TIMEOUT_S
        self.queue_timeout_s = GRAMMAR_QUEUE_TIMEOUT_S
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()  # the first compiles of several workers build it once
        self._lock = threading.Lock()  # the workers and the core's thread share the jobs and the cache
        self._jobs: dict[str, CompileJob] = {}  # compiles queued or running
        self._cache: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # key -> (compiled, bytes), oldest use first

    def submit(self, spec: StructuredOutputsParams) -> CompileJob:
        """The job that compiles ``spec`` for one more waiting request (done at once on a cache
        hit); the request hands it back with ``release`` once it stops waiting."""
        key = spec.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                job = CompileJob(key)
                job.set_result(cached[0])
                return job
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = CompileJob(key)
                self._executor.submit(self._run, job, spec)
            job.waiters += 1
            return job

    def release(self, job: CompileJob) -> None:
        """A request stops waiting for ``job`` (it compiled, failed, timed out, or the request was
        aborted): a compile that nobody waits for any more and that has not started is dropped."""
        with self._lock:
            job.waiters -= 1
            if job.waiters <= 0 and job.cancel() and self._jobs.get(job.key) is job:
                del self._jobs[job.key]

    def overdue(self, job: CompileJob, waiting_since: float, now: float) -> str | None:
        """Why a request waiting for ``job`` since ``waiting_since`` should stop waiting at ``now``:
        its compile has run longer than ``timeout_s`` (counted from when it started, or from the
        request if it came later), or has queued behind others' longer than ``queue_timeout_s``.
        None while it may wait on."""
        started = job.started
        if started is None:
            if now - waiting_since > self.queue_timeout_s:
                return (
                    f"no grammar compile worker was free for {self.queue_timeout_s:.0f} s (all {self.workers} "
                    "were compiling other constraints); retry later"
                )
            return None
        if now - max(started, waiting_since) > self.timeout_s:
            return f"it took longer than {self.timeout_s:.0f} s; retry later, or simplify the constraint"
        return None

    def _run(self, job: CompileJob, spec: StructuredOutputsParams) -> None:
        """A worker's part: compile (unless the job was dropped meanwhile) and keep the result."""
        if not job.set_running_or_notify_cancel():
            return
        job.started = time.monotonic()
        try:
            compiled = self._compile(spec)
        except Exception as exc:
            with self._lock:
                del self._jobs[job.key]
            job.set_exception(exc)
            return
        with self._lock:
            del self._jobs[job.key]
            self._remember(job.key, compiled)
        job.set_result(compiled)

    def _remember(self, key: str, compiled: Any) -> None:
        """Cache a compiled grammar, evicting the least recently used past the limit; one larger
        than the whole cache serves the requests that waited for it and is not kept."""
        size = compiled.memory_size_bytes
        if size > self.cache_limit:
            return
        self._cache[key] = (compiled, size)
        self.cache_bytes += size
        while self.cache_bytes > self.cache_limit:
            _, (_, dropped) = self._cache.popitem(last=False)
            self.cache_bytes -= dropped

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
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar

                from tokenmill.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(self.model_dir)
                if tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer, and this model ships none")
                info = xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
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
