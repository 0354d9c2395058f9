"""What tool_choice makes of a chat request (the template's tools, the parser, the forcing
grammar), and the grammar itself: it takes exactly the calls that the parser reads back."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.serving import ServingOptions
from tokenmill.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser
from tokenmill.entrypoints.openai.tools import NO_PARAMETERS, forced_calls_grammar, plan_tools

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "now"}}]
FUNCTIONS = (("weather", json.dumps(CITY)), ("now", json.dumps(NO_PARAMETERS)))
AUTO = ServingOptions(enable_auto_tool_choice=True)


def _plan(options: ServingOptions = AUTO, **fields: Any):
    return plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields), options)


def test_each_choice_plans_template_parser_and_grammar() -> None:
    assert _plan() == _plan(tool_choice="none")
    assert _plan().template_tools is None and _plan().reader() is None
    none = _plan(tools=TOOLS, tool_choice="none")
    assert none.template_tools == TOOLS and none.reader() is None and none.grammar is None
    assert _plan(ServingOptions(enable_auto_tool_choice=True, exclude_tools_when_tool_choice_none=True),
                 tools=TOOLS, tool_choice="none").template_tools is None
    auto = _plan(tools=TOOLS)
    assert auto == _plan(tools=TOOLS, tool_choice="auto") and auto.grammar is None
    assert auto.names == ("weather", "now") and auto.template_tools == TOOLS
    required = _plan(tools=TOOLS, tool_choice="required")
    assert required.grammar == forced_calls_grammar(TOOL_PARSERS["hermes"], FUNCTIONS, True)
    assert _plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).grammar == forced_calls_grammar(
        TOOL_PARSERS["hermes"], FUNCTIONS, False)
    named = _plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert named.names == ("now",) and named.template_tools == TOOLS
    assert named.grammar == forced_calls_grammar(TOOL_PARSERS["hermes"], FUNCTIONS[1:], False)
    assert _plan(tools=[], tool_choice="required") == _plan()  # nothing to call: as "none"


@pytest.mark.parametrize("fields, options, param", [
    ({"tool_choice": "required"}, AUTO, "tool_choice"),
    ({"tools": TOOLS}, ServingOptions(), "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "later"}}}, AUTO, "tool_choice"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "now"}}}, AUTO, "tool_choice"),
    ({"tools": [TOOLS[1], TOOLS[1]], "tool_choice": "none"}, AUTO, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]}, AUTO, "tools[0].function.parameters"),
])
def test_what_is_refused_is_named(fields: dict[str, Any], options: ServingOptions, param: str) -> None:
    with pytest.raises(APIError) as info:
        _plan(options, **fields)
    assert info.value.status == 400 and info.value.param == param


def _accepts(grammar: str, text: str) -> bool:
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo(["a"])).compile_grammar(grammar)
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


@pytest.mark.parametrize("parser", list(TOOL_PARSERS.values()), ids=lambda p: p.name)
def test_the_grammar_takes_the_calls_the_parser_reads(parser: type[ToolParser]) -> None:
    weather = parser.call_prefix("weather") + '{"city": "Oslo"}' + parser.call_suffix
    now = parser.call_prefix("now") + "{}" + parser.call_suffix
    both = weather + parser.separator + now
    parallel, single = (forced_calls_grammar(parser, FUNCTIONS, flag) for flag in (True, False))
    assert _accepts(parallel, both) and _accepts(single, weather) and _accepts(single, now)
    assert not _accepts(single, both)
    assert [(c.name, json.loads(c.arguments)) for c in parser(["weather", "now"]).parse(both).calls] == [
        ("weather", {"city": "Oslo"}), ("now", {})]
    for wrong in ("", "Sure.", parser.call_prefix("weather") + '{"city": "Bergen"}' + parser.call_suffix,
                  parser.call_prefix("now") + '{"x": 1}' + parser.call_suffix,
                  parser.call_prefix("later") + "{}" + parser.call_suffix, weather.replace('": "', '":"')):
        assert not _accepts(parallel, wrong), wrong
