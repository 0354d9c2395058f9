"""AsyncEngine: one LLMEngine shared by many asyncio requests.

The engine is synchronous and not thread-safe, and a step can take a while, so
it gets a thread of its own: every engine call (add, abort, step, even a chat
template render) is a command that this thread runs between steps. The event
loop never touches the engine and never blocks on a step; outputs travel back
through one asyncio queue per request, fed with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


class QueueFull(RuntimeError):
    """Too many requests wait already; the client should come back later (HTTP 503)."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and admits no new request (HTTP 503)."""


class EngineStepError(RuntimeError):
    """A step failed; the requests it may have touched are failed with this error."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state as of the end of the last loop iteration, safe to read from any thread
    (the metrics endpoint and the admission check read it without touching the engine)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks_in_use: int = 0
    kv_blocks_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineSnapshot:
        scheduler, kv = engine.scheduler, engine.kv
        return cls(
            num_running=len({seq.request_id for seq in scheduler.running}),
            num_waiting=len({seq.request_id for seq in scheduler.waiting} - {s.request_id for s in scheduler.running}),
            kv_usage=kv.pool.usage(),
            kv_blocks_in_use=kv.num_blocks_in_use,
            kv_blocks_cached=kv.pool.num_cached,
            prefix_cache_queries=kv.query_tokens,
            prefix_cache_hits=kv.hit_tokens,
            prompt_tokens=engine.stats.prompt_tokens,
            generation_tokens=engine.stats.generation_tokens,
            num_preemptions=engine.stats.num_preemptions,
        )

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting


@dataclass
class _Command:
    """Work for the engine thread; ``counts_as_pending`` marks an add that the admission
    check already counts as waiting."""

    fn: Callable[[LLMEngine], object]
    future: Future
    counts_as_pending: bool = False


class RequestStream:
    """The outputs of one request, in order; iterating it to the end is the normal path,
    leaving early (a client that disconnects, a cancelled task) aborts the request."""

    def __init__(self, owner: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread: hand ``item`` to the request's event loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop the request now (its KV blocks are freed by the engine thread's next command);
        does nothing once the request has finished."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class AsyncEngine:
    """Runs ``engine`` on a background thread for as long as this object lives.

    ``max_waiting`` bounds the requests that wait to be scheduled (being added, or
    queued in the scheduler): beyond it ``add_request`` raises QueueFull at once
    instead of letting latency grow without bound.
    """

    def __init__(self, engine: LLMEngine, max_waiting: int = 1024) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.accepting = True
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._commands: list[_Command] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._state_lock = threading.Lock()
        self._pending_adds = 0
        self._snapshot = EngineSnapshot.of(engine)
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------- public API
    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    @property
    def num_unfinished(self) -> int:
        """Requests accepted and not yet finished (including those still being added)."""
        with self._state_lock:
            return self._pending_adds + self._snapshot.num_requests

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result
        (or raise its exception): the one way in for anything that touches the engine."""
        return await asyncio.wrap_future(self._submit(fn))

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Queue a request and return its stream. Raises ValueError for bad input (the
        engine is left as it was), QueueFull when too many wait, EngineStopped while draining."""
        if not self.accepting:
            raise EngineStopped("the server is shutting down")
        with self._state_lock:
            if self._pending_adds + self._snapshot.num_waiting >= self.max_waiting:
                raise QueueFull(f"too many requests are waiting (max_waiting={self.max_waiting}); retry later")
            self._pending_adds += 1
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        arrival = time.monotonic()

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, params, arrival_time=arrival)
            self._streams[request_id] = stream

        future = self._submit(add, counts_as_pending=True)
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add, so it finds the request
            raise
        return stream

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request as the engine produces them, the last one finished."""
        stream = await self.add_request(request_id, prompt, params)
        async for output in stream:
            yield output

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; unknown or finished ids are ignored."""
        self._submit(lambda engine: self._abort_now(request_id))

    def stop_admitting(self) -> None:
        """From now on new requests fail with EngineStopped; running ones go on."""
        self.accepting = False

    async def drain(self, grace_period: float) -> None:
        """Graceful shutdown: admit nothing new, give running requests ``grace_period``
        seconds to finish, abort the rest, and stop the engine thread."""
        self.stop_admitting()
        deadline = time.monotonic() + grace_period
        while self.num_unfinished and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        """Stop the engine thread now; requests still running end with finish_reason "abort"."""
        self.accepting = False
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    # --------------------------------------------------------- engine thread
    def _submit(self, fn: Callable[[LLMEngine], T], counts_as_pending: bool = False) -> Future:
        future: Future = Future()
        with self._wake:
            if self._stopping:
                future.set_exception(EngineStopped("the engine has stopped"))
                if counts_as_pending:
                    self._finish_pending(1)
                return future
            self._commands.append(_Command(fn, future, counts_as_pending))
            self._wake.notify()
        return future

    def _finish_pending(self, count: int) -> None:
        with self._state_lock:
            self._pending_adds -= count

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                    self._wake.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            self._run_commands(commands)
            if stopping:
                break
            if engine.has_unfinished_requests():
                self._step()
            self._publish()
        for request_id in list(engine.requests):
            self._abort_now(request_id)
        self._publish()

    def _run_commands(self, commands: list[_Command]) -> None:
        added = 0
        for command in commands:
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as exc:  # handed to the caller, e.g. a ValueError for bad input
                command.future.set_exception(exc)
            added += command.counts_as_pending
        if added:
            # Publish first so that the admission check never sees a request in neither count.
            self._publish()
            self._finish_pending(added)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all(EngineStepError(f"the engine failed while running this request: {exc!r}"))
            return
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
            if stream is not None:
                stream.put(output)

    def _fail_all(self, error: EngineStepError) -> None:
        """After a failed step the engine's state for the running requests is suspect: drop
        them all (freeing their blocks) and tell their clients, then keep serving."""
        for request_id in list(self.engine.requests):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s after a failed step failed too", request_id)
                self.engine.requests.pop(request_id, None)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(error)

    def _abort_now(self, request_id: str) -> None:
        output = self.engine.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and output is not None:
            stream.put(output)

    def _publish(self) -> None:
        snapshot = EngineSnapshot.of(self.engine)
        with self._state_lock:
            self._snapshot = snapshot
