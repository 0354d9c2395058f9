"""Speculative decoding by prompt lookup: the n-gram proposer, and ``SpecDecoder``, which drafts and
verifies for the engine core (its options: ``engine.config.SpeculativeConfig``).

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

import numpy as np

from tokenmill.engine.config import SpeculativeConfig
from tokenmill.engine.messages import CoreStats
from tokenmill.engine.sequence import Sequence

# A sequence stops being offered drafts once this many in a row were all rejected; it is
# offered them again after as many steps more (so a sequence that starts repeating later
# still gains).
MAX_FAILED_DRAFTS = 4


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


class SpecDecoder:
    """The engine core's speculation: drafts for the sequences that decode next, before a step is
    scheduled, and each sequence's drafts verified against the step's samples once it is read."""

    def __init__(self, config: SpeculativeConfig | None, stats: CoreStats, max_model_len: int) -> None:
        self.config = config
        self.stats = stats
        self.max_model_len = max_model_len
        self._histories = TokenHistory()

    def active(self, num_running: int) -> bool:
        """Whether drafts are proposed at this many running sequences."""
        return self.config is not None and num_running < self.config.disable_by_batch_size

    def propose(self, running: list[Sequence]) -> None:
        """Drafts for each running sequence that decodes next (prompt lookup), as many as its token
        limits leave room for after the token the step samples anyway."""
        spec = self.config
        assert spec is not None
        for seq in running:
            if seq.num_pending or seq.num_computed_tokens != seq.num_tokens - 1 or seq.params.uses_penalties:
                continue
            if seq.draft_pause:
                seq.draft_pause -= 1
                continue
            room = self.max_model_len - seq.num_tokens
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens)
            count = min(spec.num_speculative_tokens, room - 1)
            if count > 0:
                tokens = self._histories.view(seq.seq_id, seq.token_ids)
                seq.draft_token_ids = propose_ngram(
                    tokens, count, spec.prompt_lookup_min, spec.prompt_lookup_max
                ).tolist()

    def verify(self, seq: Sequence, samples: list[int]) -> int:
        """How many of ``seq``'s drafts stand against the step's samples; the rejected ones' positions
        are forgotten (computed again when real tokens fill them). Returns the tokens to emit."""
        drafts = seq.draft_token_ids
        accepted = accepted_length(drafts, samples)
        seq.num_computed_tokens -= len(drafts) - accepted
        seq.spec_drafts += 1
        seq.spec_draft_tokens += len(drafts)
        seq.spec_accepted_tokens += accepted
        self.stats.spec_decode_num_drafts += 1
        self.stats.spec_decode_num_draft_tokens += len(drafts)
        self.stats.spec_decode_num_accepted_tokens += accepted
        if accepted == 0:
            seq.num_failed_drafts += 1
            if seq.num_failed_drafts >= MAX_FAILED_DRAFTS:  # stop trying for a while
                seq.draft_pause, seq.num_failed_drafts = MAX_FAILED_DRAFTS, 0
        else:
            seq.num_failed_drafts = 0
        seq.draft_token_ids = []
        return accepted + 1

    def forget(self, seq: Sequence) -> None:
        """``seq`` ended: its token history goes."""
        self._histories.forget(seq.seq_id)
