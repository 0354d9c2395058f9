"""Tool calling in chat, through the official client: forced calls that follow their schemas, calls
read out of free replies, streams that add up to the whole reply, the tools in the template, and
the server's options. The server of this module has room (512 tokens) for the tools in the prompt
and a forced call however oddly it is tokenized (one character per token)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tokenmill.entrypoints.openai.serving import ServingContext, ServingOptions

from .conftest import MODEL_NAME, LiveServer, live_server, small_engine_config

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
SCHEMAS = {"get_weather": WEATHER, "now": {"type": "object", "properties": {}, "additionalProperties": False}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
CALL_TOKENS = 128  # at most the characters of a forced call: 95 of syntax, the city's 8 in up to 32 bytes
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'


AUTO = ServingOptions(enable_auto_tool_choice=True)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[LiveServer]:
    config = dataclasses.replace(small_engine_config(model_dir), max_model_len=512)
    with live_server(config, options=AUTO) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture()
def options(server: LiveServer) -> Iterator[ServingContext]:
    """The server's context, whose options a test may switch; they are put back after it."""
    ctx: ServingContext = server.app.state.serving
    yield ctx
    ctx.options = AUTO


def _check_calls(message: Any) -> list[tuple[str, dict]]:
    """Every call names an offered function and its arguments validate against its parameters."""
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


@pytest.mark.parametrize("seed", [1, 2])
def test_required_yields_valid_calls(client: openai.OpenAI, seed: int) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, temperature=1.0, seed=seed, n=3,
                                         max_tokens=CALL_TOKENS)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(_check_calls(choice.message)) == 1


def test_a_named_function_is_called(client: openai.OpenAI) -> None:
    for seed in (3, 4):
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, n=2, max_tokens=CALL_TOKENS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls"
            assert [name for name, _ in _check_calls(choice.message)] == ["get_weather"]


def _streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str | None, list[tuple[str, str, str]], str | None]:
    """A stream's content, calls as (id, name, arguments) and finish_reason, from its deltas."""
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(model=MODEL_NAME, stream=True, **kwargs):
        [choice] = chunk.choices
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for call in choice.delta.tool_calls or []:
            if call.id is not None:  # the first delta of a call
                assert call.index == len(calls) and call.type == "function" and call.function.name
                calls[call.index] = [call.id, call.function.name, call.function.arguments or ""]
            else:
                assert call.function.name is None
                calls[call.index][2] += call.function.arguments
        finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


@pytest.mark.parametrize("kwargs, called", [
    ({"tool_choice": "required", "temperature": 1.0, "seed": 5}, True),
    ({"tool_choice": "auto", "extra_body": {"guided_choice": ["Checking.\n" + CALL_TEXT]}}, True),
    ({"tool_choice": "required", "temperature": 1.0, "seed": 6, "max_tokens": 30}, False),  # perhaps cut short
], ids=["required", "auto", "cut-short"])
def test_streamed_calls_add_up_to_the_whole_reply(client: openai.OpenAI, kwargs: dict[str, Any],
                                                  called: bool) -> None:
    kwargs = {"max_tokens": CALL_TOKENS, **kwargs}
    whole = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, **kwargs).choices[0]
    content, calls, finish = _streamed(client, messages=ASK, tools=TOOLS, **kwargs)
    assert bool(whole.message.tool_calls) >= called
    assert content == whole.message.content
    assert [(name, arguments) for _, name, arguments in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert all(call_id.startswith("call_") for call_id, _, _ in calls)
    assert finish == whole.finish_reason


def test_auto_reads_calls_out_of_a_free_reply(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=CALL_TOKENS,
                                         extra_body={"guided_choice": ["Checking.\n" + CALL_TEXT]}).choices[0]
    assert out.message.content == "Checking." and out.finish_reason == "tool_calls"
    assert _check_calls(out.message) == [("get_weather", {"city": "Oslo", "unit": "C"})]


def test_a_reply_without_calls_is_left_as_it_is(client: openai.OpenAI) -> None:
    replies = [client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=choice,
                                              max_tokens=12, temperature=0).choices[0] for choice in ("none", "auto")]
    if "<tool_call>" not in replies[0].message.content:
        assert replies[1].message.content == replies[0].message.content and not replies[1].message.tool_calls
        assert replies[1].finish_reason == replies[0].finish_reason


def test_none_reads_no_calls(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="none",
                                         max_tokens=CALL_TOKENS, extra_body={"guided_choice": [CALL_TEXT]}).choices[0]
    assert out.message.content == CALL_TEXT and not out.message.tool_calls and out.finish_reason == "stop"


def _prompt_tokens(client: openai.OpenAI, **kwargs: Any) -> int:
    return client.chat.completions.create(model=MODEL_NAME, max_tokens=1, **kwargs).usage.prompt_tokens


def test_the_template_lists_the_tools(client: openai.OpenAI, options: ServingContext) -> None:
    """Listed with tool_choice "none" too, as vLLM does, unless the server is told otherwise."""
    plain = _prompt_tokens(client, messages=ASK)
    listed = _prompt_tokens(client, messages=ASK, tools=TOOLS, tool_choice="none")
    assert listed > plain
    assert _prompt_tokens(client, messages=ASK, tools=TOOLS, tool_choice="required") == listed
    options.options = ServingOptions(enable_auto_tool_choice=True, exclude_tools_when_tool_choice_none=True)
    assert _prompt_tokens(client, messages=ASK, tools=TOOLS, tool_choice="none") == plain


def test_a_conversation_with_calls_and_results(client: openai.OpenAI, server: LiveServer) -> None:
    """Earlier calls and their results reach the template; /tokenize renders them alike."""
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 4}'}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="none",
                                         max_tokens=4)
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert tokens["count"] == out.usage.prompt_tokens
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}' in text
    assert '<tool_response>\n{"temperature": 4}\n</tool_response>' in text


def test_auto_needs_the_server_option(client: openai.OpenAI, options: ServingContext) -> None:
    """As in vLLM: tools alone mean tool_choice "auto", which the server must allow."""
    options.options = ServingOptions()
    for kwargs in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=2, **kwargs)
        assert info.value.param == "tool_choice" and "--enable-auto-tool-choice" in info.value.message
    out = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                         max_tokens=CALL_TOKENS, parallel_tool_calls=False)
    assert len(_check_calls(out.choices[0].message)) == 1


def test_the_llama3_json_parser(client: openai.OpenAI, options: ServingContext) -> None:
    """Forced calls are written, and free replies read, in the server's parser's syntax."""
    options.options = ServingOptions(enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    forced = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=1.0, seed=7,
                                            max_tokens=CALL_TOKENS, tool_choice="required").choices[0]
    assert forced.finish_reason == "tool_calls" and _check_calls(forced.message)
    free = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=CALL_TOKENS,
        extra_body={"guided_choice": ['{"name": "now", "parameters": {}}; {"name": "now", "parameters": {}}']})
    assert _check_calls(free.choices[0].message) == [("now", {}), ("now", {})]
    assert free.choices[0].message.content is None
