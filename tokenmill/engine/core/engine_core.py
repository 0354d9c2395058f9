"""EngineCore: scheduler, KV cache manager and model runner in one busy loop.

The core sees only requests that the front-end has validated and tokenized, and
answers each step with every request's new token ids (``CoreOutputs``). It
knows no text: detokenizing, stop strings and assembling ``RequestOutput`` are
the front-end's. Token-level stops (eos, stop token ids, ``max_tokens``, the
context length) are the core's, since they decide what runs next.

A step that fails fails only the requests in it: they end with an error, their
blocks go back, and the core keeps serving the rest.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.builder import build_core, freeze_startup_objects, stop_tensor_parallel, watch_late_compiles
from tokenmill.engine.core.request import CoreRequest, RequestTable
from tokenmill.engine.core.scheduler import StepWork
from tokenmill.engine.core.spec_decode import SpecDecoder
from tokenmill.engine.core.step_outputs import StepOutputs
from tokenmill.engine.core.structured_outputs import GrammarAdmission, GrammarCompiler
from tokenmill.engine.messages import (
    AbortRequests,
    AbortSequence,
    AddRequest,
    CoreInput,
    CoreOutputs,
    CoreReady,
    CoreStats,
    SeqDelta,
)
from tokenmill.engine.sequence import PENDING, Sequence
from tokenmill.engine.step import StepResult
from tokenmill.engine.worker.model_runner import ForwardPath, InFlightStep
from tokenmill.engine.worker.tp_workers import WorkerError
from tokenmill.layers.grammar_mask import grammar_error_reason
from tokenmill.outputs import ERROR_ENGINE, Logprobs

logger = logging.getLogger(__name__)


@dataclass
class Launched:
    """A step on the device: the runner's handle on it, and where each sampled token goes."""

    step: InFlightStep
    pending_index: list[int]


