"""``POST /tokenize`` and ``POST /detokenize``, vLLM's extensions (outside ``/v1``): the
token ids the model would be fed for a prompt or a conversation, and the text of ids.

A body with ``messages`` is the chat form, rendered exactly as a chat request is; one
with ``prompt`` the completion form. vLLM declares the two as a union of two models; one
model with both fields takes the same bodies and keeps error paths free of union tags.
Tokenizing and decoding run in a worker thread, so a long prompt does not hold up the
streams that the event loop serves meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import ChatMessage, ChatTool, RequestModel, Text, TokenId
from tokenmill.entrypoints.openai.serving import ServingContext
from tokenmill.entrypoints.openai.tools import template_tools
from tokenmill.tokenizer import encode_prompt

T = TypeVar("T")


class TokenizeRequest(RequestModel):
    """Unknown fields are ignored, as in the other endpoints; those of the chat form are
    ignored in the completion form too."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool | None = None
    """Default: true for a prompt; false for messages, whose template holds the special tokens it wants."""
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[Text, Any] | None = None
    tools: list[ChatTool] | None = None  # listed by the template, as in a chat request
    return_token_strs: StrictBool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


async def _in_thread(func: Callable[..., T], *args: Any) -> T:
    """One path for every size: the thread hop costs microseconds, a long prompt on the loop far more."""
    return await asyncio.get_running_loop().run_in_executor(None, func, *args)


def _tokenizer(ctx: ServingContext) -> Any:
    if ctx.tokenizer is None:
        raise APIError(400, "this model has no tokenizer: it takes and returns token ids only")
    return ctx.tokenizer


async def _ids(ctx: ServingContext, req: TokenizeRequest) -> list[int]:
    if req.messages is not None:  # without extra special tokens, the very ids a chat request feeds the model
        return await ctx.render_chat(
            req, [m.for_template() for m in req.messages], req.add_special_tokens is True, template_tools(req.tools)
        )
    if req.prompt is None:
        raise APIError(
            400,
            "give either prompt (the completion form) or messages (the chat form)",
            param="prompt",
            code="invalid_value",
        )
    add_special_tokens = req.add_special_tokens is not False
    return await _in_thread(encode_prompt, _tokenizer(ctx), req.prompt, add_special_tokens)


async def tokenize(ctx: ServingContext, req: TokenizeRequest) -> TokenizeResponse:
    """No length check: the client learns ``count`` and ``max_model_len`` and decides, as in vLLM."""
    ctx.check_model(req.model)
    ids = await _ids(ctx, req)
    strs = await _in_thread(_tokenizer(ctx).convert_ids_to_tokens, ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.engine.max_model_len, tokens=ids, token_strs=strs)


async def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> DetokenizeResponse:
    ctx.check_model(req.model)
    vocab_size = ctx.engine.vocab_size
    for i, token in enumerate(req.tokens):
        if token >= vocab_size:
            raise APIError(
                400,
                f"tokens[{i}]: {token} is outside the vocabulary (size {vocab_size})",
                param="tokens",
                code="invalid_value",
            )
    return DetokenizeResponse(prompt=await _in_thread(_tokenizer(ctx).decode, req.tokens))
