"""Reasoning parsers on their own: the split of whole replies, streams cut at every point (inside
the markers too) that add up to the same split, and the prompt's state read from token ids."""

from __future__ import annotations

from typing import ClassVar

import pytest

from tokenmill.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    ParsedReasoning,
    PromptState,
    Qwen3ReasoningParser,
    ReasoningParser,
)

NONE, OPEN, CLOSED = PromptState.NONE, PromptState.OPEN, PromptState.CLOSED

# (parser, prompt state, reply) -> (reasoning, content)
CASES = [
    (Qwen3ReasoningParser, NONE, "<think>\nLet me see.\n</think>\n\nIt is 4.", ("\nLet me see.\n", "It is 4.")),
    (Qwen3ReasoningParser, NONE, "  <think>a</think>b", ("a", "b")),
    (Qwen3ReasoningParser, NONE, "It is 4.", (None, "It is 4.")),
    (Qwen3ReasoningParser, NONE, "a <think>b</think>c", (None, "a <think>b</think>c")),
    (Qwen3ReasoningParser, NONE, "<think>still thinking", ("still thinking", "")),
    (Qwen3ReasoningParser, NONE, "<think>cut in </thi", ("cut in </thi", "")),
    (Qwen3ReasoningParser, NONE, "<thi", (None, "<thi")),
    (Qwen3ReasoningParser, NONE, "", (None, "")),
    (Qwen3ReasoningParser, OPEN, "\nhmm\n</think>\n\nyes", ("\nhmm\n", "yes")),
    (Qwen3ReasoningParser, OPEN, "never closed", ("never closed", "")),
    (Qwen3ReasoningParser, OPEN, "<think>again</think>x", ("again", "x")),
    (Qwen3ReasoningParser, OPEN, "</think>", (None, "")),
    (Qwen3ReasoningParser, CLOSED, "<think>a</think>b", (None, "<think>a</think>b")),
    (Qwen3ReasoningParser, CLOSED, "\n\nanswer", (None, "answer")),
    (DeepSeekR1ReasoningParser, NONE, "no opener</think>\n\nanswer", ("no opener", "answer")),
    (DeepSeekR1ReasoningParser, NONE, "<think>a</think>b", ("a", "b")),
    (DeepSeekR1ReasoningParser, NONE, "all thought", ("all thought", "")),
    (DeepSeekR1ReasoningParser, OPEN, "a</think>b</think>c", ("a", "b</think>c")),
    (DeepSeekR1ReasoningParser, CLOSED, "plain", (None, "plain")),
]


def split(parser: type[ReasoningParser], state: PromptState, pieces: list[str]) -> ParsedReasoning:
    reader = parser(state)
    return ParsedReasoning.from_deltas(reader.feed(p, last=i == len(pieces) - 1) for i, p in enumerate(pieces))


@pytest.mark.parametrize("parser, state, reply, expected", CASES)
def test_whole_reply(parser: type[ReasoningParser], state: PromptState, reply: str,
                     expected: tuple[str | None, str]) -> None:
    got = parser(state).parse(reply)
    assert (got.reasoning, got.content) == expected


@pytest.mark.parametrize("parser, state, reply, expected", CASES)
def test_every_split_point_adds_up(parser: type[ReasoningParser], state: PromptState, reply: str,
                                   expected: tuple[str | None, str]) -> None:
    """Cut once anywhere, twice anywhere, and one character at a time: the same split."""
    whole = parser(state).parse(reply)
    n = len(reply)
    for i in range(n + 1):
        assert split(parser, state, [reply[:i], reply[i:]]) == whole, i
        for j in range(i, n + 1):
            assert split(parser, state, [reply[:i], reply[i:j], reply[j:]]) == whole, (i, j)
    assert split(parser, state, [*reply, ""]) == whole


def test_reasoning_streams_before_the_markers_settle() -> None:
    """Only text that may become a marker is held back; the rest comes at once, and in order."""
    reader = Qwen3ReasoningParser(NONE)
    out = reader.feed("<thi")
    assert (out.reasoning, out.content) == ("", "")
    out = reader.feed("nk>step one</th")
    assert (out.reasoning, out.content) == ("step one", "")
    out = reader.feed("ink>\n\nAns")
    assert (out.reasoning, out.content) == ("", "Ans")
    assert reader.feed("wer", last=True).content == "wer"


class FakeTokenizer:
    """Markers as single ids, whitespace as id 1, words as 2."""

    ids: ClassVar[dict[str, list[int]]] = {"<think>": [10], "</think>": [11]}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.ids.get(text, [2, 2])

    def decode(self, ids: list[int]) -> str:
        return "".join({10: "<think>", 11: "</think>", 1: "\n", 2: "w"}[i] for i in ids)


@pytest.mark.parametrize("prompt, state", [
    ([2, 2, 2], NONE),
    ([2, 2, 10], OPEN),
    ([2, 10, 1], OPEN),
    ([2, 10, 2, 2], OPEN),  # a thought being continued
    ([2, 10, 11], CLOSED),
    ([2, 10, 1, 1, 11, 1, 1], CLOSED),
    ([2, 10, 2, 11, 2, 2, 2], NONE),  # an earlier turn's thought, followed by its answer
    ([2, 10, 2, 11, *[1] * 9], NONE),  # too long a tail to be this turn's
    ([2, 11, 2, 10], OPEN),
])
def test_prompt_state_from_token_ids(prompt: list[int], state: PromptState) -> None:
    for parser in REASONING_PARSERS.values():
        assert parser.prompt_state(FakeTokenizer(), prompt) is state


def test_a_tokenizer_without_markers_is_refused() -> None:
    class Plain(FakeTokenizer):
        ids: ClassVar[dict[str, list[int]]] = {}

    with pytest.raises(ValueError, match="qwen3 needs a tokenizer with <think>"):
        Qwen3ReasoningParser.check_tokenizer(Plain())
    with pytest.raises(ValueError, match="deepseek_r1"):
        DeepSeekR1ReasoningParser.check_tokenizer(None)
    Qwen3ReasoningParser.check_tokenizer(FakeTokenizer())
