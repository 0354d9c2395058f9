"""What the completions and chat endpoints share: sampling options from a request, a
group of engine requests (one per prompt) read as one merged stream, server-sent
events, and the token text that logprobs show."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from tokenmill.engine.frontend.async_llm import AsyncLLM, RequestStream
from tokenmill.engine.frontend.input_processor import ProcessedPrompt, check_priority
from tokenmill.entrypoints.openai.errors import APIError, to_api_error
from tokenmill.entrypoints.openai.limits import ServerLimits, logprob_entries
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.protocol import (
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    SamplingFields,
    UsageInfo,
    random_id,
)
from tokenmill.outputs import Logprobs, OutputKind, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import ChatOptions, TemplateTimeout

logger = logging.getLogger(__name__)

_OPTIONAL_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_DISCONNECT_POLL_S = 0.5
T = TypeVar("T")
REQUEST_ID_HEADER = "X-Request-Id"


@dataclass(frozen=True)
class ServingOptions:
    """Server-wide switches, named as vLLM's server flags."""

    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    enable_force_include_usage: bool = False  # usage in every stream, asked for or not
    return_tokens_as_token_ids: bool = False  # logprobs show tokens as "token_id:N"
    tool_call_parser: str = "hermes"  # how calls are read out of replies (tool_parsers.TOOL_PARSERS)
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model decides whether to call
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice "none" keeps the tools from the template
    trust_request_chat_template: bool = False  # a request may bring its own chat template
    reasoning_parser: str | None = None  # how thinking is read out of chat replies (reasoning_parsers)
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # a request's own win, key by key
    limits: ServerLimits = field(default_factory=ServerLimits)  # the most work one request may ask


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
            raise APIError(
                400,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        """How one token reads on its own (what logprobs show): ``token_id:N`` when asked
        for (request or server option), or without a tokenizer."""
        if as_id or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def tokens_as_ids(self, req: SamplingFields) -> bool:
        return req.return_tokens_as_token_ids or self.options.return_tokens_as_token_ids

    @staticmethod
    def request_id(req: SamplingFields, raw: Request, prefix: str) -> str:
        """The response id, as vLLM forms it: the endpoint's prefix and the client's own id
        (``X-Request-Id`` header first, then the body's ``request_id``), else a random one.
        Echoing the header back is the server's ``--enable-request-id-headers``."""
        given = raw.headers.get(REQUEST_ID_HEADER) or req.request_id
        return f"{prefix}-{given}" if given else random_id(prefix)

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        """Usage, with the cached prompt tokens when the server is run to report them."""
        details = (
            PromptTokensDetails(cached_tokens=cached_tokens) if self.options.enable_prompt_tokens_details else None
        )
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=details,
        )

    def final_usage(self, outputs: list[RequestOutput]) -> UsageInfo:
        """Prompt tokens counted once per prompt, completion tokens over every choice."""
        return self.usage(
            sum(len(out.prompt_token_ids) for out in outputs),
            sum(len(c.token_ids) for out in outputs for c in out.outputs),
            sum(out.num_cached_tokens for out in outputs),
        )

    def stream_usage(self, req: SamplingFields) -> tuple[bool, bool]:
        """(a usage chunk at the end, usage in every chunk) for a stream: the end chunk when
        asked for or forced by the server; every chunk only beside it, as in vLLM."""
        options = req.stream_options
        final = (options is not None and options.include_usage) or self.options.enable_force_include_usage
        return final, final and options is not None and options.continuous_usage_stats

    def prompt_logprobs(
        self, req: SamplingFields, token_ids: list[int], entries: list[Logprobs | None] | None, engine_n: int | None
    ) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs``: per prompt position (the first has none) the prompt's
        token and the ``prompt_logprobs`` best, each with its rank and text. ``engine_n`` is
        how many the engine was asked for (echo may have asked for more)."""
        num_best = req.prompt_logprobs
        if num_best is None or entries is None or engine_n is None:
            return None
        as_id = self.tokens_as_ids(req)

        def position(token_id: int, entry: Logprobs | None) -> dict[int, PromptLogprob] | None:
            if entry is None:
                return None
            ranks = _ranks(entry, engine_n)
            chosen = dict(best(entry, num_best)) | {token_id: entry[token_id]}
            return {
                t: PromptLogprob(logprob=lp, rank=ranks.get(t), decoded_token=self.token_text(t, as_id))
                for t, lp in chosen.items()
            }

        return [position(t, e) for t, e in zip(token_ids, entries)]

    async def start(
        self, request_id: str, prompts: list[str | list[int]], params: SamplingParams, stream: bool, req: SamplingFields
    ) -> RequestGroup:
        """Add one engine request per prompt; if any is refused, none stays queued. A stream
        gets each prompt's news as it comes; otherwise only each prompt's final output. The
        request's cost is checked against the server's limits before anything is queued."""
        self.engine.check_admission(len(prompts))
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        try:
            check_priority(req.priority, self.engine.config.scheduling_policy)
        except ValueError as exc:
            raise APIError(400, str(exc), param="priority", code="invalid_value") from None
        limits = self.options.limits
        limits.check_stop_strings(params.stop)
        special = getattr(req, "add_special_tokens", True)  # (a chat prompt arrives as ids, which it leaves alone)
        processed = await self.engine.process_inputs(prompts, params, special, req.truncate_prompt_tokens)
        self._check_logprob_entries(processed, params)
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(processed):
                streams.append(await self.engine.add_request(f"{request_id}-{i}", prompt, params, kind, req.priority))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return RequestGroup(streams)

    async def render_chat(
        self, req: Any, messages: list[dict[str, Any]], add_special_tokens: bool, tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """The prompt's ids of a conversation as a request (chat completions or ``/tokenize``, which
        name the fields alike) asks it rendered, with the tools its template lists. A template of
        the request's own runs only on a server that trusts them; any template is stopped after
        ``--chat-template-timeout``, and its text may be no longer than a request's body may be.
        Its failures are the request's: 400s naming ``messages``."""
        if req.chat_template is not None and not self.options.trust_request_chat_template:
            raise APIError(
                400,
                "this server renders conversations with the model's own chat template only: "
                "start it with --trust-request-chat-template to take templates from requests",
                param="chat_template",
                code="invalid_value",
            )
        options = ChatOptions(
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template,
            chat_template_kwargs=self.options.default_chat_template_kwargs | (req.chat_template_kwargs or {}),
            add_special_tokens=add_special_tokens,
            tools=tools,
        )
        try:
            limits = self.options.limits
            return await self.engine.render_chat(
                messages, options, limits.chat_template_timeout, limits.max_request_body_bytes
            )
        except TemplateTimeout as exc:
            raise APIError(
                400, f"{exc} (this server's --chat-template-timeout)", param="messages", code="template_timeout"
            ) from None
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from None

    def _check_logprob_entries(self, prompts: list[ProcessedPrompt], params: SamplingParams) -> None:
        """The logprobs the request asks for, over all its prompts, against ``--max-logprob-entries``."""
        if params.logprobs is None and params.prompt_logprobs is None:
            return
        max_len, vocab = self.engine.max_model_len, self.engine.vocab_size
        entries = 0
        for prompt in prompts:
            length = len(prompt.token_ids)
            rows = params.n * (params.max_tokens if params.max_tokens is not None else max_len - length)
            entries += logprob_entries(length, rows, params.logprobs, params.prompt_logprobs, vocab)
        limit = self.options.limits.max_logprob_entries
        if entries > limit:
            raise APIError(
                400,
                f"the request asks for {entries} logprob entries (its rows times 1 + the logprobs "
                f"of each, the vocabulary of {vocab} for -1), but this server gives at most {limit} a "
                "request (its --max-logprob-entries): ask for fewer logprobs or fewer tokens",
                param="prompt_logprobs" if params.prompt_logprobs is not None else "logprobs",
                code="invalid_value",
            )


