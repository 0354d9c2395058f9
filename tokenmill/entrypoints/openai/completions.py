"""``POST /v1/completions``: prompts in (text or token ids, one or many), text out,
whole or streamed, with the legacy logprobs format."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    now_seconds,
)
from tokenmill.entrypoints.openai.serving import (
    RequestGroup,
    ServingContext,
    best,
    json_response,
    merged_logprobs,
    off_loop,
    sampling_params,
    sse_stream,
)
from tokenmill.outputs import CompletionOutput, Logprobs, RequestOutput


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts as a list: one string, one list of ids, or a batch of either
    (the schema has refused empty lists already)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


class _LogprobsBuilder:
    """Appends tokens to a CompletionLogprobs, keeping text offsets running across chunks."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest) -> None:
        self.ctx = ctx
        self.as_id = ctx.tokens_as_ids(req)
        self.top_n = req.logprobs or 0
        self.offset = 0

    def build(self, token_ids: list[int], entries: list[Logprobs | None]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries):
            text = self.ctx.token_text(token_id, self.as_id)
            out.tokens.append(text)
            out.token_logprobs.append(entry.get(token_id) if entry else None)
            out.top_logprobs.append(self._top(token_id, entry) if entry else None)
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out

    def _top(self, token_id: int, entry: Logprobs) -> dict[str, float]:
        """The sampled token and the ``logprobs`` best (the engine may hold more, asked for
        ``prompt_logprobs``), keyed by token text: where two tokens read the same, the
        sampled one keeps its logprob."""
        top: dict[str, float] = {}
        for token, logprob in [(token_id, entry[token_id]), *best(entry, self.top_n)]:
            top.setdefault(self.ctx.token_text(token, self.as_id), logprob)
        return top


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    ctx.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    prompts = prompt_list(req.prompt)
    echo_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    engine_n = merged_logprobs(echo_logprobs, req.prompt_logprobs)
    params = sampling_params(req, req.max_tokens, req.logprobs, prompt_logprobs=engine_n)
    request_id = ctx.request_id(req, raw, "cmpl")
    group = await ctx.start(request_id, prompts, params, stream=req.stream, req=req)
    if req.stream:
        return StreamingResponse(
            sse_stream(_stream_events(ctx, req, group, request_id), group, offload=req.logprobs is not None),
            media_type="text/event-stream",
        )
    finals = await group.final_outputs(raw)

    def response() -> CompletionResponse:
        choices = [
            _choice(ctx, req, out, c, i * req.n + c.index, engine_n)
            for i, out in enumerate(finals)
            for c in out.outputs
        ]
        return CompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=ctx.final_usage(finals))

    return await json_response(response)


@dataclass
class _Echo:
    """The prompt as echoed in front of a choice: text, ids, and logprob entries."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    entries: list[Logprobs | None] = field(default_factory=list)


def _echo(
    ctx: ServingContext, req: CompletionRequest, out: RequestOutput, prompt_logprobs: list[Logprobs | None] | None
) -> _Echo:
    if not req.echo:
        return _Echo()
    text = out.prompt
    if text is None:
        text = ctx.tokenizer.decode(out.prompt_token_ids) if ctx.tokenizer is not None else ""
    entries = prompt_logprobs or [None] * len(out.prompt_token_ids)
    return _Echo(text, list(out.prompt_token_ids), list(entries))


def _choice(
    ctx: ServingContext,
    req: CompletionRequest,
    out: RequestOutput,
    c: CompletionOutput,
    index: int,
    engine_n: int | None,
) -> CompletionChoice:
    echo = _echo(ctx, req, out, out.prompt_logprobs)
    logprobs = None
    if req.logprobs is not None:
        logprobs = _LogprobsBuilder(ctx, req).build(echo.token_ids + c.token_ids, [*echo.entries, *(c.logprobs or [])])
    ids = req.return_token_ids
    return CompletionChoice(
        index=index,
        text=echo.text + c.text,
        logprobs=logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        prompt_logprobs=ctx.prompt_logprobs(req, out.prompt_token_ids, out.prompt_logprobs, engine_n),
        prompt_token_ids=list(out.prompt_token_ids) if ids else None,
        token_ids=list(c.token_ids) if ids else None,
    )


class _PromptState:
    """What one prompt of a stream has shown so far: its echo and prompt token ids (sent
    with each choice's first chunk, once the prompt logprobs are all in), each choice's
    logprobs offsets, and its share of the usage."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, out: RequestOutput) -> None:
        self.started = [False] * req.n
        self.logprobs = [_LogprobsBuilder(ctx, req) for _ in range(req.n)]
        self.prompt_logprobs: list[Logprobs | None] = []
        self.num_prompt_tokens = len(out.prompt_token_ids)
        self.num_cached_tokens = 0
        self.completion_tokens = 0


def _usage_so_far(ctx: ServingContext, prompts: dict[int, _PromptState]) -> UsageInfo:
    states = prompts.values()
    return ctx.usage(
        sum(p.num_prompt_tokens for p in states),
        sum(p.completion_tokens for p in states),
        sum(p.num_cached_tokens for p in states),
    )


async def _stream_events(
    ctx: ServingContext, req: CompletionRequest, group: RequestGroup, request_id: str
) -> AsyncIterator[CompletionResponse]:
    """One chunk per choice whenever it has new text or tokens, or finishes (the engine's
    outputs are deltas: each carries only what is new)."""
    created = now_seconds()
    prompts: dict[int, _PromptState] = {}
    final_usage, continuous_usage = ctx.stream_usage(req)

    def chunk(choice: CompletionChoice) -> CompletionResponse:
        usage = _usage_so_far(ctx, prompts) if continuous_usage else None
        return CompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=[choice], usage=usage)

    async for i, out in group.outputs():
        state = prompts.get(i)
        if state is None:
            state = prompts[i] = _PromptState(ctx, req, out)
        state.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs:
            state.prompt_logprobs.extend(out.prompt_logprobs)
        for c in out.outputs:
            echo = _Echo()
            first = not state.started[c.index]
            if first:
                state.started[c.index] = True
                echo = _echo(ctx, req, out, state.prompt_logprobs)
            state.completion_tokens += len(c.token_ids)
            logprobs = None
            if req.logprobs is not None:
                logprobs = await off_loop(
                    True, state.logprobs[c.index].build, echo.token_ids + c.token_ids, echo.entries + (c.logprobs or [])
                )
            ids = req.return_token_ids
            yield chunk(
                CompletionChoice(
                    index=i * req.n + c.index,
                    text=echo.text + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_token_ids=list(out.prompt_token_ids) if ids and first else None,
                    token_ids=list(c.token_ids) if ids else None,
                )
            )
    if final_usage:
        yield CompletionResponse(
            id=request_id, created=created, model=ctx.model_name, choices=[], usage=_usage_so_far(ctx, prompts)
        )
