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


@dataclass(frozen=True)
class EngineStats:
    """The engine's gauges (as of its last step) and counters (since it started): what
    ``LLM.get_stats()`` returns and the server's ``/metrics`` shows."""

    num_running: int  # requests being decoded or prefilled
    num_waiting: int  # requests waiting to be scheduled
    kv_usage: float  # fraction of KV blocks held by requests (cached free blocks count as free)
    kv_blocks_in_use: int
    kv_blocks_cached: int  # blocks findable in the prefix cache
    kv_capacity_tokens: int  # tokens the KV cache holds over all requests
    kv_cache_dtype: str  # as configured: auto, fp8_e4m3, fp8_e5m2 or int8
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # prompt tokens found there
    prompt_tokens: int  # prompt tokens computed
    generation_tokens: int
    num_preemptions: int  # sequences preempted for lack of KV blocks
    num_steps: int
    num_graph_steps: int  # steps whose forward replayed a captured CUDA graph
    num_failed_steps: int  # steps that failed (their requests ended with an error)
    num_compiles_after_startup: int  # Triton variants compiled inside a step (a shape warm-up missed)
    spec_decode_num_drafts: int  # speculative decoding: verifications of a sequence's drafts
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
