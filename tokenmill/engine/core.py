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

import atexit
import gc
import itertools
import logging
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
import torch

from tokenmill.default_model import DEFAULT_MODEL_DIR
from tokenmill.distributed import SINGLE, destroy_group, init_group
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.messages import (
    AbortRequests,
    AbortSequence,
    AddRequest,
    CoreInput,
    CoreOutputs,
    CoreReady,
    CoreStats,
    RequestDelta,
    SeqDelta,
)
from tokenmill.engine.model_runner import InFlightStep, StepResult, build_model
from tokenmill.engine.rank import (
    RankSetup,
    check_tensor_parallel,
    context_length,
    kv_cache_blocks,
    make_runner,
    quantize,
    rank_device,
    resolve_device,
    token_budget,
)
from tokenmill.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig, StepCost, StepWork
from tokenmill.engine.sequence import PENDING, Sequence
from tokenmill.engine.spec_decode import MAX_FAILED_DRAFTS, TokenHistory, accepted_length, propose_ngram
from tokenmill.engine.structured_outputs import CompileJob, GrammarCompiler, grammar_error_reason
from tokenmill.engine.tp_workers import COLLECTIVE_TIMEOUT, WorkerError, WorkerGroup
from tokenmill.layers import ops
from tokenmill.loader.hf_config import ModelConfig, load_model_config, resolve_dtype
from tokenmill.loader.kv_layout import is_quantized, resolve_kv_cache_dtype
from tokenmill.outputs import ERROR_ENGINE, ERROR_INVALID, ERROR_UNAVAILABLE, Logprobs
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _stop_tensor_parallel(workers: WorkerGroup, abort: bool = False) -> None:
    """Stop the workers, then leave the process group: also run when an engine nobody shut down is
    collected, so that its workers do not outlive it."""
    workers.close()
    destroy_group(abort)


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (modules, weights' wrappers, tokenizers) out of
    the garbage collector's reach: otherwise each full collection walks millions of objects
    that never die, and the steps that trigger one pay milliseconds for it."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # let them be finalized normally when the process ends


def model_dir_of(config: EngineConfig) -> Path:
    return Path(config.model) if config.model is not None else DEFAULT_MODEL_DIR


@dataclass(eq=False)
class CoreRequest:
    request_id: str
    params: SamplingParams
    seqs: list[Sequence]


# The start-up log's words for ``EngineCore.startup_seconds``.
STARTUP_PHASES = {
    "load": "weights",
    "kv_cache_and_graphs": "KV cache and CUDA graphs",
    "warm_up": "kernel compilation and warm-up",
}


class EngineCore:
    """Under tensor parallelism (``tensor_parallel_size`` > 1) the core is rank 0: it holds the first
    share of the model and drives the other ranks' worker processes (``engine/tp_workers.py``)."""

    def __init__(self, config: EngineConfig) -> None:
        model_dir = model_dir_of(config)
        self.model_config: ModelConfig = load_model_config(model_dir)
        cfg = self.model_config
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            # One engine a process watches Triton's compiles: the newest, once it has started, so that an
            # engine built before this one does not count this one's start-up as its own steps' compiles.
            ops.watch_compiles(None)
        check_tensor_parallel(config, cfg, self.device, model_dir)
        self.device = rank_device(self.device, 0) if config.tensor_parallel_size > 1 else self.device
        config = replace(
            config,
            max_num_batched_tokens=token_budget(config.max_num_batched_tokens, self.device),
            max_model_len=context_length(config.max_model_len, cfg),
        )
        self.config = config
        self.dtype = resolve_dtype(config.dtype, cfg, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.workers: WorkerGroup | None = None
        self.tp = SINGLE
        if config.tensor_parallel_size == 1:
            self._start(config, cfg, model_dir)
            return
        self.workers = WorkerGroup(config, model_dir)  # they load their shards while this rank loads its own
        self._stop_workers = weakref.finalize(self, _stop_tensor_parallel, self.workers)
        try:
            self.workers.receive("start-up message")
            self.tp = init_group(
                self.device, 0, config.tensor_parallel_size, self.workers.init_method, COLLECTIVE_TIMEOUT
            )
            self._start(config, cfg, model_dir)
            self.workers.receive("ready message")
        except BaseException:
            self.shutdown(abort=True)
            raise

    def _start(self, config: EngineConfig, cfg: ModelConfig, model_dir: Path) -> None:
        torch.manual_seed(config.seed)
        max_len = config.max_model_len
        started = time.monotonic()
        model = build_model(
            cfg, None if config.random_weights else model_dir, self.dtype, self.device, max_len, config.seed, self.tp
        )
        self.quantization = quantize(model, config, model_dir, self.device)
        load_seconds = time.monotonic() - started
        if any(getattr(m, "kv_amax", None) is not None for m in model.modules()):
            logger.info(
                "the checkpoint's k_scale/v_scale %s",
                "set the KV cache's scales" if is_quantized(self.kv_dtype) else "are unused: kv_cache_dtype is auto",
            )
        layout = cfg.kv_layout().sharded(config.tensor_parallel_size)
        num_blocks = kv_cache_blocks(config, cfg, self.device, self.dtype, self.kv_dtype, max_len)
        if self.workers is not None:  # every rank's pools must hold the same blocks: the smallest wins
            num_blocks = [min(counts) for counts in zip(num_blocks, *self.workers.receive("KV cache size"))]
        windows = [spec.sliding_window for spec in layout.groups]
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, windows)
        longest = self.kv.longest_sequence(config.max_num_batched_tokens)
        if longest < max_len:
            logger.warning(
                "max_model_len lowered from %d to %d: the KV pools hold %s blocks of %d",
                max_len,
                longest,
                num_blocks,
                config.block_size,
            )
            max_len = int(longest)
        self.max_model_len = max_len
        # On the CPU prompt chunks beside decoding sequences are sized from the steps' measured times.
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs, config.max_num_batched_tokens, config.static_batching, config.scheduling_policy
            ),
            self.kv,
            StepCost() if self.device.type == "cpu" else None,
        )
        started = time.monotonic()
        setup = RankSetup(num_blocks, max_len)
        if self.workers is not None:
            self.workers.send(setup)
        self.runner = make_runner(
            config, cfg, model, setup, self.device, self.dtype, self.kv_dtype, self.tp, self.workers
        )
        self.startup_seconds = {"load": load_seconds, "kv_cache_and_graphs": time.monotonic() - started}
        if self.device.type == "cuda":  # nothing is compiled on the CPU path
            started = time.monotonic()
            self.runner.warm_up(config.max_num_batched_tokens, max_len)
            self.startup_seconds["warm_up"] = time.monotonic() - started
        self.requests: dict[str, CoreRequest] = {}
        self.spec = config.speculative_config
        self._histories = TokenHistory()
        self.grammars = GrammarCompiler(
            model_dir, cfg.vocab_size, cfg.eos_token_ids, config.grammar_compile_workers, config.grammar_cache_bytes
        )
        # Requests whose constraint is compiling: (request, priority, its compile, since when), in arrival order.
        self._compiling: list[tuple[CoreRequest, int, CompileJob, float]] = []
        self._seq_ids = itertools.count()
        self.stats = CoreStats()
        if self.device.type == "cuda":
            ops.watch_compiles(self._compiled_after_startup)
        self._in_flight: InFlightStep | None = None
        self._deltas: dict[str, RequestDelta] = {}  # news since the last step's outputs
        groups = "; ".join(
            f"{len(layout.owners(g))} layers of {spec.num_kv_heads}x{spec.head_dim}"
            f"{'' if spec.sliding_window is None else f' (window {spec.sliding_window})'}: {n} blocks"
            for g, (spec, n) in enumerate(zip(layout.groups, num_blocks))
        )
        logger.info(
            "engine ready: %s on %s (%s%s), max_model_len %d, KV cache %s in blocks of %d tokens: %s; %d bytes "
            "per token (%d if every layer kept its own full-length cache)%s; start-up %s",
            model_dir,
            self.device,
            str(self.dtype).removeprefix("torch."),
            f", tensor parallel over {self.tp.size} ranks" if self.tp.size > 1 else "",
            max_len,
            config.kv_cache_dtype,
            config.block_size,
            groups,
            layout.bytes_per_token(self.kv_dtype),
            layout.full_length_bytes_per_token(self.kv_dtype),
            " on each rank" if self.tp.size > 1 else "",
            ", ".join(f"{STARTUP_PHASES[name]} {seconds:.1f} s" for name, seconds in self.startup_seconds.items()),
        )
        started = time.monotonic()
        freeze_startup_objects()
        self.startup_seconds["gc_freeze"] = time.monotonic() - started

    def _compiled_after_startup(self, kernel: str, variant: str) -> None:
        """Triton compiles a kernel variant that start-up did not: the step that needs it waits."""
        self.stats.num_compiles_after_startup += 1
        logger.warning(
            "Triton compiled a variant of %s after start-up, inside a step that waits for it: the "
            "warm-up missed this shape: %s",
            kernel,
            variant,
        )

    def shutdown(self, abort: bool = False) -> None:
        """Stop the tensor-parallel workers and leave the process group (nothing to do with one rank).
        ``abort``: a rank failed, so collectives may never finish."""
        if self.workers is not None:
            self._stop_workers.detach()
            _stop_tensor_parallel(self.workers, abort)
            self.workers = None

    def ready_message(self) -> CoreReady:
        cfg = self.model_config
        return CoreReady(
            max_model_len=self.max_model_len,
            vocab_size=cfg.vocab_size,
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
        """Queue a request the front-end validated (and whose id it checked is free)."""
        params = request.params
        ids = tuple(request.prompt_token_ids)  # one tuple for the request's sequences
        seqs = [self._new_sequence(request.request_id, i, ids, params, request.arrival_time) for i in range(params.n)]
        core_request = self.requests[request.request_id] = CoreRequest(request.request_id, params, seqs)
        if params.structured_outputs is not None:  # scheduled once its grammar is compiled
            job = self.grammars.submit(params.structured_outputs)
            self._compiling.append((core_request, request.priority, job, time.monotonic()))
            return
        for seq in seqs:
            self.scheduler.add(seq, request.priority)

    def _admit_compiled(self) -> None:
        """Schedule the requests whose constraint has compiled (waiting a moment for the first when
        nothing else can run, so messages are still read between waits); fail those whose constraint
        does not compile (the request's fault), and those that waited too long for it
        (``GrammarCompiler.overdue``: the engine's limit, which a retry may find free)."""
        if self._compiling and not self.scheduler.running and not self.scheduler.waiting:
            wait([self._compiling[0][2]], timeout=0.05, return_when=FIRST_COMPLETED)
        still = []
        now = time.monotonic()
        for entry in self._compiling:
            request, priority, job, since = entry
            if self.requests.get(request.request_id) is not request:
                self.grammars.release(job)  # aborted meanwhile
                continue
            if not job.done():
                reason = self.grammars.overdue(job, since, now)
                if reason is None:
                    still.append(entry)
                else:
                    self.grammars.release(job)
                    self._fail_request(request, f"structured_outputs cannot be compiled: {reason}", ERROR_UNAVAILABLE)
                continue
            self.grammars.release(job)
            error = job.exception()
            if error is not None:
                self._fail_request(request, f"structured_outputs cannot be compiled: {error}", ERROR_INVALID)
                continue
            try:
                matchers = [self.grammars.matcher(job.result()) for _ in request.seqs]
            except Exception as exc:
                self._fail_request(
                    request,
                    "the engine failed while starting this request's structured output: "
                    f"{type(exc).__name__}: {grammar_error_reason(exc)}",
                )
                continue
            for seq, matcher in zip(request.seqs, matchers):
                seq.matcher = matcher
                self.scheduler.add(seq, priority)
        self._compiling = still

    def _new_sequence(
        self, request_id: str, index: int, ids: tuple[int, ...], params: SamplingParams, now: float
    ) -> Sequence:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed((params.seed * 65537 + index) % (1 << 63))
        limit = (
            self.max_model_len if params.max_tokens is None else min(self.max_model_len, len(ids) + params.max_tokens)
        )
        return Sequence(
            next(self._seq_ids),
            request_id,
            index,
            ids,
            params,
            now,
            generator,
            eos_token_ids=self.model_config.eos_token_ids,
            token_limit=limit,
        )

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown ids are ignored (it may have
        finished while the abort travelled). No output follows an abort."""
        request = self.requests.pop(request_id, None)
        self._deltas.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            self._end(seq, "abort")

    def abort_sequence(self, request_id: str, index: int) -> None:
        """End one sequence of a request (the front-end saw a stop string); the request ends
        once all its sequences have."""
        request = self.requests.get(request_id)
        if request is None or not 0 <= index < len(request.seqs):
            return
        seq = request.seqs[index]
        if seq.is_finished:
            return
        self._end(seq, "stop")
        if self._request_done(request):
            self._delta(request).finished = True
            self._retire(request)

    def _end(self, seq: Sequence, reason: str) -> None:
        seq.drop_pending()
        self._histories.forget(seq.seq_id)
        if not seq.is_finished:
            self.scheduler.finish(seq)
            seq.finish_reason = seq.finish_reason or reason

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
        outputs, self._deltas = list(self._deltas.values()), {}
        return CoreOutputs(outputs, self._snapshot())

    def _step(self) -> None:
        """Steps overlap: the next step is scheduled and launched before this one's sampled
        ids are read, so the device runs it while the host appends tokens and checks stops
        (its inputs take the pending ids on the device). A sequence that stops here has run
        one step too many, which is thrown away. A grammar's mask needs every output token
        on the host: a step with constrained rows runs its forward under the one before, and
        samples once that one's tokens are read."""
        if self._compiling:
            self._admit_compiled()
        if self._in_flight is None:
            self._in_flight = self._launch(None)
            if self._in_flight is None:
                self._fail_unschedulable()
                return
        following = self._launch(self._in_flight) if self._can_overlap(self._in_flight) else None
        current, self._in_flight = self._in_flight, following
        self._complete(current)
        if following is not None and following.pending_sample is not None:
            self.runner.sample(following)  # its grammars now know current's tokens

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
        """Nothing runs, nothing could be admitted and no step is in flight: a request that is done
        yet never ended (none of its sequences runs or waits, no token of it is on its way: it never
        had a sequence) will never end by itself; nor will one whose first waiting sequence does not
        fit the whole KV pool. End them rather than step on forever."""
        for request in [request for request in self.requests.values() if self._request_done(request)]:
            self._retire(request)
            self._fail(
                request.request_id,
                f"the engine has nothing left to run for this request "
                f"({len(request.seqs)} sequences, n = {request.params.n}): it could never finish",
                request.seqs,
            )
        if self.scheduler.running or not self.scheduler.waiting:
            return
        seq = self.scheduler.waiting[0]
        request = self.requests.pop(seq.request_id)
        for s in request.seqs:
            self._end(s, "abort")
        self._fail(
            request.request_id,
            f"the request's {seq.num_tokens} tokens need more KV blocks than the "
            f"pools hold ({[self.kv.usable_blocks(g) for g in range(self.kv.num_groups)]} blocks of "
            f"{self.kv.block_size}): it can never run",
            request.seqs,
        )

    def _fail_request(self, request: CoreRequest, message: str, kind: str = ERROR_ENGINE) -> None:
        """End every sequence of a live request now (their blocks go back, their tokens on the way are
        dropped) and report ``message`` as its error; the rest of the engine goes on."""
        del self.requests[request.request_id]
        for seq in request.seqs:
            self._end(seq, "abort")
            seq.matcher = None  # (no later step asks its grammar again)
        self._fail(request.request_id, message, request.seqs, kind)

    def _fail_grammar(self, seq: Sequence, reason: str) -> None:
        """``seq``'s grammar raised (filling its mask, taking a token or a draft, rolling back): its
        request ends with an engine error, and every other request, in the step or not, goes on."""
        request = self.requests.get(seq.request_id)
        if request is None or seq not in request.seqs:
            return  # its request ended already
        logger.error("request %s: its structured output's grammar failed: %s", seq.request_id, reason)
        self._fail_request(request, f"the engine failed while running this request's structured output: {reason}")

    def _fail(self, request_id: str, message: str, seqs: list[Sequence], kind: str = ERROR_ENGINE) -> None:
        """End a request with ``message``; ``kind``: whose fault (``tokenmill.outputs.ERROR_ENGINE``)."""
        self._deltas[request_id] = RequestDelta(
            request_id,
            [SeqDelta(s.index, [], finish_reason="abort") for s in seqs],
            finished=True,
            error=message,
            error_kind=kind,
        )

    def _can_overlap(self, in_flight: InFlightStep) -> bool:
        """Drafts are proposed from every known token, and a step with drafts decides how many tokens
        each sequence computed only once it is verified: while speculation is on, steps run one at
        a time."""
        if not self.config.async_scheduling or self._speculating():
            return False
        return self.spec is None or not any(seq.draft_token_ids for seq in in_flight.batch.seqs)

    def _speculating(self) -> bool:
        return self.spec is not None and len(self.scheduler.running) < self.spec.disable_by_batch_size

    def _propose_drafts(self) -> None:
        """Drafts for each running sequence that decodes next (prompt lookup), as many as its token
        limits leave room for after the token the step samples anyway."""
        spec = self.spec
        for seq in self.scheduler.running:
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

    def _verify_drafts(self, seq: Sequence, samples: list[int]) -> int:
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

    def _launch(self, previous: InFlightStep | None) -> InFlightStep | None:
        """Schedule and enqueue a step; each sequence that samples gets a ``PENDING`` token."""
        if previous is None and self._speculating():
            self._propose_drafts()
        batch = self.scheduler.schedule()
        self.stats.num_preemptions += batch.num_preempted
        if not batch.seqs:
            return None
        step_cost = self.scheduler.step_cost
        if step_cost is None:
            step = self.runner.launch(batch, previous)
        else:  # the CPU: the forward runs inside the launch, and its time sizes the next steps' chunks
            work = StepWork.of(batch.seqs, batch.num_tokens)
            started = time.perf_counter()
            step = self.runner.launch(batch, previous)
            step_cost.observe(work, time.perf_counter() - started)
        self._advance(batch)
        for rows in step.prompt_rows:  # each prompt position's logprobs are given once
            rows.seq.next_prompt_logprob_position = rows.first + rows.count
        pending_index = step.pending_index
        for seq in step.sampled_seqs:
            token_ids = seq.token_ids
            num_tokens = len(token_ids)
            pending_index.append(num_tokens)
            token_ids.append(PENDING)
            seq.num_pending += 1
            if num_tokens + 1 >= seq.token_limit:
                # This token is its last whatever it is: leave the batch now, not a step late.
                self.scheduler.finish(seq)
        return step

    def _complete(self, step: InFlightStep) -> None:
        """Read a launched step's tokens, append them, check the token-level stops."""
        result = self.runner.collect(step)
        self.kv.commit_step(step.batch.seqs)
        if step.failed_seqs:  # their grammars raised as the step sampled: their tokens are void
            for seq, reason in step.failed_seqs.items():
                self._fail_grammar(seq, reason)
        for seq, values in result.prompt_logprobs.items():
            if seq.request_id in self.requests and seq.index == 0:
                delta = self._delta(self.requests[seq.request_id])
                delta.prompt_logprobs = (delta.prompt_logprobs or []) + values
        ended: dict[str, CoreRequest] = {}
        plain = result.starts is None and not result.generator_states
        rest = self._accept_plain(result, step.pending_index) if plain else range(len(result.sampled_seqs))
        for i in rest:
            seq, index, rows = result.sampled_seqs[i], step.pending_index[i], result.rows(i)
            tokens = result.token_ids[rows.start : rows.stop]
            logprobs = result.logprobs.get(i) or [None] * len(tokens)
            if index >= len(seq.token_ids) or seq.token_ids[index] != PENDING:
                continue  # the sequence ended meanwhile: nobody wants this token
            request = self.requests[seq.request_id]
            out = self._seq_delta(request, seq)
            speculated = bool(seq.draft_token_ids)
            count = self._verify_drafts(seq, tokens) if speculated else 1
            states = result.generator_states.get(seq)
            if states is not None:  # one draw per emitted token, as plain decoding takes
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
            if self.requests.get(request.request_id) is request and self._request_done(request):
                self._delta(request).finished = True
                self._retire(request)

    def _accept_plain(self, result: StepResult, pending_index: list[int]) -> list[int]:
        """The common case of ``_complete`` at a fraction of its cost a sequence: a lone sequence
        (``n`` = 1) whose one new token neither ends it nor needs logprobs or a grammar takes it
        here. Returns the positions of the others among the step's sampled sequences, which the
        rest of ``_complete`` takes one by one."""
        rest, deltas = [], self._deltas
        for i, (seq, index, token) in enumerate(zip(result.sampled_seqs, pending_index, result.token_ids)):
            token_ids = seq.token_ids
            if (
                index + 1 >= seq.token_limit
                or token in seq.stop_ids
                or seq.matcher is not None
                or seq.params.n != 1
                or seq.request_id in deltas
                or seq.params.logprobs is not None
                or index >= len(token_ids)
                or token_ids[index] != PENDING
            ):
                rest.append(i)
                continue
            token_ids[index] = token
            seq.num_pending -= 1
            deltas[seq.request_id] = RequestDelta(
                seq.request_id,
                [SeqDelta(seq.index, [token])],
                num_cached_tokens=seq.num_cached_tokens,
                num_preemptions=seq.num_preemptions,
                first_scheduled_time=seq.first_scheduled_time,
                spec_drafts=seq.spec_drafts,
                spec_draft_tokens=seq.spec_draft_tokens,
                spec_accepted_tokens=seq.spec_accepted_tokens,
            )
        self.stats.generation_tokens += len(result.sampled_seqs) - len(rest)
        return rest

    def _retire(self, request: CoreRequest) -> None:
        """Forget a request whose sequences have all ended."""
        del self.requests[request.request_id]
        for seq in request.seqs:
            self._histories.forget(seq.seq_id)

    @staticmethod
    def _request_done(request: CoreRequest) -> bool:
        return all(seq.is_finished and not seq.num_pending for seq in request.seqs)

    def _delta(self, request: CoreRequest) -> RequestDelta:
        delta = self._deltas.get(request.request_id)
        if delta is None:
            first = request.seqs[0]
            preemptions = drafts = draft_tokens = accepted = 0
            for seq in request.seqs:  # (one loop: this runs for every request every step)
                preemptions += seq.num_preemptions
                drafts += seq.spec_drafts
                draft_tokens += seq.spec_draft_tokens
                accepted += seq.spec_accepted_tokens
            delta = self._deltas[request.request_id] = RequestDelta(
                request.request_id,
                [],
                num_cached_tokens=first.num_cached_tokens,
                num_preemptions=preemptions,
                first_scheduled_time=first.first_scheduled_time,
                spec_drafts=drafts,
                spec_draft_tokens=draft_tokens,
                spec_accepted_tokens=accepted,
            )
        return delta

    def _seq_delta(self, request: CoreRequest, seq: Sequence) -> SeqDelta:
        delta = self._delta(request)
        for item in delta.seqs:
            if item.index == seq.index:
                return item
        item = SeqDelta(seq.index, [], [] if seq.params.logprobs is not None else None)
        delta.seqs.append(item)
        return item

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
            except Exception as exc:
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
            elif token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
        if seq.finish_reason is None and index + 1 >= seq.token_limit:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
            seq.drop_pending()
            self.scheduler.finish(seq)

    # ------------------------------------------------------------------ stats
    def _advance(self, batch: ScheduledBatch) -> None:
        """Move each sequence past the tokens the launched step computes; count the prompt tokens among them."""
        self.stats.num_steps += 1
        prompt_tokens = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            end = seq.num_computed_tokens = start + n
            if start < len(seq.prompt_token_ids):
                prompt_tokens += min(end, len(seq.prompt_token_ids)) - start
        self.stats.prompt_tokens += prompt_tokens

    def _snapshot(self) -> CoreStats:
        scheduler, kv, stats = self.scheduler, self.kv, self.stats
        stats.num_running, stats.num_waiting = scheduler.num_running_requests, scheduler.num_waiting_requests
        stats.kv_usage = kv.usage()
        stats.kv_blocks_in_use = kv.num_blocks_in_use
        stats.kv_blocks_cached = kv.num_cached
        stats.prefix_cache_queries, stats.prefix_cache_hits = kv.query_tokens, kv.hit_tokens
        return msgspec.structs.replace(stats)  # a copy: the in-process caller may keep it
