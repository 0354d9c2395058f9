"""What crosses between the front-end and the engine core, as typed msgspec structs.

The front-end sends requests that it has already validated and tokenized; the
core answers with one ``CoreOutputs`` per step holding every request's new token
ids (no text: detokenizing and stop strings are the front-end's work). The
same structs serve the in-process core (passed as objects) and the core in its
own process (msgpack over ZeroMQ), so both paths run the same code. The
per-step structs hold no reference cycles, so the garbage collector does not
track them (``gc=False``): a step makes hundreds, and each tracked object
brings the next collection closer.
"""

from __future__ import annotations

import msgspec

from tokenmill.outputs import ERROR_ENGINE, EngineStats, Logprobs
from tokenmill.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0  # lower is served first; only under scheduling_policy "priority"


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    """Stop these requests now and free their blocks; unknown ids are ignored."""

    request_ids: list[str]


class AbortSequence(msgspec.Struct, tag=True, array_like=True):
    """Stop one of a request's ``n`` sequences (the front-end found a stop string in it)."""

    request_id: str
    index: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Abort everything and leave the core's loop."""


CoreInput = AddRequest | AbortRequests | AbortSequence | Shutdown


class SeqDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One sequence's news this step: its new tokens and, once it ends, why."""

    index: int
    token_ids: list[int]
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the stop token id that ended it


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    seqs: list[SeqDelta]
    finished: bool = False
    # Set when the core could not run this request (a failed step): the request is over.
    error: str | None = None
    error_kind: str = ERROR_ENGINE  # whose fault the error is (``tokenmill.outputs.ERROR_ENGINE``)
    prompt_logprobs: list[Logprobs | None] | None = None  # new prompt positions, in order
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # Speculative decoding, over the request's sequences so far: verifications with drafts, drafts, and
    # drafts accepted.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class CoreStats(msgspec.Struct, array_like=True, gc=False):
    """The core's gauges and counters after a step (what ``/metrics`` shows)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks_in_use: int = 0
    kv_blocks_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_graph_steps: int = 0  # steps whose forward replayed a captured CUDA graph
    num_failed_steps: int = 0
    num_compiles_after_startup: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


def engine_stats(stats: CoreStats, kv_capacity_tokens: int, kv_cache_dtype: str) -> EngineStats:
    """The public view of the core's last stats, with the KV cache's size and kind."""
    return EngineStats(
        **msgspec.structs.asdict(stats), kv_capacity_tokens=kv_capacity_tokens, kv_cache_dtype=kv_cache_dtype
    )


class CoreOutputs(msgspec.Struct, array_like=True, gc=False):
    outputs: list[RequestDelta]
    stats: CoreStats


class CoreReady(msgspec.Struct, tag=True, array_like=True):
    """The core process's first message: what the front-end must know of the engine it built."""

    max_model_len: int  # after the KV pool is sized, which may lower it
    vocab_size: int
    kv_cache_dtype: str  # as configured: auto, fp8_e4m3, fp8_e5m2 or int8
    kv_capacity_tokens: int  # tokens the KV pools hold (see KVCacheManager.capacity_tokens)


class CoreFailed(msgspec.Struct, tag=True, array_like=True):
    """The core process could not start (bad model directory, no memory): the reason."""

    message: str
    is_value_error: bool
