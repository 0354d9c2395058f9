"""``POST /v1/chat/completions``: messages (and tools) through the model's chat template, the
reply whole or streamed as deltas (role, then reasoning, content or tool-call pieces, then
finish_reason). With a reasoning parser (``reasoning_parsers``) the thinking is split off first;
with tools, the rest of the reply is read by the server's tool-call parser (``tool_parsers``),
whole or delta by delta alike."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCall,
    TopLogprob,
    UsageInfo,
    new_tool_call_id,
    now_seconds,
)
from tokenmill.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from tokenmill.entrypoints.openai.serving import (
    RequestGroup,
    ServingContext,
    best,
    json_response,
    off_loop,
    sampling_params,
    sse_stream,
)
from tokenmill.entrypoints.openai.tools import ToolPlan, plan_tools
from tokenmill.outputs import CompletionOutput, Logprobs
from tokenmill.sampling_params import SamplingParams

Thinking = Callable[[], ReasoningParser] | None
"""A fresh reasoning parser for each choice of a request, or None where thinking is not read."""


def _role(req: ChatCompletionRequest) -> str:
    """The reply's role, as vLLM names it: the assistant's when the template opens its turn,
    else the last message's, which the reply continues."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def _echoed(req: ChatCompletionRequest) -> str:
    """With ``echo``, the last message's content goes in front of the reply when its role is
    the reply's own, as vLLM does."""
    last = req.messages[-1]
    if not req.echo or last.role != _role(req):
        return ""
    return last.for_template()["content"]


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """A reply that ends on its own after calling tools says so; one cut short stays "length"."""
    return "tool_calls" if called and reason == "stop" else reason


def _thinking(ctx: ServingContext, prompt_token_ids: list[int], params: SamplingParams) -> Thinking:
    """The server's reasoning parser, set to where this prompt leaves the thinking block. A reply
    that a grammar constrains (structured outputs, forced tool calls) is all content: the grammar
    holds from its first token, so it cannot think."""
    name = ctx.options.reasoning_parser
    if name is None or params.structured_outputs is not None:
        return None
    parser = REASONING_PARSERS[name]
    return functools.partial(parser, parser.prompt_state(ctx.tokenizer, prompt_token_ids))


def _message(
    req: ChatCompletionRequest, tools: ToolPlan, thinking: Thinking, choice: CompletionOutput
) -> ChatResponseMessage:
    """The whole reply: the thinking split off (with a reasoning parser), then content and, with
    a tool parser, the calls read out of the rest. Content is null when the reply thought and
    said nothing after."""
    text, reasoning = choice.text, None
    if thinking is not None:
        split = thinking().parse(text)
        text, reasoning = split.content, split.reasoning
    reader = tools.reader()
    calls: list[ToolCall] = []
    if reader is None:
        content: str | None = _echoed(req) + text
    else:
        reply = reader.parse(text)
        content = _echoed(req) + reply.content if reply.content is not None else _echoed(req) or None
        calls = [ToolCall(function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in reply.calls]
    if reasoning is not None and not content:
        content = None
    shown = reasoning if req.include_reasoning else None
    return ChatResponseMessage(
        role=_role(req), content=content, tool_calls=calls or None, reasoning=shown, reasoning_content=shown
    )


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    ctx.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    tools = plan_tools(req, ctx.options)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(
        req,
        max_tokens,
        (req.top_logprobs or 0) if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
        forced=None if tools.grammar is None else ("tool_choice", {"grammar": tools.grammar}),
    )
    ctx.engine.check_admission(1)
    prompt = await ctx.render_chat(
        req, [m.for_template() for m in req.messages], req.add_special_tokens, tools.template_tools
    )
    thinking = _thinking(ctx, prompt, params)
    request_id = ctx.request_id(req, raw, "chatcmpl")
    group = await ctx.start(request_id, [prompt], params, stream=req.stream, req=req)
    if req.stream:
        return StreamingResponse(
            sse_stream(
                _stream_events(ctx, req, tools, thinking, group, request_id, prompt), group, offload=req.logprobs
            ),
            media_type="text/event-stream",
        )
    [final] = await group.final_outputs(raw)
    ids = req.return_token_ids

    def response() -> ChatCompletionResponse:
        choices = []
        for c in final.outputs:
            message = _message(req, tools, thinking, c)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=_logprobs(ctx, req, c.token_ids, c.logprobs),
                    finish_reason=_finish_reason(c.finish_reason, bool(message.tool_calls)),
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if ids else None,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=ctx.model_name,
            choices=choices,
            usage=ctx.final_usage([final]),
            prompt_logprobs=ctx.prompt_logprobs(
                req, final.prompt_token_ids, final.prompt_logprobs, req.prompt_logprobs
            ),
            prompt_token_ids=list(final.prompt_token_ids) if ids else None,
        )

    return await json_response(response)


