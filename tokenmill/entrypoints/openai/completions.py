"""``POST /v1/completions``: prompts in (text or token ids, one or many), text out,
whole or streamed, with the legacy logprobs format."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    now_seconds,
    random_id,
)
from tokenmill.entrypoints.openai.serving import (
    RequestGroup,
    ServingContext,
    final_usage,
    sampling_params,
    sse_stream,
    usage_of,
)
from tokenmill.outputs import CompletionOutput, Logprobs, RequestOutput


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts as a list: one string, one list of ids, or a batch of either
    (the schema has refused empty lists already)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


class _LogprobsBuilder:
    """Appends tokens to a CompletionLogprobs, keeping text offsets running across chunks."""

    def __init__(self, ctx: ServingContext, offset: int) -> None:
        self.ctx = ctx
        self.offset = offset

    def build(self, token_ids: list[int], entries: list[Logprobs | None]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries):
            text = self.ctx.token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(entry.get(token_id) if entry else None)
            out.top_logprobs.append(self._top(entry) if entry else None)
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out

    def _top(self, entry: Logprobs) -> dict[str, float]:
        """Keyed by token text: where two tokens read the same, the first (the sampled one,
        which the engine puts first) keeps its logprob."""
        top: dict[str, float] = {}
        for token_id, logprob in entry.items():
            top.setdefault(self.ctx.token_text(token_id), logprob)
        return top


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    ctx.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    prompts = prompt_list(req.prompt)
    echo_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    params = sampling_params(req, req.max_tokens, req.logprobs, prompt_logprobs=echo_logprobs)
    request_id = random_id("cmpl")
    group = await ctx.start(request_id, prompts, params, stream=req.stream)
    if req.stream:
        return StreamingResponse(sse_stream(_stream_events(ctx, req, group, request_id), group),
                                 media_type="text/event-stream")
    finals = await group.final_outputs(raw)
    choices = [_choice(ctx, req, out, c, i * req.n + c.index) for i, out in enumerate(finals) for c in out.outputs]
    response = CompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=final_usage(finals))
    return JSONResponse(response.model_dump())


@dataclass
class _Echo:
    """The prompt as echoed in front of a choice: text, ids, and logprob entries."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    entries: list[Logprobs | None] = field(default_factory=list)


def _echo(ctx: ServingContext, req: CompletionRequest, out: RequestOutput,
          prompt_logprobs: list[Logprobs | None] | None) -> _Echo:
    if not req.echo:
        return _Echo()
    text = out.prompt
    if text is None:
        text = ctx.tokenizer.decode(out.prompt_token_ids) if ctx.tokenizer is not None else ""
    entries = prompt_logprobs or [None] * len(out.prompt_token_ids)
    return _Echo(text, list(out.prompt_token_ids), list(entries))


def _choice(ctx: ServingContext, req: CompletionRequest, out: RequestOutput, c: CompletionOutput,
            index: int) -> CompletionChoice:
    echo = _echo(ctx, req, out, out.prompt_logprobs)
    logprobs = None
    if req.logprobs is not None:
        logprobs = _LogprobsBuilder(ctx, 0).build(echo.token_ids + c.token_ids, echo.entries + (c.logprobs or []))
    return CompletionChoice(index=index, text=echo.text + c.text, logprobs=logprobs, finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason)


class _PromptState:
    """What one prompt of a stream has shown so far: its echo (sent with each choice's
    first chunk, once the prompt logprobs are all in), each choice's logprobs offsets."""

    def __init__(self, ctx: ServingContext, n: int) -> None:
        self.started = [False] * n
        self.logprobs = [_LogprobsBuilder(ctx, 0) for _ in range(n)]
        self.prompt_logprobs: list[Logprobs | None] = []
        self.num_prompt_tokens = 0
        self.completion_tokens = 0


async def _stream_events(ctx: ServingContext, req: CompletionRequest, group: RequestGroup,
                         request_id: str) -> AsyncIterator[CompletionResponse]:
    """One chunk per choice whenever it has new text or tokens, or finishes (the engine's
    outputs are deltas: each carries only what is new)."""
    created = now_seconds()
    prompts: dict[int, _PromptState] = {}

    def chunk(choice: CompletionChoice) -> CompletionResponse:
        return CompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=[choice])

    async for i, out in group.outputs():
        state = prompts.get(i)
        if state is None:
            state = prompts[i] = _PromptState(ctx, req.n)
            state.num_prompt_tokens = len(out.prompt_token_ids)
        if out.prompt_logprobs:
            state.prompt_logprobs.extend(out.prompt_logprobs)
        for c in out.outputs:
            echo = _Echo()
            if not state.started[c.index]:
                state.started[c.index] = True
                echo = _echo(ctx, req, out, state.prompt_logprobs)
            state.completion_tokens += len(c.token_ids)
            logprobs = None
            if req.logprobs is not None:
                logprobs = state.logprobs[c.index].build(echo.token_ids + c.token_ids,
                                                         echo.entries + (c.logprobs or []))
            yield chunk(CompletionChoice(index=i * req.n + c.index, text=echo.text + c.text, logprobs=logprobs,
                                         finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    if req.stream_options is not None and req.stream_options.include_usage:
        usage = usage_of(sum(p.num_prompt_tokens for p in prompts.values()),
                         sum(p.completion_tokens for p in prompts.values()))
        yield CompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=[], usage=usage)
