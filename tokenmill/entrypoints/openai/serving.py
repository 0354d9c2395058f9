"""What the completions and chat endpoints share: sampling options from a request, a
group of engine requests (one per prompt) read as one merged stream, server-sent
events, and the token text that logprobs show."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from tokenmill.engine.async_llm import AsyncLLM, RequestStream
from tokenmill.entrypoints.openai.errors import APIError, to_api_error
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.protocol import SamplingFields, UsageInfo
from tokenmill.outputs import OutputKind, RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                      "repetition_penalty")
_DISCONNECT_POLL_S = 0.5


@dataclass(frozen=True)
class ServingOptions:
    """Server-wide switches, named as vLLM's server flags."""

    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    enable_force_include_usage: bool = False  # usage in every stream, asked for or not
    return_tokens_as_token_ids: bool = False  # logprobs show tokens as "token_id:N"


@dataclass
class ServingContext:
    """Everything a handler needs: the engine, the name it answers to, metrics, switches."""

    engine: AsyncLLM
    model_name: str
    tokenizer: Any
    metrics: ServerMetrics
    options: ServingOptions = ServingOptions()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(400, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def token_text(self, token_id: int) -> str:
        """How one token reads on its own (what logprobs show); ids without a tokenizer."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    async def start(self, request_id: str, prompts: list[str | list[int]], params: SamplingParams,
                    stream: bool) -> RequestGroup:
        """Add one engine request per prompt; if any is refused, none stays queued. A stream
        gets each prompt's news as it comes; otherwise only each prompt's final output."""
        self.engine.check_admission(len(prompts))
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        processed = [await self.engine.process_input(prompt, params) for prompt in prompts]
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(processed):
                streams.append(await self.engine.add_request(f"{request_id}-{i}", prompt, params, kind))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return RequestGroup(streams)


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams from the fields both endpoints share; unset fields keep the defaults."""
    options: dict[str, Any] = {name: getattr(req, name) for name in _OPTIONAL_SAMPLING
                               if getattr(req, name) is not None}
    return SamplingParams(
        n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
        stop_token_ids=req.stop_token_ids, seed=req.seed, ignore_eos=req.ignore_eos, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, **options)


class RequestGroup:
    """The engine requests of one HTTP request, read together. Leaving early, for any
    reason, aborts those still running so their KV blocks are freed at once."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they come, from all prompts interleaved."""
        try:
            if len(self.streams) == 1:
                async for output in self.streams[0]:
                    yield 0, output
                return
            async for item in self._merged():
                yield item
        finally:
            self.abort()

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output))
                queue.put_nowait((index, None))
            except Exception as exc:
                queue.put_nowait((index, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()

    async def final_outputs(self, raw: Request) -> list[RequestOutput]:
        """The final output of every prompt; aborts everything if the client goes away."""
        finals: dict[int, RequestOutput] = {}

        async def consume() -> None:
            async for index, output in self.outputs():
                finals[index] = output

        task = asyncio.create_task(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if not task.done() and await raw.is_disconnected():
                    raise APIError(499, "the client closed the request")
            task.result()
        finally:
            task.cancel()
            self.abort()
        return [finals[i] for i in range(len(self.streams))]


def usage_of(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def final_usage(outputs: list[RequestOutput]) -> UsageInfo:
    """Prompt tokens counted once per prompt, completion tokens over every choice."""
    return usage_of(sum(len(out.prompt_token_ids) for out in outputs),
                    sum(len(c.token_ids) for out in outputs for c in out.outputs))


def sse(data: BaseModel | dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else (
        data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data))
    return f"data: {payload}\n\n"


async def sse_stream(events: AsyncIterator[BaseModel], group: RequestGroup) -> AsyncIterator[str]:
    """Server-sent events of ``events``, then ``[DONE]``; an error mid-stream becomes an
    error event (the status line is already sent) and the stream still ends with ``[DONE]``.
    A shutdown that cancels the response mid-stream ends it the same way: the client always
    sees the end of its stream."""
    try:
        async for event in events:
            yield sse(event)
    except asyncio.CancelledError:
        group.abort()
        raise
    except Exception as exc:
        yield sse(to_api_error(exc).body())
    finally:
        group.abort()
    yield sse("[DONE]")
