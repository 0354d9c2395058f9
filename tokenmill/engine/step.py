"""The values that cross between the engine core and the model runner: the scheduler's choice for
a step goes down, and the step's sampled tokens come back up."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.engine.sequence import Sequence
from tokenmill.outputs import Logprobs


@dataclass
class ScheduledStep:
    """This step's sequences and how many tokens of each to compute."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    def advance(self) -> int:
        """Move each sequence past the tokens the launched step computes; the prompt tokens among them."""
        prompt_tokens = 0
        for seq, n in zip(self.seqs, self.num_tokens):
            start = seq.num_computed_tokens
            end = seq.num_computed_tokens = start + n
            if start < len(seq.prompt_token_ids):
                prompt_tokens += min(end, len(seq.prompt_token_ids)) - start
        return prompt_tokens


@dataclass
class StepResult:
    """Sampled tokens for the sequences that sample this step, in batch order: one each, or with
    drafts one at each of the ``1 + drafts`` positions."""

    sampled_seqs: list[Sequence] = field(default_factory=list)
    # Every sampled row's token, each sequence's rows together: with one row each (no drafts, most
    # steps) the i-th sequence's token is ``token_ids[i]`` and ``starts`` is None; otherwise
    # ``starts[i]`` is its first row (and ``starts[-1]`` the row count).
    token_ids: list[int] = field(default_factory=list)
    starts: list[int] | None = None
    # Each row's logprobs, by the sequence's place among ``sampled_seqs``: only those that asked.
    logprobs: dict[int, list[Logprobs]] = field(default_factory=dict)
    # A seeded sequence with drafts: its generator's state after each of its rows' draws.
    generator_states: dict[Sequence, list[torch.Tensor]] = field(default_factory=dict)
    # Prompt logprobs computed this step: seq -> logprobs of its next prompt positions.
    prompt_logprobs: dict[Sequence, list[Logprobs]] = field(default_factory=dict)
    # Sequences whose grammar raised as the step sampled, with the reason: their samples are void, and
    # the engine fails their requests alone (None: none did, as in every step without a grammar).
    failed_seqs: dict[Sequence, str] | None = None

    def rows(self, i: int) -> range:
        """The rows of the i-th sampled sequence."""
        return range(i, i + 1) if self.starts is None else range(self.starts[i], self.starts[i + 1])
