"""Speculative decoding by prompt lookup: its options, the n-gram proposer, and verification.

A sequence's recent tokens often repeat an earlier run of the same sequence (code
being rewritten, a quoted document, a list being continued). The proposer finds
the longest such run ending at the last token and proposes the tokens that
followed it; the step then computes the last token and the drafts as one query,
and the target's own sample at every position decides how many drafts stand.

Verification samples each position exactly as plain decoding would and keeps a
draft only while it equals that sample, so every emitted token is a sample of the
target at its position: greedy output is unchanged, and a sampled draft ``d`` is
accepted with the target's probability of ``d`` and replaced, when rejected, by a
sample of the target with ``d`` taken out and renormalised (the rejection rule of
speculative sampling for a draft that puts all its mass on one token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from tokenmill.validation import Rule, check_fields, integer, one_of, ruled

# A sequence stops being offered drafts once this many in a row were all rejected; it is
# offered them again after as many steps more (so a sequence that starts repeating later
# still gains).
MAX_FAILED_DRAFTS = 4


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config`` for prompt lookup (``method="ngram"``)."""

    num_speculative_tokens: int = ruled(None, integer(1, 16), help="draft tokens proposed for each sequence each step")
    method: str = ruled(
        "ngram",
        one_of({"ngram": "ngram", "prompt_lookup": "ngram"}),
        help="how drafts are proposed: ngram (prompt lookup)",
    )
    prompt_lookup_max: int = ruled(4, integer(1, 64), help="longest n-gram matched")
    prompt_lookup_min: int = ruled(1, integer(1, 64), help="shortest n-gram matched")
    # 16: on the H200 a verify step of 5 tokens a sequence costs 1.03-1.15x a one-token step up to 16
    # sequences, 1.27x at 32 and 1.59x at 64 (Llama-3-8B, docs/PERFORMANCE.md).
    disable_by_batch_size: int = ruled(
        16,
        integer(1),
        help="no drafts while this many sequences or more are running: the batch alone keeps "
        "the GPU busy, and a draft rejected costs more than it saves",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """From ``LLM(speculative_config=...)`` (a dict, or this class) or the command line (its JSON)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(map(repr, set(value) - known))
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(unknown)}; the keys are {', '.join(sorted(known))}"
            )
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        try:
            return cls(**value)
        except ValueError as exc:
            raise ValueError(f"speculative_config: {exc}") from None


SPECULATIVE_CONFIG = Rule("None, a dict or its JSON", "", SpeculativeConfig.parse)


def propose_ngram(tokens: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to ``num_tokens`` tokens that followed the most recent earlier occurrence of the longest
    n-gram (``min_n`` ≤ n ≤ ``max_n``) that ``tokens`` ends with; empty if none occurs. Vectorised
    over the candidate positions: the Python loop runs over n, never over tokens."""
    length = len(tokens)
    if length < min_n + 1:
        return tokens[:0]
    # Candidates: positions i < length - 1 holding the last token; match[i] is how far the run
    # ending at i agrees with the run ending at the last token, going back.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if len(ends) == 0:
        return tokens[:0]
    match = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, max_n):
        if back >= length - 1:
            break
        ok = alive & (ends >= back)
        ok[ok] = tokens[ends[ok] - back] == tokens[length - 1 - back]
        alive = ok
        match += alive
        if not alive.any():
            break
    best = match.max()
    if best < min_n:
        return tokens[:0]
    start = ends[np.flatnonzero(match == best)[-1]] + 1  # the most recent of the longest
    return tokens[start : start + num_tokens]


def accepted_length(drafts: list[int], samples: list[int]) -> int:
    """How many drafts stand: the leading ones equal to the target's sample at their position
    (``samples`` has one more entry than ``drafts``: the sample after the last draft)."""
    n = 0
    while n < len(drafts) and drafts[n] == samples[n]:
        n += 1
    return n


class TokenHistory:
    """Each speculating sequence's tokens as a growing numpy array, extended by what is new since the
    last proposal: converting whole lists each step would cost O(length) per sequence per step."""

    def __init__(self) -> None:
        self._arrays: dict[int, tuple[np.ndarray, int]] = {}

    def view(self, seq_id: int, token_ids: list[int]) -> np.ndarray:
        array, filled = self._arrays.get(seq_id, (np.empty(0, dtype=np.int64), 0))
        length = len(token_ids)
        if length < filled:  # never expected (tokens are only appended); start again
            filled = 0
        if length > len(array):
            grown = np.empty(max(length, 2 * len(array), 64), dtype=np.int64)
            grown[:filled] = array[:filled]
            array = grown
        if length > filled:
            array[filled:length] = token_ids[filled:length]
        self._arrays[seq_id] = (array, length)
        return array[:length]

    def forget(self, seq_id: int) -> None:
        self._arrays.pop(seq_id, None)
