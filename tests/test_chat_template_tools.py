"""The embedded model's chat template with tools: plain chats render as the model was trained,
tools are listed in the system turn, assistant tool calls and tool results are written in the
Hermes style that the server's ``hermes`` parser reads back."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.default_model import DEFAULT_MODEL_DIR
from tokenmill.tokenizer import ChatOptions, load_tokenizer, render_chat

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(DEFAULT_MODEL_DIR)


def _trained_format(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """How the training transcripts were written (docs/DEFAULT_MODEL.md)."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


@settings(max_examples=60, deadline=None)
@given(messages=st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": st.text(max_size=20)}), min_size=1, max_size=4),
       add_generation_prompt=st.booleans())
def test_plain_chats_render_as_trained(tokenizer: Any, messages: list[dict[str, str]],
                                       add_generation_prompt: bool) -> None:
    options = ChatOptions(add_generation_prompt=add_generation_prompt)
    assert render_chat(tokenizer, messages, options) == _trained_format(messages, add_generation_prompt)


def _turns(text: str) -> list[tuple[str, str]]:
    return re.findall(r"<\|(system|user|assistant)\|>\n(.*?)<\|end\|>\n", text, re.S)


def _tags(text: str, tag: str) -> list[str]:
    return re.findall(rf"<{tag}>\n(.*?)\n</{tag}>", text, re.S)


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_tools_are_listed_in_the_system_turn(tokenizer: Any, system: str | None) -> None:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "hi"}]
    text = render_chat(tokenizer, messages, ChatOptions(tools=[WEATHER, CLOCK]))
    turns = _turns(text)
    assert [role for role, _ in turns] == ["system", "user"]
    assert turns[0][1].startswith(system or "# Tools")
    [listing] = re.findall(r"<tools>\n(.*?)</tools>", turns[0][1], re.S)
    assert [json.loads(line) for line in listing.splitlines()] == [WEATHER["function"], CLOCK["function"]]
    assert text.endswith("<|user|>\nhi<|end|>\n<|assistant|>\n")


def test_tool_calls_and_results_are_written_as_tags(tokenizer: Any) -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}]
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 4}'},
                {"role": "tool", "tool_call_id": "call_2", "content": "09:30"},
                {"role": "assistant", "content": "Cold."}]
    turns = _turns(render_chat(tokenizer, messages, ChatOptions(tools=[WEATHER, CLOCK], add_generation_prompt=False)))
    assert [role for role, _ in turns] == ["system", "user", "assistant", "user", "assistant"]
    written = [json.loads(block) for block in _tags(turns[2][1], "tool_call")]
    # Arguments sent as JSON text are written as the object, not as a quoted string.
    assert written == [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments": {}}]
    assert _tags(turns[3][1], "tool_response") == ['{"celsius": 4}', "09:30"]
    assert turns[4][1] == "Cold."


def test_an_assistant_message_with_content_and_calls(tokenizer: Any) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    text = render_chat(tokenizer, [{"role": "user", "content": "time?"},
                                   {"role": "assistant", "content": "Let me look.", "tool_calls": [call]}],
                       ChatOptions(add_generation_prompt=False))
    assert text.endswith('<|assistant|>\nLet me look.\n<tool_call>\n{"name": "now", "arguments": {}}\n'
                         "</tool_call><|end|>\n")


def test_template_kwargs_may_bring_the_tools(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert (render_chat(tokenizer, messages, ChatOptions(chat_template_kwargs={"tools": [CLOCK]}))
            == render_chat(tokenizer, messages, ChatOptions(tools=[CLOCK])))
