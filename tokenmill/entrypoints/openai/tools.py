"""What a chat request's tools change: the tools its chat template lists, the parser that reads
calls out of its reply, and, for ``tool_choice`` "required" or a named function, the grammar
that lets the reply be calls and nothing else.

A forced call is written in the parser's own syntax, as the model writes calls unforced (for
``hermes``: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``), so one parser
reads every reply and a stream looks the same either way. The grammar is xgrammar's EBNF, built
from a structural tag whose tags are the calls: the name is fixed text, the arguments follow the
function's ``parameters`` schema as compact JSON (as the engine's JSON outputs are).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, ChatTool
from tokenmill.entrypoints.openai.serving import ServingOptions
from tokenmill.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser
from tokenmill.layers.grammar_mask import grammar_error_reason

NO_PARAMETERS = {"type": "object", "properties": {}}  # what a function without parameters takes: {}


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools, as its template, its parser and its constraint see them."""

    template_tools: list[dict[str, Any]] | None = None
    parser: type[ToolParser] | None = None  # None: the reply is content only
    names: tuple[str, ...] = ()  # the functions the parser takes calls of
    grammar: str | None = None  # EBNF that forces calls

    def reader(self) -> ToolParser | None:
        """A fresh parser for one reply (a choice), if calls are read."""
        return None if self.parser is None else self.parser(self.names)


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """Tools as transformers hands them to chat templates; unset fields left out."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def plan_tools(req: ChatCompletionRequest, options: ServingOptions) -> ToolPlan:
    """The plan for ``req`` under the server's options, or an APIError naming what is wrong. As
    in OpenAI and vLLM, an unset ``tool_choice`` is "auto" with tools and "none" without, and
    "auto" or "required" with an empty list of tools is "none"."""
    choice = req.tool_choice if req.tool_choice is not None else "auto" if req.tools else "none"
    if choice != "none" and req.tools is None:
        raise APIError(
            400,
            "tool_choice needs tools: give the functions the model may call",
            param="tool_choice",
            code="invalid_value",
        )
    tools = req.tools or []
    names = [tool.function.name for tool in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(
                400, f"two tools are named {name!r}", param=f"tools[{i}].function.name", code="invalid_value"
            )
    schemas = [json.dumps(tool.function.parameters or NO_PARAMETERS) for tool in tools]
    for i, schema in enumerate(schemas):
        try:
            _arguments_grammar(schema)
        except ValueError as exc:
            raise APIError(
                400,
                f"tools[{i}].function.parameters is not a JSON schema that can be followed: {exc}",
                param=f"tools[{i}].function.parameters",
                code="invalid_value",
            ) from None
    listed = None if choice == "none" and options.exclude_tools_when_tool_choice_none else template_tools(tools)
    if choice == "none" or (choice in ("auto", "required") and not tools):
        return ToolPlan(template_tools=listed)
    parser = TOOL_PARSERS[options.tool_call_parser]
    if choice == "auto":
        if not options.enable_auto_tool_choice:
            raise APIError(
                400,
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                '(tool_choice "required" or a named function works without it)',
                param="tool_choice",
                code="invalid_value",
            )
        return ToolPlan(listed, parser, tuple(names))
    if choice == "required":
        forced = tuple(zip(names, schemas))
        parallel = req.parallel_tool_calls is not False
        grammar = forced_calls_grammar(parser, forced, parallel)  # type: ignore[arg-type]  # (a class is Hashable)
        return ToolPlan(listed, parser, tuple(names), grammar)
    name = choice.function.name
    if name not in names:
        raise APIError(
            400,
            f"tool_choice names the function {name!r}, which is not among the tools ({', '.join(names)})",
            param="tool_choice",
            code="invalid_value",
        )
    forced = ((name, schemas[names.index(name)]),)
    grammar = forced_calls_grammar(parser, forced, False)  # type: ignore[arg-type]  # (a class is Hashable)
    return ToolPlan(listed, parser, (name,), grammar)


@functools.lru_cache(maxsize=256)
def _arguments_grammar(schema: str) -> str:
    """EBNF of the JSON objects that ``schema`` (JSON text) allows, compact; a ValueError with
    xgrammar's reason if it cannot be followed."""
    import xgrammar

    try:
        return str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))
    except Exception as exc:
        raise ValueError(grammar_error_reason(exc)) from None


@functools.lru_cache(maxsize=256)
def forced_calls_grammar(parser: type[ToolParser], functions: tuple[tuple[str, str], ...], parallel: bool) -> str:
    """EBNF of replies made of calls of ``functions`` ((name, parameters schema as JSON text)):
    at least one, in the parser's syntax, then more (separated as the parser writes them) only
    if ``parallel``."""
    import xgrammar

    tags = [
        {
            "type": "tag",
            "begin": parser.call_prefix(name),
            "content": {"type": "grammar", "grammar": _arguments_grammar(schema)},
            "end": parser.call_suffix,
        }
        for name, schema in functions
    ]
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": parser.separator,
            "at_least_one": True,
            "stop_after_first": not parallel,
        },
    }
    return str(xgrammar.Grammar.from_structural_tag(json.dumps(tag)))
