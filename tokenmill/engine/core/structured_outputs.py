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

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.engine.config import DEFAULT_CACHE_BYTES, DEFAULT_COMPILE_WORKERS
from tokenmill.engine.core.request import CoreRequest
from tokenmill.layers.grammar_mask import grammar_error_reason
from tokenmill.outputs import ERROR_ENGINE, ERROR_INVALID, ERROR_UNAVAILABLE
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

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
            queued = self._jobs.get(key)
            if queued is None:
                queued = self._jobs[key] = CompileJob(key)
                self._executor.submit(self._run, queued, spec)
            queued.waiters += 1
            return queued

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


@dataclass
class Admitted:
    """A request whose constraint compiled: each of its sequences' matcher, in order."""

    request: CoreRequest
    priority: int
    matchers: list[Any]


@dataclass
class Refused:
    """A request whose constraint will not run: why, and whose fault (``tokenmill.outputs``' kinds)."""

    request: CoreRequest
    message: str
    kind: str


class GrammarAdmission:
    """Requests with a constraint wait here, outside the scheduler, while it compiles: ``admit`` hands
    back those ready (a matcher for each sequence) and those refused: a constraint that does not
    compile (the request's fault), one that waited too long (``GrammarCompiler.overdue``: the
    engine's limit, which a retry may find free), or a matcher that could not start."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        # (request, priority, its compile, since when), in arrival order.
        self._waiting: list[tuple[CoreRequest, int, CompileJob, float]] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def submit(self, request: CoreRequest, spec: StructuredOutputsParams, priority: int) -> None:
        self._waiting.append((request, priority, self.compiler.submit(spec), time.monotonic()))

    def wait_first(self, timeout: float) -> None:
        """Block until the oldest compile ends or ``timeout`` passes (when nothing else can run)."""
        if self._waiting:
            wait([self._waiting[0][2]], timeout=timeout, return_when=FIRST_COMPLETED)

    def admit(self, is_live: Callable[[CoreRequest], bool]) -> tuple[list[Admitted], list[Refused]]:
        """The requests done compiling; ``is_live``: whether a request is still wanted (an aborted
        one's compile is released and the request forgotten)."""
        admitted: list[Admitted] = []
        refused: list[Refused] = []
        still = []
        now = time.monotonic()
        for entry in self._waiting:
            request, priority, job, since = entry
            if not is_live(request):
                self.compiler.release(job)
                continue
            if not job.done():
                reason = self.compiler.overdue(job, since, now)
                if reason is None:
                    still.append(entry)
                else:
                    self.compiler.release(job)
                    refused.append(
                        Refused(request, f"structured_outputs cannot be compiled: {reason}", ERROR_UNAVAILABLE)
                    )
                continue
            self.compiler.release(job)
            error = job.exception()
            if error is not None:
                refused.append(Refused(request, f"structured_outputs cannot be compiled: {error}", ERROR_INVALID))
                continue
            try:
                matchers = [self.compiler.matcher(job.result()) for _ in request.seqs]
            except Exception as exc:
                refused.append(
                    Refused(
                        request,
                        "the engine failed while starting this request's structured output: "
                        f"{type(exc).__name__}: {grammar_error_reason(exc)}",
                        ERROR_ENGINE,
                    )
                )
                continue
            admitted.append(Admitted(request, priority, matchers))
        self._waiting = still
        return admitted, refused
