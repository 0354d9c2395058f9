"""Tool calls read out of a model's reply, whole or as it streams.

Each model family writes calls in its own syntax. Hermes-style templates (Qwen2.5 and Qwen3,
Hermes, the embedded model) wrap ``{"name": ..., "arguments": {...}}`` in ``<tool_call>`` tags,
anywhere in the reply; Llama 3 opens its reply with ``{"name": ..., "parameters": {...}}``
(after an optional ``<|python_tag|>``), calls chained by ``;``. Either key is read in both.

One incremental reader serves both uses: a whole reply is read as a stream fed at once, so the
deltas of a stream always add up to the whole reply's result, however the text was chunked.
That holds because each decision is taken on the shortest text that settles it:

- a would-be call is a call once its name has been read, is one of the request's tools, and its
  arguments object has opened (or its object has closed without arguments, which means ``{}``);
- before that, as soon as it cannot be one (JSON that ``partial-json-parser`` finds malformed,
  a name that is no offered tool, arguments that are no object), its text is content;
- a call's arguments are the JSON text the model wrote, streamed as it comes. They are left
  unfinished only when the reply is cut short (``max_tokens``), as OpenAI's are;
- a reply cut short before a would-be call is decided (or, in hermes, inside its tags) ends in what
  the parser held back: hermes drops that markup (the model was writing a call), the Llama 3 reader,
  whose calls are bare JSON, gives it as content.

Whitespace between content and a call belongs to neither: a reply of calls alone has no content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from partial_json_parser import MalformedJSON, fix

ARGUMENT_KEYS = ("arguments", "parameters")
_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"\s*")
_PLAIN_IN_STRING = re.compile(r'[^"\\]+')
_PLAIN_OUTSIDE = re.compile(r'[^"{}\[\]]+')


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass
class CallDelta:
    """What a stream learns of one call: its name first (with what of the arguments is read by
    then), then further pieces of its arguments."""

    index: int  # the call's place among the reply's calls
    name: str | None
    arguments: str


@dataclass
class ReplyDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add_arguments(self, index: int, piece: str) -> None:
        if self.calls and self.calls[-1].index == index:
            self.calls[-1].arguments += piece
        elif piece:
            self.calls.append(CallDelta(index, None, piece))


@dataclass(frozen=True)
class ParsedReply:
    content: str | None  # None when the reply is calls alone
    calls: list[FunctionCall]

    @classmethod
    def from_deltas(cls, deltas: Iterable[ReplyDelta]) -> ParsedReply:
        """The reply that a stream's deltas add up to."""
        content = ""
        names: dict[int, str] = {}
        arguments: dict[int, str] = {}
        for delta in deltas:
            content += delta.content
            for call in delta.calls:
                if call.name is not None:
                    names[call.index] = call.name
                arguments[call.index] = arguments.get(call.index, "") + call.arguments
        calls = [FunctionCall(names[i], arguments[i]) for i in sorted(names)]
        return cls(content if content or not calls else None, calls)


def _skip_whitespace(text: str, i: int) -> int:
    match = _WHITESPACE.match(text, i)
    assert match is not None  # it matches the empty string too
    return match.end()


def _well_formed_so_far(text: str) -> bool:
    """Whether ``text`` is JSON or the start of some (partial-json-parser's judgement)."""
    try:
        fix(text)
    except MalformedJSON:
        return False
    return True