def best(entry: Logprobs, count: int) -> list[tuple[int, float]]:
    """The ``count`` likeliest tokens of a position, likeliest first (-1: all it holds)."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)
    return ranked if count == -1 else ranked[:count]


def _ranks(entry: Logprobs, engine_n: int) -> dict[int, int]:
    """Each token's rank (1 for the likeliest; tied tokens share the best), for the tokens
    whose rank is known: those within the ``engine_n`` best that the engine sent (-1: the
    whole vocabulary). One sort, as the entry may hold the whole vocabulary."""
    ranks: dict[int, int] = {}
    previous, rank = None, 0
    for i, (token_id, logprob) in enumerate(best(entry, -1), start=1):
        if logprob != previous:
            previous, rank = logprob, i
        if engine_n != -1 and rank > engine_n:
            break
        ranks[token_id] = rank
    return ranks


def structured_outputs_of(req: SamplingFields, forced: tuple[str, Any] | None = None) -> tuple[str, Any] | None:
    """``(the field that asked, SamplingParams' structured_outputs)`` from whichever of
    ``response_format``, ``structured_outputs``, ``guided_*`` and ``forced`` (a constraint that
    another field implies, such as tool_choice's) the request sets (at most one), or None. The
    constraint's own content is checked by SamplingParams and the engine."""
    asked: list[tuple[str, Any]] = [forced] if forced is not None else []
    fmt = req.response_format
    if fmt is not None and fmt != {"type": "text"}:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif kind == "json_schema" and isinstance(fmt.get("json_schema"), dict) and "schema" in fmt["json_schema"]:
            asked.append(("response_format", {"json": fmt["json_schema"]["schema"]}))
        else:
            raise APIError(
                400,
                'response_format must be {"type": "text"}, {"type": "json_object"} or '
                '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                param="response_format",
                code="invalid_value",
            )
    if req.structured_outputs is not None:
        asked.append(("structured_outputs", req.structured_outputs))
    for name, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if getattr(req, name) is not None:
            asked.append((name, {key: getattr(req, name)}))
    if len(asked) > 1:
        raise APIError(
            400, f"set at most one of {', '.join(name for name, _ in asked)}", param=asked[1][0], code="invalid_value"
        )
    return asked[0] if asked else None


def sampling_params(
    req: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    forced: tuple[str, Any] | None = None,
) -> SamplingParams:
    """SamplingParams from the fields both endpoints share; unset fields keep the defaults.
    ``forced``: see ``structured_outputs_of``. (Token ids of ``logit_bias`` are checked against
    the vocabulary by the engine.)"""
    options: dict[str, Any] = {
        name: getattr(req, name) for name in _OPTIONAL_SAMPLING if getattr(req, name) is not None
    }
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(
            400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs", code="invalid_value"
        )
    structured = structured_outputs_of(req, forced)
    structured_params = None
    if structured is not None:
        try:
            structured_params = SamplingParams(structured_outputs=structured[1])
        except ValueError as exc:
            raise APIError(400, str(exc), param=structured[0], code="invalid_value") from None
    return SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        logit_bias=req.logit_bias_ids(),
        structured_outputs=None if structured_params is None else structured_params.structured_outputs,
        **options,
    )


def merged_logprobs(*counts: int | None) -> int | None:
    """One engine count serving several asks: None if none asks, -1 (the whole
    vocabulary) if any does, else the largest."""
    asked = [c for c in counts if c is not None]
    if not asked:
        return None
    return -1 if -1 in asked else max(asked)


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


async def json_response(build: Callable[[], BaseModel]) -> JSONResponse:
    """The response ``build`` makes, built and serialized in a worker thread: a whole response
    with logprobs or many choices takes long enough to hold up every stream on the event loop."""
    return await asyncio.to_thread(lambda: JSONResponse(build().model_dump()))


def sse(data: BaseModel | dict[str, Any] | str) -> str:
    payload = (
        data if isinstance(data, str) else (data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data))
    )
    return f"data: {payload}\n\n"


async def off_loop(offload: bool, func: Callable[..., T], *args: Any) -> T:
    """``func(*args)``, in a worker thread when ``offload``: building a stream's chunks with logprobs
    (the whole vocabulary, with -1) takes long enough to hold up every other stream."""
    return await asyncio.to_thread(func, *args) if offload else func(*args)


async def sse_stream(
    events: AsyncIterator[BaseModel], group: RequestGroup, offload: bool = False
) -> AsyncIterator[str]:
    """Server-sent events of ``events``, then ``[DONE]``; an error mid-stream becomes an
    error event (the status line is already sent) and the stream still ends with ``[DONE]``.
    A shutdown that cancels the response mid-stream ends it the same way: the client always
    sees the end of its stream. ``offload``: serialize each event in a worker thread (see
    ``off_loop``)."""
    try:
        async for event in events:
            yield await off_loop(offload, sse, event)
    except asyncio.CancelledError:
        group.abort()
        raise
    except Exception as exc:
        yield sse(to_api_error(exc).body())
    finally:
        group.abort()
    yield sse("[DONE]")
