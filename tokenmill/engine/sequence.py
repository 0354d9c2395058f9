"""One sequence being generated, as the engine core sees it: its tokens, progress and
KV blocks. Text, logprobs kept for the caller and stop strings live in the front-end.

While a step is in flight its sampled token is not known on the host yet, but the
next step is already scheduled: the token list then ends with ``num_pending``
placeholders (``PENDING``), which the engine replaces as results arrive. Nothing
that must see real tokens (outputs, prefix-cache hashes, penalties) reads them.

The prompt is kept in a tuple: of ints alone, the garbage collector stops tracking it after
the first collection that meets it, where a list's references would be walked again by every
full collection (a thousand 2k-token prompts: 2 million of them). The growing token
list stays a list: an ``array`` would hide it from the collector too, but costs a conversion on
every append, store and read of the step's hot loops.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.sampling_params import SamplingParams

PENDING = -1  # placeholder for a sampled token still on the device


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request's ``n`` choices are ``n`` sequences sharing one prompt."""

    seq_id: int
    request_id: str
    index: int
    prompt_token_ids: tuple[int, ...]  # a list given is kept as a tuple
    params: SamplingParams
    arrival_time: float
    generator: torch.Generator | None = None
    eos_token_ids: tuple[int, ...] = ()
    token_ids: list[int] = field(init=False)  # the prompt, then the generated tokens
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_tables: list[list[int]] = field(default_factory=list)  # one per KV group; empty while it holds none
    # The model runner's copy of the sequence's step inputs (``SequenceRows``): its row, and whether
    # the KV manager changed the tables since they were copied there.
    row: int | None = field(default=None, repr=False)
    tables_stale: bool = field(default=True, repr=False)
    block_hashes: list[bytes] = field(default_factory=list)  # its full blocks' prefix-cache hashes
    num_committed_blocks: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | None = None
    first_scheduled_time: float | None = None
    num_pending: int = 0
    next_prompt_logprob_position: int = 0  # the first prompt position whose logprobs are not yet computed
    # Speculative decoding: this step's drafts (computed after the last token, verified by the step's
    # samples), how many drafts in a row were all rejected, and steps left before drafts resume.
    draft_token_ids: list[int] = field(default_factory=list)
    num_failed_drafts: int = 0
    draft_pause: int = 0
    matcher: Any = None  # structured outputs: the sequence's xgrammar GrammarMatcher
    spec_drafts: int = 0  # verifications with drafts
    spec_draft_tokens: int = 0  # drafts proposed (and computed)
    spec_accepted_tokens: int = 0  # drafts that stood
    # The token count at which the sequence ends for its length (``max_tokens`` or the model's
    # length, whichever comes first): the engine sets it; ``stop_ids`` the tokens that may end it
    # (banned until ``min_tokens`` are out).
    token_limit: int = field(default=1 << 62, repr=False)
    stop_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)
        eos = () if self.params.ignore_eos else self.eos_token_ids
        self.stop_ids = frozenset((*eos, *(self.params.stop_token_ids or ())))

    def tables_changed(self) -> None:
        self.tables_stale = True

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens known so far (pending placeholders excluded)."""
        return self.token_ids[self.num_prompt_tokens : self.num_tokens - self.num_pending]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, pending ones included: the count the next sample follows."""
        return len(self.token_ids) - self.num_prompt_tokens

    def scheduled_token_ids(self, start: int, count: int) -> list[int]:
        """Tokens ``start`` … ``start + count`` of the known tokens followed by the drafts."""
        known = self.token_ids[start : start + count]
        if len(known) == count:
            return known
        return known + self.draft_token_ids[max(0, start - len(self.token_ids)) :][: count - len(known)]

    def drop_pending(self) -> None:
        """Forget placeholders whose tokens will never be wanted (the sequence ended)."""
        if self.num_pending:
            del self.token_ids[-self.num_pending :]
            self.num_pending = 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