def _partial_marker_at_end(text: str, start: int, marker: str) -> int:
    """The length of the longest end of ``text[start:]`` that ``marker`` starts with: text that
    may yet become the marker."""
    for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class _Brackets:
    """Where a JSON object or array that opens at ``start`` closes: its brackets counted and its
    strings skipped, over text that grows between calls."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.i = start
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.end: int | None = None

    def scan(self, text: str) -> int | None:
        while self.end is None and self.i < len(text):
            plain = (_PLAIN_IN_STRING if self.in_string else _PLAIN_OUTSIDE).match(text, self.i)
            if plain and not self.escaped:
                self.i = plain.end()
                continue
            char = text[self.i]
            self.i += 1
            if self.escaped:
                self.escaped = False
            elif self.in_string:
                self.escaped = char == "\\"
                self.in_string = char != '"'
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.i
        return self.end


def _members(text: str, brace: int) -> tuple[list[tuple[str, int, int | None]], int | None]:
    """The members of the object opening at ``brace`` as far as the text holds them, as (key,
    where its value starts, where the value ends or None), up to the first one not complete;
    and where the object ends, if it has. Malformed text just ends the list: ``decide`` judges
    validity apart."""
    members: list[tuple[str, int, int | None]] = []
    i = _skip_whitespace(text, brace + 1)
    if text.startswith("}", i):
        return members, i + 1
    while text.startswith('"', i):
        try:
            key, i = _DECODER.raw_decode(text, i)
        except ValueError:
            break
        i = _skip_whitespace(text, i)
        if not text.startswith(":", i):
            break
        start = _skip_whitespace(text, i + 1)
        if start == len(text):
            break
        try:
            end = _DECODER.raw_decode(text, start)[1]
        except ValueError:
            members.append((key, start, None))
            break
        members.append((key, start, end))
        i = _skip_whitespace(text, end)
        if text.startswith("}", i):
            return members, i + 1
        if not text.startswith(",", i):
            break
        i = _skip_whitespace(text, i + 1)
    return members, None


class _Call:
    """One would-be call, read from the whitespace before its JSON object: undecided, then a
    call or not; a call's arguments and object then close as the text comes."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.name: str | None = None
        self.object: _Brackets | None = None  # set once it is a call
        self.arguments: _Brackets | None = None  # None for a call without arguments
        self.sent = 0  # of the arguments' text

    def decide(self, text: str, names: frozenset[str]) -> bool | None:
        """True: a call; False: none; None: the text does not tell yet. Judged on the text up to
        the point that settles it, so that how the text was chunked cannot change the answer."""
        brace = _skip_whitespace(text, self.start)
        if brace == len(text):
            return None
        if text[brace] != "{":
            return False
        members, closed = _members(text, brace)
        name = name_end = arguments_at = None
        for key, start, end in members:
            if key == "name" and name_end is None:
                if end is None:
                    break
                name, name_end = json.loads(text[start:end]), end
                if not isinstance(name, str) or name not in names:
                    return False
            elif key in ARGUMENT_KEYS and arguments_at is None:
                if text[start] != "{":
                    return False
                arguments_at = start
        settled: int | None
        if name_end is not None and arguments_at is not None:
            settled = max(name_end, arguments_at + 1)
        else:
            settled = closed if name_end is not None else None
        if not _well_formed_so_far(text[brace:settled]):
            return False
        if settled is None:
            return False if closed is not None else None
        self.name = name
        self.object = _Brackets(brace)
        self.arguments = _Brackets(arguments_at) if arguments_at is not None else None
        return True

    def next_arguments(self, text: str) -> str:
        """The arguments' text read since the last call: as written, or ``{}`` once the call's
        object has closed without them."""
        assert self.object is not None
        if self.arguments is None:
            whole = "{}" if self.object.scan(text) is not None else ""
        else:
            whole = text[self.arguments.start : self.arguments.scan(text) or len(text)]
        piece, self.sent = whole[self.sent :], len(whole)
        return piece


