"""``POST /v1/chat/completions``: messages through the model's chat template, the reply
whole or streamed as deltas (role, then content, then finish_reason)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
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
from tokenmill.outputs import Logprobs


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    ctx.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    ctx.engine.check_admission(1)
    try:  # the template decides which roles and contents it takes
        prompt = await ctx.engine.render_chat([m.for_template() for m in req.messages])
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages", code="invalid_value") from exc
    request_id = random_id("chatcmpl")
    group = await ctx.start(request_id, [prompt], params, stream=req.stream)
    if req.stream:
        return StreamingResponse(sse_stream(_stream_events(ctx, req, group, request_id), group),
                                 media_type="text/event-stream")
    [final] = await group.final_outputs(raw)
    choices = [
        ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                   logprobs=_logprobs(ctx, req, c.token_ids, c.logprobs), finish_reason=c.finish_reason,
                   stop_reason=c.stop_reason)
        for c in final.outputs
    ]
    response = ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices,
                                      usage=final_usage([final]))
    return JSONResponse(response.model_dump())


def _logprobs(ctx: ServingContext, req: ChatCompletionRequest, token_ids: list[int],
              entries: list[Logprobs] | None) -> ChatLogprobs | None:
    """The chat format: per token its text, bytes, logprob and the ``top_logprobs`` best."""
    if not req.logprobs:
        return None
    top_n = req.top_logprobs or 0

    def item(token_id: int, logprob: float) -> TopLogprob:
        text = ctx.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for token_id, entry in zip(token_ids, entries or []):
        best = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
        head = item(token_id, entry[token_id])
        content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=[item(t, lp) for t, lp in best]))
    return ChatLogprobs(content=content)


async def _stream_events(ctx: ServingContext, req: ChatCompletionRequest, group: RequestGroup,
                         request_id: str) -> AsyncIterator[ChatCompletionChunk]:
    created = now_seconds()

    def chunk(index: int, delta: DeltaMessage, logprobs: ChatLogprobs | None = None,
              finish_reason: str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name, choices=[
            ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)])

    for index in range(req.n):
        yield chunk(index, DeltaMessage(role="assistant", content=""))
    prompt_tokens = completion_tokens = 0
    async for _, out in group.outputs():  # deltas: each output carries only what is new
        prompt_tokens = len(out.prompt_token_ids)
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            if c.text or c.token_ids:
                yield chunk(c.index, DeltaMessage(content=c.text), _logprobs(ctx, req, c.token_ids, c.logprobs))
            if c.finished:
                yield chunk(c.index, DeltaMessage(), finish_reason=c.finish_reason)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name, choices=[],
                                  usage=usage_of(prompt_tokens, completion_tokens))
