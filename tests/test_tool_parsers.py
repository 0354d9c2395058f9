"""The tool-call parsers: any text is read without error, however it is chunked the stream adds
up to the whole reply's reading, well-formed calls come back as written, and the embedded
model's template and the ``hermes`` parser agree."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.default_model import DEFAULT_MODEL_DIR
from tokenmill.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    FunctionCall,
    HermesToolParser,
    Llama3JsonToolParser,
    ParsedReply,
    ToolParser,
)
from tokenmill.tokenizer import ChatOptions, load_tokenizer, render_chat

NAMES = ["get_weather", "now", "search"]
PARSERS = list(TOOL_PARSERS.values())

# Pieces that make near-misses likely: markers, JSON punctuation, the keys and names.
FRAGMENTS = st.sampled_from([
    "<tool_call>", "</tool_call>", "<tool_", "<|python_tag|>", "\n", " ", "{", "}", "[", "]", '"', "\\", ":",
    ",", ";", '"name"', '"arguments"', '"parameters"', '"get_weather"', '"now"', '"nope"', "1", "true", '"x"',
    '{"name": "now", "arguments": ', '{"name": "get_weather", "parameters": ', '{"a": [1, {"b": "}"}]}'])
TEXTS = st.lists(st.one_of(FRAGMENTS, st.text(max_size=4)), max_size=30).map("".join)

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
ARGUMENTS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)
CALLS = st.lists(st.tuples(st.sampled_from(NAMES), ARGUMENTS), min_size=1, max_size=3)
JSON_STYLES = st.sampled_from([{}, {"indent": 2}, {"separators": (",", ":")}, {"ensure_ascii": False}])


def _chunked(parser: ToolParser, text: str, cuts: list[int]) -> ParsedReply:
    """The reply read as a stream cut at ``cuts``, checking the shape of every delta."""
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.feed("", last=True)]
    named: list[int] = []
    for delta in deltas:
        for call in delta.calls:
            if call.name is not None:  # a call's first delta names it, in order
                assert call.index == len(named)
                named.append(call.index)
            else:
                assert call.index in named and call.arguments
    return ParsedReply.from_deltas(deltas)


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
@settings(max_examples=300, deadline=None)
@given(text=TEXTS, cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_any_text_reads_the_same_whole_or_streamed(parser: type[ToolParser], text: str, cuts: list[int]) -> None:
    whole = parser(NAMES).parse(text)
    assert _chunked(parser(NAMES), text, cuts) == whole
    assert all(call.name in NAMES for call in whole.calls)
    if not whole.calls:  # no call: the text is content, whitespace and all, but a hermes call cut short at its end
        assert whole.content == text or (parser is HermesToolParser and text.startswith(whole.content)
                                         and _hermes_call_cut_short(text[len(whole.content):])), whole


def _hermes_call_cut_short(tail: str) -> bool:
    """Whether a reply's ``tail`` is a hermes call that the reply's end cut short (and the whitespace
    before it): its opening tag not whole yet, or a call opened and not decided."""
    tail = tail.lstrip()
    opener = HermesToolParser.OPENER
    return bool(tail) and (opener.startswith(tail) or tail.startswith(opener))


def _expected_content(text: str) -> str | None:
    return text or None


@settings(max_examples=150, deadline=None)
@given(before=st.text(max_size=12).filter(lambda t: "<tool_call>" not in t), calls=CALLS,
       between=st.sampled_from(["", "\n", " \n "]), style=JSON_STYLES, closed=st.booleans(),
       cuts=st.lists(st.integers(min_value=0), max_size=6))
def test_hermes_calls_come_back_as_written(before: str, calls: list[tuple[str, dict]], between: str,
                                           style: dict, closed: bool, cuts: list[int]) -> None:
    blocks = [f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, **style)}\n" + ("</tool_call>" if closed else "")
              for n, a in calls]
    text = before + between + between.join(blocks)
    for parsed in (HermesToolParser(NAMES).parse(text), _chunked(HermesToolParser(NAMES), text, cuts)):
        assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
        assert parsed.content == _expected_content(before.rstrip())


@settings(max_examples=150, deadline=None)
@given(calls=CALLS, lead=st.sampled_from(["", "<|python_tag|>", " "]), separator=st.sampled_from([";", "; ", " ;\n"]),
       after=st.text(max_size=12).filter(lambda t: not t.lstrip().startswith(";")), style=JSON_STYLES,
       cuts=st.lists(st.integers(min_value=0), max_size=6))
def test_llama3_calls_come_back_as_written(calls: list[tuple[str, dict]], lead: str, separator: str, after: str,
                                           style: dict, cuts: list[int]) -> None:
    text = lead + separator.join(json.dumps({"name": n, "parameters": a}, **style) for n, a in calls) + after
    for parsed in (Llama3JsonToolParser(NAMES).parse(text), _chunked(Llama3JsonToolParser(NAMES), text, cuts)):
        assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
        assert parsed.content == _expected_content(after.lstrip())


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_a_reply_cut_short_keeps_its_call_with_the_arguments_so_far(parser: type[ToolParser]) -> None:
    text = parser.call_prefix("get_weather") + '{"city": "Par'
    assert [(c.name, c.arguments) for c in parser(NAMES).parse(text).calls] == [("get_weather", '{"city": "Par')]


@pytest.mark.parametrize("reply, content", [
    ("Let me check. <tool_", "Let me check."), ("Let me check.\n<", "Let me check."), ("<tool_call", ""),
    ("Let me check. <tool_call>", "Let me check."), ("Let me check.\n<tool_call>\n", "Let me check."),
    ('Sure. <tool_call>\n{"name": "get_wea', "Sure."), ('Sure. <tool_call>\n{"name": "get_weather"', "Sure."),
    ('Sure. <tool_call>\n{"name": "get_weather", "argu', "Sure."),
])
def test_a_hermes_call_cut_short_by_the_end_of_the_reply_is_not_content(reply: str, content: str) -> None:
    """A reply cut short (``max_tokens``) in a call's opening tag, or in a call not yet one, shows none
    of that markup as content, whole or streamed in any pieces."""
    whole = HermesToolParser(NAMES).parse(reply)
    assert whole == ParsedReply(content, [])
    for cut in range(len(reply) + 1):
        assert _chunked(HermesToolParser(NAMES), reply, [cut]) == whole, cut
    assert _chunked(HermesToolParser(NAMES), reply, list(range(len(reply)))) == whole


def test_a_hermes_closing_tag_cut_short_is_not_content() -> None:
    call = '<tool_call>\n{"name": "now", "arguments": {}}\n'
    for cut_short in ("</", "</tool_", "</tool_call"):
        reply = "Done. " + call + cut_short
        whole = HermesToolParser(NAMES).parse(reply)
        assert whole == ParsedReply("Done.", [FunctionCall("now", "{}")]), cut_short
        for cut in range(len(reply) + 1):
            assert _chunked(HermesToolParser(NAMES), reply, [cut]) == whole, (cut_short, cut)


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
@pytest.mark.parametrize("name, arguments", [("get_weather", '"a string"'), ("get_weather", "[1]"),
                                             ("unknown_tool", "{}"), ("get_weather", ': {}, "x": {}')])
def test_what_cannot_be_a_call_is_content(parser: type[ToolParser], name: str, arguments: str) -> None:
    text = parser.call_prefix(name) + arguments + parser.call_suffix
    assert parser(NAMES).parse(text) == ParsedReply(text, [])


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_a_call_without_arguments_has_an_empty_object(parser: type[ToolParser]) -> None:
    prefix = parser.call_prefix("now")
    text = prefix[:prefix.index(', "')] + parser.call_suffix  # {"name": "now"} in the parser's syntax
    [call] = parser(NAMES).parse(text).calls
    assert (call.name, call.arguments) == ("now", "{}")


@settings(max_examples=40, deadline=None)
@given(calls=CALLS, content=st.sampled_from(["", "Checking."]))
def test_the_embedded_template_and_the_hermes_parser_agree(tokenizer: Any, calls: list[tuple[str, dict]],
                                                           content: str) -> None:
    message = {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)]}
    text = render_chat(tokenizer, [message], ChatOptions(add_generation_prompt=False))
    reply = text.removeprefix("<|assistant|>\n").removesuffix("<|end|>\n")
    parsed = HermesToolParser(NAMES).parse(reply)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert parsed.content == (content or None)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(DEFAULT_MODEL_DIR)