class ToolParser:
    """Reads one reply's calls as its text arrives: ``feed`` each new piece, the last marked.
    Subclasses say where calls open (``_open``), where the text goes on after one (``_close``),
    what a refused call's opening becomes (``_refused``), and how a call is written when a
    grammar forces it (``call_prefix``, ``call_suffix``, ``separator``)."""

    name: ClassVar[str]
    call_suffix: ClassVar[str]  # after the arguments object
    separator: ClassVar[str]  # between calls

    def __init__(self, tool_names: Collection[str]) -> None:
        self.names = frozenset(tool_names)
        self.text = ""
        self.pos = 0  # the text before it is settled
        self.call: _Call | None = None
        self.call_at = 0  # where the would-be call's opening text starts
        self.count = 0  # calls so far
        self._held = ""  # the content's trailing whitespace: dropped if a call follows
        self._after_call = False  # content now follows a call: its leading whitespace goes

    @classmethod
    def call_prefix(cls, name: str) -> str:
        """A call of ``name`` as a grammar forces it, up to its arguments object."""
        raise NotImplementedError

    def parse(self, text: str) -> ParsedReply:
        """A whole reply (of a parser that has been fed nothing yet)."""
        return ParsedReply.from_deltas([self.feed(text, last=True)])

    def feed(self, text: str, last: bool = False) -> ReplyDelta:
        """The reply's next piece; ``last`` when the reply ends with it, which settles whatever
        was held back."""
        self.text += text
        out = self._advance(final=last)
        if last:
            out.content += self._held
            self._held = ""
        return out

    def _open(self, final: bool) -> tuple[int, int | None]:
        """From ``pos``: where the text stops being surely content, and where a would-be call's
        JSON object (or the whitespace before it) starts, if one opens there."""
        raise NotImplementedError

    def _close(self, end: int, final: bool) -> int | None:
        """Where the reply goes on after a call whose object ends at ``end``; None while the text
        does not tell yet."""
        raise NotImplementedError

    def _refused(self, out: ReplyDelta) -> None:
        """The would-be call opening at ``call_at`` is none: its text becomes content."""
        raise NotImplementedError

    def _cut_short(self, out: ReplyDelta) -> None:
        """The reply ended in what may have been a call (from ``call_at``, or from ``pos`` where its
        opening was being written) before it could be told from content."""
        raise NotImplementedError

    def _advance(self, final: bool) -> ReplyDelta:
        out = ReplyDelta()
        while True:
            if self.call is None:
                content_end, call_start = self._open(final)
                self._content(out, self.text[self.pos : content_end])
                self.pos = content_end
                if call_start is None:
                    if final and self.pos < len(self.text):
                        self._cut_short(out)
                    return out
                self.call_at, self.call = content_end, _Call(call_start)
            if not self._read_call(out, final):
                return out

    def _read_call(self, out: ReplyDelta, final: bool) -> bool:
        """Reads on in the would-be call; True once done with it (a finished call, or text that
        is none), so that the reply is read on after it."""
        call = self.call
        assert call is not None
        if call.object is None:
            decided = call.decide(self.text, self.names)
            if decided is None:
                if not final:
                    return False
                self.call = None
                self._cut_short(out)
                return True
            if not decided:
                self.call = None
                self._refused(out)
                return True
            self._held = ""
            out.calls.append(CallDelta(self.count, call.name, ""))
        assert call.object is not None
        end = call.object.scan(self.text)
        out.add_arguments(self.count, call.next_arguments(self.text))
        resume = None if end is None else self._close(end, final)
        if resume is None:
            return False
        self.pos, self.call, self.count, self._after_call = resume, None, self.count + 1, True
        return True

    def _content(self, out: ReplyDelta, piece: str) -> None:
        if self._after_call:
            piece = piece.lstrip()
            self._after_call = not piece
        held = self._held + piece
        text = held.rstrip()
        out.content += text
        self._held = held[len(text) :]


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the reply (the
    closing tag may be missing at its end)."""

    name = "hermes"
    OPENER = "<tool_call>"
    CLOSER = "</tool_call>"
    call_suffix = "}\n" + CLOSER
    separator = "\n"

    @classmethod
    def call_prefix(cls, name: str) -> str:
        return f'{cls.OPENER}\n{{"name": {json.dumps(name)}, "arguments": '

    def _open(self, final: bool) -> tuple[int, int | None]:
        at = self.text.find(self.OPENER, self.pos)
        if at < 0:
            return len(self.text) - _partial_marker_at_end(self.text, self.pos, self.OPENER), None
        return at, at + len(self.OPENER)

    def _close(self, end: int, final: bool) -> int | None:
        at = _skip_whitespace(self.text, end)
        if self.text.startswith(self.CLOSER, at):
            return at + len(self.CLOSER)
        if self.CLOSER.startswith(self.text[at:]):  # the closing tag still to come, or cut short
            return len(self.text) if final else None
        return end

    def _refused(self, out: ReplyDelta) -> None:
        self.pos = self.call_at + len(self.OPENER)
        self._content(out, self.OPENER)

    def _cut_short(self, out: ReplyDelta) -> None:
        """Tags are markup whatever follows them: a reply cut short (``max_tokens``) in a call's
        opening tag or in a call not decided yet shows none of it, nor the whitespace before it."""
        self.pos, self._held = len(self.text), ""


class Llama3JsonToolParser(ToolParser):
    """Llama 3's JSON calls: ``{"name": ..., "parameters": {...}}`` opening the reply (after an
    optional ``<|python_tag|>``), further calls after ``;``. A reply that opens otherwise is
    content, and so is the text after the last call."""

    name = "llama3_json"
    LEAD = "<|python_tag|>"
    call_suffix = "}"
    separator = "; "

    def __init__(self, tool_names: Collection[str]) -> None:
        super().__init__(tool_names)
        self.more = True  # whether calls may still come

    @classmethod
    def call_prefix(cls, name: str) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": '

    def _open(self, final: bool) -> tuple[int, int | None]:
        if not self.more:
            return len(self.text), None
        at = _skip_whitespace(self.text, self.pos)
        rest = self.text[at:]
        if self.count == 0:
            if rest.startswith(self.LEAD):
                return self.pos, at + len(self.LEAD)
            if not final and self.LEAD.startswith(rest):
                return self.pos, None
            return self.pos, at
        if rest.startswith(";"):
            return self.pos, at + 1
        if not final and not rest:
            return self.pos, None
        self.more = False
        return len(self.text), None

    def _close(self, end: int, final: bool) -> int | None:
        return end

    def _refused(self, out: ReplyDelta) -> None:
        self.pos, self.more = self.call_at, False

    def _cut_short(self, out: ReplyDelta) -> None:
        """A reply that opens as a call may be plain JSON: unfinished, it is content."""
        self._refused(out)


TOOL_PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser)}
