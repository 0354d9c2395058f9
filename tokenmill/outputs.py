"""What ``LLM.generate`` returns, named as in vLLM."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class OutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request holds, as in vLLM: everything so far
    (``CUMULATIVE``, the CLI), only what is new since the last one (``DELTA``, the
    server's streams), or one output when the request ends (``FINAL_ONLY``, offline)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


# One position's logprobs: token id -> logprob (the sampled token and the top-N).
Logprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[Logprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding: steps that verified drafts, drafts proposed, drafts accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0

    @property
    def spec_decode_mean_accepted_length(self) -> float | None:
        """Tokens each verifying forward gave: its accepted drafts and the token it samples anyway."""
        if not self.spec_decode_num_drafts:
            return None
        return 1 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


# Why the engine could not run a request (``RequestOutput.error_kind``): the engine failed (a failed
# step, a grammar that raised), the request itself was at fault (its constraint would not compile), or
# the engine could not serve it in time (its constraint waited too long for a compile worker, or
# compiled too long): its own limit, not the request's fault, so a retry later may succeed.
ERROR_ENGINE, ERROR_INVALID, ERROR_UNAVAILABLE = "engine", "invalid", "unavailable"


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[Logprobs | None] | None = None
    num_cached_tokens: int = field(default=0)
    # Why the engine could not finish this request (a failed step); None when it ran.
    error: str | None = None
    error_kind: str = ERROR_ENGINE  # whose fault the error is, when there is one
