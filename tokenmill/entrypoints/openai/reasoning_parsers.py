"""A reasoning model's thinking read out of its chat reply, whole or as it streams.

Qwen3 and DeepSeek-R1 think inside ``<think>`` ... ``</think>`` before they answer; the server's
``--reasoning-parser`` (vLLM's names: ``qwen3``, ``deepseek_r1``) splits the reply into the
thinking (``message.reasoning``) and the answer (``message.content``).

Where the reply starts is read from the prompt's token ids, not guessed from the reply: a
template may open the block itself (DeepSeek-R1's, Qwen3's thinking-only models: the prompt
ends in ``<think>``), close it empty (Qwen3's ``enable_thinking: false``: ``<think></think>``
and whitespace end the prompt), or leave it to the model. The two formats differ only in that
last case: a Qwen3 reply thinks only if it opens with ``<think>``, a DeepSeek-R1 reply always
thinks first (its older templates leave the opening tag to the model, which may not write it).

One incremental reader serves both uses, as ``tool_parsers`` does: a whole reply is read as a
stream fed at once, so a stream's pieces always add up to the whole reply's split, however the
text was chunked, a marker cut in two included. The reader holds back only text that may still
become a marker. A block that never closes (``max_tokens``) is reasoning to its end; the
whitespace between ``</think>`` and the answer belongs to neither.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


class PromptState(enum.Enum):
    """Where the prompt leaves the thinking block."""

    NONE = "none"  # no block open or just closed: the model decides
    OPEN = "open"  # the prompt opened it: the reply starts inside it
    CLOSED = "closed"  # the prompt opened and closed it (thinking off): the reply is the answer


_TAIL_TOKENS = 8
"""A closing tag ends the prompt's thinking only when nothing but whitespace follows it: a few
tokens (Qwen3 writes ``\\n\\n``); a longer tail is an earlier turn's."""


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True)
class ParsedReasoning:
    reasoning: str | None  # None when the reply did not think (or thought nothing)
    content: str  # the answer, "" when there is none

    @classmethod
    def from_deltas(cls, deltas: Iterable[ReasoningDelta]) -> ParsedReasoning:
        """The split that a stream's deltas add up to."""
        reasoning = content = ""
        for delta in deltas:
            reasoning += delta.reasoning
            content += delta.content
        return cls(reasoning or None, content)


class _Mode(enum.Enum):
    OPENING = "opening"  # the reply may still open the block (leading whitespace, then <think>)
    REASONING = "reasoning"
    CONTENT = "content"


def _partial_marker_at_end(text: str, start: int, marker: str) -> int:
    """The length of the longest end of ``text[start:]`` that ``marker`` starts with."""
    for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    """Reads one reply's thinking and answer as its text arrives: ``feed`` each new piece, the
    last marked. Subclasses name the markers and say what a reply that does not open the block
    is (``thinks_unopened``)."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    thinks_unopened: ClassVar[bool]  # a reply after a prompt that left the block alone thinks anyway

    def __init__(self, state: PromptState) -> None:
        self.text = ""
        self.pos = 0  # the text before it is settled
        self.mode = _Mode.CONTENT if state is PromptState.CLOSED else _Mode.OPENING
        self.opened = state is PromptState.OPEN or self.thinks_unopened  # what OPENING falls back to
        self._strip = state is PromptState.CLOSED  # the answer's leading whitespace (after </think>) is dropped

    @classmethod
    def check_tokenizer(cls, tokenizer: Any) -> None:
        """A ValueError unless the tokenizer has each marker as one token of its own: the prompt's
        state is read from token ids, and a model without them does not think in this format."""
        for marker in (cls.start, cls.end):
            if _token_id(tokenizer, marker) is None:
                raise ValueError(
                    f"--reasoning-parser {cls.name} needs a tokenizer with {marker} as one token, and this "
                    "model's has none: it is no reasoning model of that format"
                )

    @classmethod
    def prompt_state(cls, tokenizer: Any, prompt_ids: Sequence[int]) -> PromptState:
        """Where the prompt leaves the block: its last marker decides; a closing one only when just
        whitespace follows it (earlier turns' blocks are followed by their answers)."""
        start_id, end_id = _token_id(tokenizer, cls.start), _token_id(tokenizer, cls.end)
        for i in range(len(prompt_ids) - 1, -1, -1):
            token = prompt_ids[i]
            if token == start_id:
                return PromptState.OPEN
            if token == end_id:
                tail = prompt_ids[i + 1 :]
                if len(tail) <= _TAIL_TOKENS and not tokenizer.decode(list(tail)).strip():
                    return PromptState.CLOSED
                return PromptState.NONE
        return PromptState.NONE

    def parse(self, text: str) -> ParsedReasoning:
        """A whole reply (of a parser that has been fed nothing yet)."""
        return ParsedReasoning.from_deltas([self.feed(text, last=True)])

    def feed(self, text: str, last: bool = False) -> ReasoningDelta:
        """The reply's next piece; ``last`` when the reply ends with it, which settles whatever
        was held back."""
        self.text += text
        out = ReasoningDelta()
        while True:
            if self.mode is _Mode.OPENING and not self._opening(last):
                return out
            if self.mode is _Mode.REASONING:
                at = self.text.find(self.end, self.pos)
                if at < 0:
                    stop = (
                        len(self.text)
                        if last
                        else len(self.text) - _partial_marker_at_end(self.text, self.pos, self.end)
                    )
                    out.reasoning += self.text[self.pos : stop]
                    self.pos = stop
                    return out
                out.reasoning += self.text[self.pos : at]
                self.pos, self.mode, self._strip = at + len(self.end), _Mode.CONTENT, True
            if self.mode is _Mode.CONTENT:
                piece = self.text[self.pos :]
                self.pos = len(self.text)
                if self._strip:
                    piece = piece.lstrip()
                    self._strip = not piece
                out.content += piece
                return out

    def _opening(self, last: bool) -> bool:
        """Before the reply's first word: True once it is known whether the reply opens the block
        (the mode then set), False while the text may still become ``<think>``."""
        rest = self.text[self.pos :]
        word = rest.lstrip()
        if word.startswith(self.start):
            self.pos += len(rest) - len(word) + len(self.start)
            self.mode = _Mode.REASONING
            return True
        if not last and self.start.startswith(word):  # whitespace only, or part of <think>
            return False
        self.mode = _Mode.REASONING if self.opened else _Mode.CONTENT
        return True


def _token_id(tokenizer: Any, marker: str) -> int | None:
    """The id of ``marker`` if the tokenizer (if any) has it as one token."""
    if tokenizer is None:
        return None
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: thinks when the prompt opened the block or the reply opens it; a reply after a
    prompt that closed it (``enable_thinking: false``) or left it alone, without ``<think>``, is
    the answer."""

    name = "qwen3"
    thinks_unopened = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and QwQ): the reply thinks first whether or not it writes ``<think>``
    (its templates open the block, or expect the model to): everything up to ``</think>`` is
    reasoning, unless the prompt closed the block."""

    name = "deepseek_r1"
    thinks_unopened = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}