def _logprobs(
    ctx: ServingContext, req: ChatCompletionRequest, token_ids: list[int], entries: list[Logprobs] | None
) -> ChatLogprobs | None:
    """The chat format: per token its text, bytes, logprob and the ``top_logprobs`` best
    (-1: every token of the vocabulary)."""
    if not req.logprobs:
        return None
    top_n = req.top_logprobs or 0
    as_id = ctx.tokens_as_ids(req)

    def item(token_id: int, logprob: float) -> TopLogprob:
        text = ctx.token_text(token_id, as_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for token_id, entry in zip(token_ids, entries or []):
        head = item(token_id, entry[token_id])
        content.append(
            ChatTokenLogprob(**head.model_dump(), top_logprobs=[item(t, lp) for t, lp in best(entry, top_n)])
        )
    return ChatLogprobs(content=content)


class _StreamedReply:
    """One choice's reply as it streams, in OpenAI's deltas: thinking (with a reasoning parser),
    then content, or pieces of calls when a tool parser reads them (each call's first piece with
    its id, type and name)."""

    def __init__(self, tools: ToolPlan, thinking: Thinking, include_reasoning: bool) -> None:
        self.reader = tools.reader()
        self.thinker = None if thinking is None else thinking()
        self.include_reasoning = include_reasoning
        self.called = False

    def deltas(self, text: str, last: bool) -> list[DeltaMessage]:
        """The deltas that the reply's next piece of text makes: its thinking first, then the rest."""
        if self.thinker is None:
            return [self._delta(text, last)]
        split = self.thinker.feed(text, last)
        thought = split.reasoning if self.include_reasoning else ""
        ahead = [DeltaMessage(reasoning=thought, reasoning_content=thought)] if thought else []
        return [*ahead, self._delta(split.content, last)]

    def _delta(self, text: str, last: bool) -> DeltaMessage:
        if self.reader is None:
            return DeltaMessage(content=text)
        read = self.reader.feed(text, last)
        calls = [
            DeltaToolCall(
                index=c.index,
                id=new_tool_call_id() if c.name is not None else None,
                type="function" if c.name is not None else None,
                function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
            )
            for c in read.calls
        ]
        self.called = self.called or bool(calls)
        return DeltaMessage(content=read.content if read.content or not calls else None, tool_calls=calls or None)


async def _stream_events(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    tools: ToolPlan,
    thinking: Thinking,
    group: RequestGroup,
    request_id: str,
    prompt_token_ids: list[int],
) -> AsyncIterator[ChatCompletionChunk]:
    """Per choice the role (the first chunk also carries the prompt's ids when asked), the
    echoed content if any, then reasoning, content or tool-call deltas (an engine output's
    reasoning in a chunk of its own, ahead of its content; the first chunk of each output carries
    its logprobs and token ids) and an empty delta with finish_reason."""
    created = now_seconds()
    final_usage, continuous_usage = ctx.stream_usage(req)
    ids = req.return_token_ids
    num_prompt = len(prompt_token_ids)
    completion_tokens = cached_tokens = 0

    def usage() -> UsageInfo:
        return ctx.usage(num_prompt, completion_tokens, cached_tokens)

    def chunk(choice: ChatStreamChoice, prompt_ids: list[int] | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=request_id,
            created=created,
            model=ctx.model_name,
            choices=[choice],
            usage=usage() if continuous_usage else None,
            prompt_token_ids=prompt_ids,
        )

    replies = [_StreamedReply(tools, thinking, req.include_reasoning) for _ in range(req.n)]
    for index in range(req.n):
        yield chunk(
            ChatStreamChoice(index=index, delta=DeltaMessage(role=_role(req), content="")),
            list(prompt_token_ids) if ids and index == 0 else None,
        )
        if _echoed(req):
            yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(content=_echoed(req))))
    async for _, out in group.outputs():  # deltas: each output carries only what is new
        cached_tokens = out.num_cached_tokens
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            reply = replies[c.index]
            deltas = [d for d in reply.deltas(c.text, c.finished) if d.reasoning or d.content or d.tool_calls]
            if not deltas and c.token_ids:
                deltas = [DeltaMessage(content="")]
            for i, delta in enumerate(deltas):
                first = i == 0
                yield chunk(
                    ChatStreamChoice(
                        index=c.index,
                        delta=delta,
                        logprobs=await off_loop(req.logprobs, _logprobs, ctx, req, c.token_ids, c.logprobs)
                        if first
                        else None,
                        token_ids=list(c.token_ids) if ids and first else None,
                    )
                )
            if c.finished:
                yield chunk(
                    ChatStreamChoice(
                        index=c.index, delta=DeltaMessage(), finish_reason=_finish_reason(c.finish_reason, reply.called)
                    )
                )
    if final_usage:
        yield ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name, choices=[], usage=usage())
