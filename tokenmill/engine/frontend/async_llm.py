"""AsyncLLM: the server's front-end, on the event loop, over an engine core in its own process.

Requests are tokenized and validated here (a long prompt or a chat template
in a worker thread, so other streams keep flowing), sent to the core, and
their outputs come back through one task that reads every core message,
detokenizes, applies stop strings and hands each request its news. A request's
stream holds at most one pending output: when its reader falls behind, new
tokens merge into it, so a slow client costs memory for its own text only and
never slows the core.

If the core process dies, every request in flight ends with an error at once,
``core_alive`` turns false, and new requests are refused.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.builder import freeze_startup_objects, model_dir_of
from tokenmill.engine.frontend.core_client import CoreClient
from tokenmill.engine.frontend.input_processor import InputProcessor, ModelLimits, ProcessedPrompt, check_priority
from tokenmill.engine.frontend.output_processor import OutputProcessor, ProcessedOutputs
from tokenmill.engine.messages import AbortRequests, AddRequest, CoreOutputs, CoreStats, engine_stats
from tokenmill.outputs import ERROR_INVALID, ERROR_UNAVAILABLE, EngineStats, OutputKind, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import ChatOptions, apply_chat_template, load_tokenizer

logger = logging.getLogger(__name__)

_INLINE_PROMPT_CHARS = 4096  # a request's prompts longer than this altogether are tokenized in a worker thread


class QueueFull(RuntimeError):
    """Too many requests wait already; the client should come back later (HTTP 503)."""


class EngineStopped(RuntimeError):
    """The engine is shutting down, or its core is gone, and admits no request (HTTP 503)."""


class EngineStepError(RuntimeError):
    """The engine could not finish this request (a failed step, or the core died)."""


class InvalidRequest(ValueError):
    """The engine found the request itself at fault (its constraint would not compile): a 400."""


class EngineUnavailable(RuntimeError):
    """The engine could not serve this request in time (its constraint waited too long for a compile
    worker, or compiled too long): the server's limit, not the request's fault, so a retry later may
    succeed (HTTP 503)."""


# The exception a request's stream raises for each kind of error the core reports (others: EngineStepError).
_ERRORS: dict[str, type[Exception]] = {ERROR_INVALID: InvalidRequest, ERROR_UNAVAILABLE: EngineUnavailable}


def merge_delta(pending: RequestOutput, new: RequestOutput) -> None:
    """Fold ``new`` into ``pending`` (both DELTA outputs of one request), choice by choice."""
    by_index = {c.index: c for c in pending.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            pending.outputs.append(c)
            continue
        old.text += c.text
        old.token_ids.extend(c.token_ids)
        if old.logprobs is not None and c.logprobs is not None:
            old.logprobs.extend(c.logprobs)
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    if new.prompt_logprobs:
        pending.prompt_logprobs = (pending.prompt_logprobs or []) + new.prompt_logprobs
    pending.finished, pending.error, pending.metrics = new.finished, new.error, new.metrics
    pending.error_kind = new.error_kind
    pending.num_cached_tokens = new.num_cached_tokens


class RequestStream:
    """The outputs of one request, in order; iterating it to the end is the normal path,
    leaving early (a client that disconnects, a cancelled task) aborts the request.
    ``request_id`` is the caller's label, which its outputs carry; ``key`` is the engine's
    own id for the request, unique for the life of the engine."""

    def __init__(self, owner: AsyncLLM, request_id: str, key: str) -> None:
        self.request_id = request_id
        self.key = key
        self.finished = False
        self._owner = owner
        self._pending: RequestOutput | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self._pending is None:
            self._pending = output
        elif output.outputs or output.finished or output.prompt_logprobs:
            merge_delta(self._pending, output)
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                await self._ready.wait()
                self._ready.clear()
                output, self._pending = self._pending, None
                if output is None:
                    continue
                self.finished = output.finished
                if output.error is not None:
                    raise _ERRORS.get(output.error_kind, EngineStepError)(output.error)
                output.request_id = self.request_id
                yield output
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop the request now (its KV blocks are freed by the core); nothing once finished."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.key)


class AsyncLLM:
    """The engine for asyncio callers. ``max_waiting`` bounds the requests queued beyond
    those that can run at once (``max_num_seqs``): past it new requests get QueueFull."""

    def __init__(self, config: EngineConfig, max_waiting: int = 1024, core_in_thread: bool = False) -> None:
        if type(max_waiting) is not int or max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        self.config = config
        self.max_waiting = max_waiting
        self.client = CoreClient(config, in_thread=core_in_thread)
        try:  # the tokenizer (transformers' import: seconds) loads while the core process starts
            self.tokenizer = load_tokenizer(model_dir_of(config))
        except BaseException:
            self.client.shutdown()
            raise
        ready = self.client.wait_ready()
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.kv_cache_dtype = ready.kv_cache_dtype
        self.kv_capacity_tokens = ready.kv_capacity_tokens
        self.inputs = InputProcessor(
            self.tokenizer,
            ModelLimits(ready.vocab_size, ready.max_model_len, config.max_logprobs, config.max_structured_output_bytes),
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self.stats = CoreStats()
        self.accepting = True
        self.dead_reason: str | None = None
        self.observers: list[Any] = []  # called with each ProcessedOutputs (server metrics)
        self._streams: dict[str, RequestStream] = {}  # by the engine's key of each request
        self._keys = itertools.count()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenmill-tokenize")
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._encoder = msgspec.msgpack.Encoder()
        freeze_startup_objects()

    # ----------------------------------------------------------- public API
    def core_alive(self) -> bool:
        """False once the core is gone: noticed at once while requests run (the event loop
        watches its process), and here for a server that has not served a request yet."""
        if self.dead_reason is None and not self._closed and not self.client.is_alive():
            self._on_dead(f"the engine core process died ({self.client.exit_description()})")
        return self.dead_reason is None

    @property
    def num_unfinished(self) -> int:
        return len(self.outputs.requests)

    @property
    def capacity(self) -> int:
        """Requests the engine takes at once: those that can run plus ``max_waiting`` more."""
        return self.config.max_num_seqs + self.max_waiting

    def check_admission(self, count: int) -> None:
        """Raise unless ``count`` more requests can be admitted now."""
        if not self.core_alive():
            raise EngineStopped(self.dead_reason)
        if not self.accepting or self._closed:
            raise EngineStopped("the server is shutting down")
        if count > self.capacity:
            raise ValueError(
                f"{count} prompts in one request, but at most {self.capacity} can be queued "
                f"(max_num_seqs + max_waiting)"
            )
        if self.num_unfinished + count > self.capacity:
            raise QueueFull(f"too many requests are waiting (max_waiting={self.max_waiting}); retry later")

    async def process_inputs(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        add_special_tokens: bool = True,
        truncate: int | None = None,
    ) -> list[ProcessedPrompt]:
        """Tokenize and validate a request's prompts (see ``InputProcessor.process``): in a worker
        thread unless they are short altogether, so that other streams go on meanwhile (many short
        prompts add up as much as one long one)."""
        chars = sum(len(p) if isinstance(p, str) else len(p) // 8 for p in prompts)

        def process() -> list[ProcessedPrompt]:
            return [self.inputs.process(p, params, add_special_tokens, truncate) for p in prompts]

        if chars <= _INLINE_PROMPT_CHARS:
            return process()
        return await asyncio.get_running_loop().run_in_executor(self._executor, process)

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        options: ChatOptions = ChatOptions(),
        time_limit: float | None = None,
        max_chars: int | None = None,
    ) -> list[int]:
        """The chat template and tokenizing, in a worker thread (a template may be slow), the
        template stopped after ``time_limit`` seconds, its text refused past ``max_chars``."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, apply_chat_template, self.tokenizer, messages, options, time_limit, max_chars
        )

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | ProcessedPrompt,
        params: SamplingParams,
        kind: OutputKind = OutputKind.DELTA,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request and return its stream. Raises ValueError for bad input (nothing is
        queued; a nonzero ``priority`` needs scheduling_policy "priority"), QueueFull when too
        many wait, EngineStopped while draining or once the core is gone.

        ``request_id`` is a label, free for callers to reuse (a client's ``X-Request-Id``): the
        core and the output processor know the request by a key made here, so an aborted
        request's tokens still on their way can never reach a newer request of the same label."""
        self.check_admission(1)
        priority = check_priority(priority, self.config.scheduling_policy)
        arrival = time.monotonic()
        if isinstance(prompt, ProcessedPrompt):
            self.inputs.check(prompt, params)
            processed = prompt
        else:
            [processed] = await self.process_inputs([prompt], params)
            self.check_admission(1)  # the state may have changed while tokenizing
        # Unique, as the number after the last '#' is; the label's head makes the core's logs readable.
        key = f"{request_id[:64]}#{next(self._keys)}"
        try:  # before anything is registered: a value msgpack cannot hold fails this request alone
            message = self._encoder.encode(AddRequest(key, processed.token_ids, params, arrival, priority))
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"the request holds a value that cannot be sent to the engine: {exc}") from None
        self._start()
        self.outputs.add_request(key, processed.text, processed.token_ids, params, kind, arrival)
        stream = self._streams[key] = RequestStream(self, request_id, key)
        self.client.send_encoded(message)
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        kind: OutputKind = OutputKind.DELTA,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params, kind, priority)
        async for output in stream:
            yield output

    def abort(self, key: str) -> None:
        """Abort a request (its reader has left) by its key (``RequestStream.key``); unknown or
        finished keys are ignored."""
        self._streams.pop(key, None)
        output = self.outputs.abort_request(key)
        if output is None:
            return
        self._deliver(ProcessedOutputs(outputs=[output]))  # the observers count it
        if self.dead_reason is None and not self._closed:
            self.client.send(AbortRequests([key]))

    def stop_admitting(self) -> None:
        """From now on new requests fail with EngineStopped; running ones go on."""
        self.accepting = False

    async def drain(self, grace_period: float) -> None:
        """Graceful shutdown: admit nothing new, give running requests ``grace_period``
        seconds to finish, end the rest with finish_reason "abort", stop the core."""
        self.stop_admitting()
        deadline = time.monotonic() + grace_period
        while self.num_unfinished and time.monotonic() < deadline and self.dead_reason is None:
            await asyncio.sleep(0.05)
        self.abort_all()
        await asyncio.sleep(0)  # let the streams take their final outputs
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def abort_all(self) -> None:
        """End every request now with finish_reason "abort"; their streams get that output."""
        request_ids = list(self.outputs.requests)
        outputs = [self.outputs.abort_request(request_id) for request_id in request_ids]
        self._deliver(ProcessedOutputs(outputs=[output for output in outputs if output is not None]))
        if request_ids and self.dead_reason is None and not self._closed:
            self.client.send(AbortRequests(request_ids))

    def close(self) -> None:
        """Stop the core (requests still running end with "abort") and the worker threads."""
        if self._closed:
            return
        self._closed = True
        self.accepting = False
        if self._loop is not None and self.client.process is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.remove_reader, self.client.process.sentinel)
        self.client.shutdown()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -------------------------------------------------------- output reader
    def _start(self) -> None:
        """Start reading the core's outputs on the running loop (once)."""
        if self._reader is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._reader = self._loop.create_task(self._read_outputs(), name="tokenmill-outputs")
        if self.client.process is not None:
            self._loop.add_reader(self.client.process.sentinel, self._on_core_exit)

    async def _read_outputs(self) -> None:
        socket = zmq.asyncio.Socket.from_socket(self.client.output_socket)
        decoder = msgspec.msgpack.Decoder(CoreOutputs)
        try:
            while True:
                frame = await socket.recv(copy=False)
                self._dispatch(decoder.decode(frame.buffer))
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        except Exception as exc:  # a front-end bug: every request must still end
            logger.exception("reading the engine core's outputs failed")
            self._on_dead(f"the server failed reading the engine's outputs: {exc!r}")

    def get_stats(self) -> EngineStats:
        """The engine's gauges as of its last step and its counters since it started (``/metrics``)."""
        return engine_stats(self.stats, self.kv_capacity_tokens, self.kv_cache_dtype)

    def _dispatch(self, core_outputs: CoreOutputs) -> None:
        self.stats = core_outputs.stats
        processed = self.outputs.process(core_outputs)
        for abort in processed.aborts:
            self.client.send(abort)
        self._deliver(processed)

    def _deliver(self, processed: ProcessedOutputs) -> None:
        for output in processed.outputs:
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
            if stream is not None:
                stream.put(output)
        for observe in self.observers:
            observe(processed)

    def _on_core_exit(self) -> None:
        if self._loop is not None and self.client.process is not None:
            self._loop.remove_reader(self.client.process.sentinel)
        if not self._closed:
            self._on_dead(f"the engine core process died ({self.client.exit_description()})")

    def _on_dead(self, reason: str) -> None:
        logger.error("%s: failing %d requests in flight", reason, self.num_unfinished)
        self.dead_reason = reason
        self.accepting = False
        self._deliver(ProcessedOutputs(outputs=self.outputs.fail_all(reason)))