class EngineCore:
    """Under tensor parallelism (``tensor_parallel_size`` > 1) the core is rank 0: it holds the first
    share of the model and drives the other ranks' worker processes (``engine/worker/tp_workers.py``)."""

    def __init__(self, config: EngineConfig) -> None:
        parts = build_core(config)
        self.config, self.model_config, self.device, self.dtype, self.kv_dtype = (
            parts.config, parts.model_config, parts.device, parts.dtype, parts.kv_dtype)  # fmt: skip
        self.tp, self.workers, self.runner, self.kv, self.scheduler = (
            parts.tp, parts.workers, parts.runner, parts.kv, parts.scheduler)  # fmt: skip
        self.max_model_len, self.quantization, self.startup_seconds = (
            parts.max_model_len, parts.quantization, parts.startup_seconds)  # fmt: skip
        if self.workers is not None:
            self._stop_workers = weakref.finalize(self, stop_tensor_parallel, self.workers)
        model_config = self.model_config
        self.stats = CoreStats()
        self.spec = SpecDecoder(self.config.speculative_config, self.stats, self.max_model_len)
        self.requests = RequestTable(
            self.scheduler, self.spec, self.device, model_config.eos_token_ids, self.max_model_len
        )
        self.grammars = GrammarAdmission(GrammarCompiler(
            parts.model_dir, model_config.vocab_size, model_config.eos_token_ids, self.config.grammar_compile_workers,
            self.config.grammar_cache_bytes))  # fmt: skip
        self._in_flight: Launched | None = None
        self._outputs = StepOutputs()  # news since the last step's outputs
        if self.device.type == "cuda":
            watch_late_compiles(self.stats)
        started = time.monotonic()
        freeze_startup_objects()
        self.startup_seconds["gc_freeze"] = time.monotonic() - started

    def shutdown(self, abort: bool = False) -> None:
        """Stop the tensor-parallel workers and leave the process group (nothing to do with one rank).
        ``abort``: a rank failed, so collectives may never finish."""
        if self.workers is not None:
            self._stop_workers.detach()
            stop_tensor_parallel(self.workers, abort)
            self.workers = None

    def ready_message(self) -> CoreReady:
        return CoreReady(
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            kv_cache_dtype=self.config.kv_cache_dtype,
            kv_capacity_tokens=self.kv.capacity_tokens,
        )

    # --------------------------------------------------------------- requests
    def handle(self, message: CoreInput) -> None:
        """Apply one message from the front-end (the core process's dispatch)."""
        if isinstance(message, AddRequest):
            self.add_request(message)
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                self.abort_request(request_id)
        elif isinstance(message, AbortSequence):
            self.abort_sequence(message.request_id, message.index)

    def add_request(self, request: AddRequest) -> None:
        """Queue a request the front-end validated (and whose id it checked is free); one with a
        constraint waits for its grammar outside the scheduler."""
        core_request = self.requests.create(request)
        params = request.params
        if params.structured_outputs is not None:
            self.grammars.submit(core_request, params.structured_outputs, request.priority)
            return
        for seq in core_request.seqs:
            self.scheduler.add(seq, request.priority)

    def _admit_compiled(self) -> None:
        """Schedule the requests whose constraint has compiled (waiting a moment for the first when
        nothing else can run, so messages are still read between waits); fail those refused."""
        if not self.scheduler.running and not self.scheduler.waiting:
            self.grammars.wait_first(0.05)
        admitted, refused = self.grammars.admit(self.requests.is_live)
        for entry in refused:
            self._fail_request(entry.request, entry.message, entry.kind)
        for ready in admitted:
            for seq, matcher in zip(ready.request.seqs, ready.matchers):
                seq.matcher = matcher
                self.scheduler.add(seq, ready.priority)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown ids are ignored (it may have
        finished while the abort travelled). No output follows an abort."""
        request = self.requests.pop(request_id, None)
        self._outputs.drop(request_id)
        for seq in request.seqs if request is not None else ():
            self.requests.end(seq, "abort")

    def abort_sequence(self, request_id: str, index: int) -> None:
        """End one sequence of a request (the front-end saw a stop string); the request ends
        once all its sequences have."""
        request = self.requests.get(request_id)
        if request is None or not 0 <= index < len(request.seqs) or request.seqs[index].is_finished:
            return
        self.requests.end(request.seqs[index], "stop")
        if request.done:
            self._outputs.request(request).finished = True
            self.requests.retire(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._in_flight is not None

    # ------------------------------------------------------------------- step
    def step(self) -> CoreOutputs:
        """One iteration; the outputs of the requests that changed. Never raises for a failed
        step: its requests end with an error and the rest go on."""
        try:
            self._step()
        except Exception as exc:  # a bug or a device fault inside the step
            if self.workers is not None:  # the ranks may be out of step: the engine cannot go on
                error = exc if isinstance(exc, WorkerError) else self.workers.failure(exc)
                self.shutdown(abort=True)
                if error is exc:
                    raise
                raise error from exc
            logger.exception("engine step failed; failing the requests in it")
            self._fail_step(exc)
        return self.take_outputs()

    def take_outputs(self) -> CoreOutputs:
        scheduler, kv, stats = self.scheduler, self.kv, self.stats
        stats.num_running, stats.num_waiting = scheduler.num_running_requests, scheduler.num_waiting_requests
        stats.kv_usage, stats.kv_blocks_in_use, stats.kv_blocks_cached = kv.usage(), kv.num_blocks_in_use, kv.num_cached
        stats.prefix_cache_queries, stats.prefix_cache_hits = kv.query_tokens, kv.hit_tokens
        return self._outputs.take(stats)

    def _step(self) -> None:
        """Steps overlap: the next step is scheduled and launched before this one's sampled
        ids are read, so the device runs it while the host appends tokens and checks stops
        (its inputs take the pending ids on the device). A sequence that stops here has run
        one step too many, which is thrown away. A grammar's mask needs every output token
        on the host: a step with constrained rows runs its forward under the one before, and
        samples once that one's tokens are read."""
        if self.grammars:
            self._admit_compiled()
        if self._in_flight is None:
            self._in_flight = self._launch(None)
            if self._in_flight is None:
                self._fail_unschedulable()
                return
        following = self._launch(self._in_flight) if self._can_overlap(self._in_flight) else None
        current, self._in_flight = self._in_flight, following
        self._complete(current)
        if following is not None:
            self.runner.sample(following.step)  # (if it held its sampling back) its grammars know current's tokens

    def _can_overlap(self, in_flight: Launched) -> bool:
        """Drafts are proposed from every known token, and a step with drafts decides how many tokens
        each sequence computed only once it is verified: while speculation is on, steps run one at
        a time."""
        if not self.config.async_scheduling or self.spec.active(len(self.scheduler.running)):
            return False
        return self.spec.config is None or not any(seq.draft_token_ids for seq in in_flight.step.batch.seqs)

    def _launch(self, previous: Launched | None) -> Launched | None:
        """Schedule and enqueue a step; each sequence that samples gets a ``PENDING`` token."""
        if previous is None and self.spec.active(len(self.scheduler.running)):
            self.spec.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        self.stats.num_preemptions += batch.num_preempted
        if not batch.seqs:
            return None
        # On the CPU the forward runs inside the launch, and its time sizes the next steps' chunks.
        step_cost = self.scheduler.step_cost
        work = StepWork.of(batch.seqs, batch.num_tokens) if step_cost is not None else None
        started = time.perf_counter()
        step = self.runner.launch(batch, previous.step if previous is not None else None)
        if step_cost is not None and work is not None:
            step_cost.observe(work, time.perf_counter() - started)
        self.stats.num_steps += 1
        self.stats.num_graph_steps += step.path not in (None, ForwardPath.EAGER)
        self.stats.prompt_tokens += batch.advance()
        for rows in step.prompt_rows:  # each prompt position's logprobs are given once
            rows.seq.next_prompt_logprob_position = rows.first + rows.count
        pending_index = []
        for seq in step.sampled_seqs:
            token_ids = seq.token_ids
            num_tokens = len(token_ids)
            pending_index.append(num_tokens)
            token_ids.append(PENDING)
            seq.num_pending += 1
            if num_tokens + 1 >= seq.token_limit:
                # This token is its last whatever it is: leave the batch now, not a step late.
                self.scheduler.finish(seq)
        return Launched(step, pending_index)

    def _complete(self, launched: Launched) -> None:
        """Read a launched step's tokens, append them, check the token-level stops."""
        step, pending_index = launched.step, launched.pending_index
        result = self.runner.collect(step)
        self.kv.commit_step(step.batch.seqs)
        for seq, reason in (result.failed_seqs or {}).items():  # their grammars raised: their tokens are void
            self._fail_grammar(seq, reason)
        for seq, values in result.prompt_logprobs.items():
            if seq.request_id in self.requests and seq.index == 0:
                delta = self._outputs.request(self.requests[seq.request_id])
                delta.prompt_logprobs = (delta.prompt_logprobs or []) + values
        ended: dict[str, CoreRequest] = {}
        plain = result.starts is None and not result.generator_states
        rest = self._accept_plain(result, pending_index) if plain else range(len(result.sampled_seqs))
        for i in rest:
            seq, index, rows = result.sampled_seqs[i], pending_index[i], result.rows(i)
            tokens = result.token_ids[rows.start : rows.stop]
            logprobs: list[Logprobs] | list[None] = result.logprobs.get(i) or [None] * len(tokens)
            if index >= len(seq.token_ids) or seq.token_ids[index] != PENDING:
                continue  # the sequence ended meanwhile: nobody wants this token
            request = self.requests[seq.request_id]
            out = self._outputs.sequence(request, seq)
            speculated = bool(seq.draft_token_ids)
            count = self.spec.verify(seq, tokens) if speculated else 1
            states = result.generator_states.get(seq)
            if states is not None:  # one draw per emitted token, as plain decoding takes
                assert seq.generator is not None  # only a seeded sequence's states are kept
                seq.generator.set_state(states[count - 1])
            for j in range(count):
                if j:  # a further token: it takes a placeholder of its own, then its place
                    if seq.is_finished:
                        break
                    seq.token_ids.append(PENDING)
                    seq.num_pending += 1
                self._accept_token(seq, out, index + j, tokens[j], logprobs[j])
            if seq.is_finished:
                ended[seq.request_id] = request
            elif speculated:
                self.kv.release_unused(seq)
                self.kv.commit_computed_blocks(seq)
        for request in ended.values():
            # A sequence that left the batch at launch (its last token) still awaits that token;
            # a request ends with the last of its sequences (unless a grammar failed it meanwhile).
            if self.requests.get(request.request_id) is request and request.done:
                self._outputs.request(request).finished = True
                self.requests.retire(request)

    def _accept_plain(self, result: StepResult, pending_index: list[int]) -> list[int]:
        """The common case of ``_complete`` at a fraction of its cost a sequence: a lone sequence
        (``n`` = 1) whose one new token neither ends it nor needs logprobs or a grammar takes it
        here. Returns the positions of the others among the step's sampled sequences, which the
        rest of ``_complete`` takes one by one."""
        rest, outputs = [], self._outputs
        for i, (seq, index, token) in enumerate(zip(result.sampled_seqs, pending_index, result.token_ids)):
            token_ids = seq.token_ids
            if (
                index + 1 >= seq.token_limit
                or token in seq.stop_ids
                or seq.matcher is not None
                or seq.params.n != 1
                or seq.request_id in outputs
                or seq.params.logprobs is not None
                or index >= len(token_ids)
                or token_ids[index] != PENDING
            ):
                rest.append(i)
                continue
            token_ids[index] = token
            seq.num_pending -= 1
            outputs.lone_token(seq, token)
        self.stats.generation_tokens += len(result.sampled_seqs) - len(rest)
        return rest

    def _accept_token(self, seq: Sequence, out: SeqDelta, index: int, token: int, logprobs: Logprobs | None) -> None:
        """Put the sampled token in its placeholder at ``index``, report it in ``out`` (the sequence's
        news this step) and apply the stop rules as of it."""
        params = seq.params
        seq.token_ids[index] = token
        seq.num_pending -= 1
        matcher = seq.matcher
        if matcher is not None and not matcher.is_terminated():  # (past its stop token, under ignore_eos: free)
            try:
                accepted = matcher.accept_token(token)
            except Exception as exc:  # a matcher's failure is its own request's
                self._fail_grammar(seq, f"{type(exc).__name__}: {grammar_error_reason(exc)}")
                return
            if not accepted:
                logger.error("request %s: token %d broke its structured output's grammar", seq.request_id, token)
        num_output = index + 1 - seq.num_prompt_tokens
        self.stats.generation_tokens += 1
        out.token_ids.append(token)
        if out.logprobs is not None and logprobs is not None:
            out.logprobs.append(logprobs)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in seq.eos_token_ids:
                seq.finish_reason = "stop"
            elif params.stop_token_ids and token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
        if seq.finish_reason is None and index + 1 >= seq.token_limit:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
            seq.drop_pending()
            self.scheduler.finish(seq)

    # --------------------------------------------------------------- failures
    def _fail_step(self, exc: Exception) -> None:
        """End every request that a failed step may have touched: the running ones (each is
        in the step or the one in flight) and waiting ones whose sampled token never came."""
        self._in_flight = None
        message = f"the engine failed while running this request: {type(exc).__name__}: {exc}"
        touched = {seq.request_id for seq in self.scheduler.running}
        touched |= {seq.request_id for seq in self.scheduler.waiting if seq.num_pending}
        self.stats.num_failed_steps += 1
        for request_id in touched:
            request = self.requests.get(request_id)
            if request is not None:
                self._fail_request(request, message)

    def _fail_unschedulable(self) -> None:
        """Nothing runs, nothing could be admitted and no step is in flight: end the requests that
        could never finish (``RequestTable.never_finishing``) rather than step on forever."""
        for request, message in self.requests.never_finishing(self.kv):
            self._fail_request(request, message)

    def _fail_request(self, request: CoreRequest, message: str, kind: str = ERROR_ENGINE) -> None:
        """End every sequence of a live request now (their blocks go back, their tokens on the way are
        dropped) and report ``message`` as its error; the rest of the engine goes on."""
        self.requests.end_request(request, "abort")
        self._outputs.fail(request.request_id, message, request.seqs, kind)

    def _fail_grammar(self, seq: Sequence, reason: str) -> None:
        """``seq``'s grammar raised (filling its mask, taking a token or a draft, rolling back): its
        request ends with an engine error, and every other request, in the step or not, goes on."""
        request = self.requests.get(seq.request_id)
        if request is None or seq not in request.seqs:
            return  # its request ended already
        logger.error("request %s: its structured output's grammar failed: %s", seq.request_id, reason)
        self._fail_request(request, f"the engine failed while running this request's structured output: {reason}")
