"""The front-end's half of a step: the core's new token ids become text and outputs.

For each request it keeps what the caller sees: the output tokens, their text
(detokenized incrementally), logprobs, and why each sequence ended. Stop
strings are found here, on the text; a sequence that reaches one is ended
here at once and the core is told to stop it (``aborts``), so tokens the core
computed meanwhile are dropped. ``RequestOutput`` is assembled here in the
kind the caller asked for: everything so far, only what is new, or once at the end.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.messages import AbortRequests, AbortSequence, CoreOutputs, RequestDelta, SeqDelta
from tokenmill.outputs import ERROR_ENGINE, CompletionOutput, Logprobs, OutputKind, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Detokenizer, make_detokenizer


@dataclass(eq=False)
class SeqState:
    index: int
    detokenizer: Detokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # What earlier DELTA outputs carried already.
    tokens_sent: int = 0
    text_sent: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StopStrings:
    """A request's stop strings as one search: a sequence's new text is searched once a token for
    all of them (one regular expression: the leftmost hit wins and, of those starting there, the
    first in sorted order), however many there are."""

    pattern: re.Pattern[str]
    longest: int

    @classmethod
    def of(cls, strings: list[str]) -> StopStrings | None:
        if not strings:
            return None
        return cls(re.compile("|".join(map(re.escape, sorted(strings)))), max(map(len, strings)))


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: OutputKind
    seqs: list[SeqState]
    metrics: RequestMetrics
    stops: StopStrings | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    prompt_logprobs_sent: int = 0
    num_cached_tokens: int = 0
    finished: bool = False
    error: str | None = None
    error_kind: str = ERROR_ENGINE
    last_token_time: float | None = None


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    # What the core must stop: sequences that the front-end ended on a stop string.
    aborts: list[AbortRequests | AbortSequence] = field(default_factory=list)
    # Latencies seen in this batch of outputs, in seconds (for metrics): time to first
    # token, (gap per token, tokens) between outputs, and arrival to end.
    ttfts: list[float] = field(default_factory=list)
    itls: list[tuple[float, int]] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kind: OutputKind,
        arrival_time: float,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seqs = []
        for i in range(params.n):
            detok = None
            if self.tokenizer is not None:
                detok = make_detokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            seqs.append(SeqState(i, detok, logprobs=[] if params.logprobs is not None else None))
        self.requests[request_id] = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            kind,
            seqs,
            RequestMetrics(arrival_time=arrival_time),
            StopStrings.of(params.stop_strings),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request on the caller's side; its final output (finish_reason "abort"), or
        None if it is unknown or over already. The caller tells the core."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for seq in state.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
        return self._finish(state, time.monotonic())

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Every request ends with ``message`` (the core is gone)."""
        now = time.monotonic()
        outputs = []
        for state in list(self.requests.values()):
            self._fail(state, message)
            outputs.append(self._finish(state, now))
        self.requests.clear()
        return outputs

    def process(self, core_outputs: CoreOutputs) -> ProcessedOutputs:
        result = ProcessedOutputs()
        now = time.monotonic()
        for delta in core_outputs.outputs:
            state = self.requests.get(delta.request_id)
            if state is None:
                continue  # aborted or ended here while the core worked on it
            changed = self._apply(state, delta, now, result)
            if state.finished:
                del self.requests[state.request_id]
                result.outputs.append(self._finish(state, now))
                result.e2e_latencies.append(now - state.metrics.arrival_time)
            elif changed and state.kind is not OutputKind.FINAL_ONLY:
                result.outputs.append(self._output(state))
        return result

    # ---------------------------------------------------------------- updates
    def _apply(self, state: RequestState, delta: RequestDelta, now: float, result: ProcessedOutputs) -> bool:
        """Take one request's news; True if the caller has something new to see."""
        if delta.error is not None:
            self._fail(state, delta.error)
            state.error_kind = delta.error_kind
            return True
        metrics = state.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = delta.first_scheduled_time
            metrics.num_cached_tokens = state.num_cached_tokens = delta.num_cached_tokens
        metrics.num_preemptions = delta.num_preemptions
        if delta.spec_drafts:
            metrics.spec_decode_num_drafts = delta.spec_drafts
            metrics.spec_decode_num_draft_tokens = delta.spec_draft_tokens
            metrics.spec_decode_num_accepted_tokens = delta.spec_accepted_tokens
        changed = False
        if delta.prompt_logprobs and state.prompt_logprobs is not None:
            state.prompt_logprobs.extend(delta.prompt_logprobs)
            changed = True
        ended_here = []
        num_new = 0
        seq_ended = False  # (only then can every sequence have ended)
        seqs = state.seqs
        for seq_delta in delta.seqs:  # (every step, every running request: kept lean)
            seq = seqs[seq_delta.index]
            if seq.finish_reason is not None:
                continue
            changed = True
            num_new += len(seq_delta.token_ids)
            if self._apply_tokens(state, seq, seq_delta):
                ended_here.append(seq.index)
            if seq.finish_reason is not None:
                seq_ended = True
        if num_new:
            if state.last_token_time is None:
                metrics.first_token_time = now
                result.ttfts.append(now - metrics.arrival_time)
            else:
                result.itls.append(((now - state.last_token_time) / num_new, num_new))
            state.last_token_time = now
        if delta.finished or (seq_ended and all(seq.finished for seq in state.seqs)):
            state.finished = True
        if ended_here:
            if state.finished and not delta.finished:
                result.aborts.append(AbortRequests([state.request_id]))
            elif not state.finished:
                result.aborts.extend(AbortSequence(state.request_id, i) for i in ended_here)
        return changed

    def _apply_tokens(self, state: RequestState, seq: SeqState, delta: SeqDelta) -> bool:
        """Append a sequence's new tokens; True if a stop string ended it here (the core
        does not know yet)."""
        params, stops = state.params, state.stops
        if delta.finish_reason is None and not delta.logprobs and stops is None:
            # (Most steps: tokens that end nothing and no stop string to look for.)
            seq.token_ids += delta.token_ids
            if seq.detokenizer is not None:
                seq.text += "".join(map(seq.detokenizer.add, delta.token_ids))
            return False
        last = len(delta.token_ids) - 1
        for i, token in enumerate(delta.token_ids):
            seq.token_ids.append(token)
            if seq.logprobs is not None and delta.logprobs:
                entry = delta.logprobs[i]
                seq.logprobs.append(entry)
                seq.cumulative_logprob += entry[token]
            # The core ends a sequence on a stop token after it: that token shows no text.
            stopped_by_token = i == last and delta.finish_reason == "stop"
            if seq.detokenizer is None or stopped_by_token:
                continue
            old_len = len(seq.text)
            seq.text += seq.detokenizer.add(token)
            if stops is not None and len(seq.token_ids) >= params.min_tokens:
                if self._check_stop(seq, old_len, stops, params.include_stop_str_in_output):
                    return True
        if delta.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason
        return False

    @staticmethod
    def _check_stop(seq: SeqState, old_len: int, stops: StopStrings, include: bool) -> bool:
        """End at the first stop string that the new text completes; the text ends before it
        (or after it, with ``include_stop_str_in_output``)."""
        hit = stops.pattern.search(seq.text, max(0, old_len - stops.longest + 1))
        if hit is None:
            return False
        seq.text = seq.text[: hit.end() if include else hit.start()]
        seq.finish_reason, seq.stop_reason = "stop", hit.group()
        return True

    @staticmethod
    def _fail(state: RequestState, message: str) -> None:
        state.error = message
        state.finished = True
        for seq in state.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"

    # ---------------------------------------------------------------- outputs
    def _finish(self, state: RequestState, now: float) -> RequestOutput:
        state.finished = True
        state.metrics.finished_time = now
        return self._output(state)

    @staticmethod
    def _visible_text(seq: SeqState, stops: StopStrings | None) -> str:
        """While a sequence runs, hold back the tail that could still become a stop string,
        so a stream never shows text that the stop string will take back."""
        if seq.finished or stops is None:
            return seq.text
        hold = stops.longest - 1
        return seq.text[: max(0, len(seq.text) - hold)] if hold else seq.text

    def _output(self, state: RequestState) -> RequestOutput:
        delta = state.kind is OutputKind.DELTA
        outputs = []
        for seq in state.seqs:
            text = self._visible_text(seq, state.stops)
            if delta:
                if seq.tokens_sent == len(seq.token_ids) and seq.text_sent == len(text) and seq.finish_reason is None:
                    continue
                start = seq.tokens_sent
                out_text, out_ids = text[seq.text_sent :], seq.token_ids[start:]
                out_logprobs = seq.logprobs[start:] if seq.logprobs is not None else None
                seq.tokens_sent, seq.text_sent = len(seq.token_ids), len(text)
            else:
                out_text, out_ids = text, list(seq.token_ids)
                out_logprobs = list(seq.logprobs) if seq.logprobs is not None else None
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=out_text,
                    token_ids=out_ids,
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    logprobs=out_logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        prompt_logprobs = state.prompt_logprobs
        if prompt_logprobs is not None:
            if delta:
                prompt_logprobs, state.prompt_logprobs_sent = (
                    prompt_logprobs[state.prompt_logprobs_sent :],
                    len(prompt_logprobs),
                )
            else:
                prompt_logprobs = list(prompt_logprobs)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=state.finished,
            metrics=state.metrics,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            error=state.error,
            error_kind=state.error_kind,
        )
