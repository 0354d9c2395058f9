"""LLMEngine: requests in, one step at a time (schedule → run → update), outputs out.

The engine knows nothing of HTTP or of threads: the offline ``LLM`` drives it in
a loop, the async server wraps it.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
import torch

from tokenmill.default_model import DEFAULT_MODEL_DIR
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.model_runner import InFlightStep, ModelRunner, build_model
from tokenmill.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tokenmill.engine.sequence import PENDING, Sequence
from tokenmill.loader.hf_config import ModelConfig, load_model_config, resolve_dtype
from tokenmill.outputs import CompletionOutput, Logprobs, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    """Engine options, named as in vLLM. ``model=None`` is the embedded default model."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    static_batching: bool = False
    enforce_eager: bool = False  # no CUDA graphs
    async_scheduling: bool = True  # launch step N+1 before reading step N's tokens (host/GPU overlap)
    random_weights: bool = False  # real shapes, random values: for benchmarks

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    stream: bool = True  # an output every step, or only the final one
    finished: bool = False


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but no CUDA device is available")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    return torch.device(name)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = Path(config.model) if config.model is not None else DEFAULT_MODEL_DIR
        self.model_dir = model_dir
        self.model_config: ModelConfig = load_model_config(model_dir)
        cfg = self.model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, cfg, self.device)
        torch.manual_seed(config.seed)
        self.tokenizer = None if config.random_weights else load_tokenizer(model_dir)
        max_len = config.max_model_len or cfg.max_position_embeddings
        started = time.monotonic()
        model = build_model(cfg, None if config.random_weights else model_dir, self.dtype, self.device,
                            max_len, config.seed)
        load_seconds = time.monotonic() - started
        num_blocks = self._num_kv_blocks(max_len)
        capacity = num_blocks * config.block_size
        if capacity < max_len:
            logger.warning("max_model_len lowered from %d to %d: the KV pool holds %d blocks of %d",
                           max_len, capacity, num_blocks, config.block_size)
            max_len = capacity
        self.max_model_len = max_len
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.static_batching), self.kv)
        started = time.monotonic()
        self.runner = ModelRunner(cfg, model, num_blocks, config.block_size, self.device, self.dtype,
                                  max_num_seqs=config.max_num_seqs, max_model_len=max_len,
                                  cuda_graphs=not config.enforce_eager)
        self.startup_seconds = {"load": load_seconds, "kv_cache_and_graphs": time.monotonic() - started}
        if self.device.type == "cuda":  # nothing is compiled on the CPU path
            started = time.monotonic()
            self.runner.warm_up(config.max_num_batched_tokens, max_len)
            self.startup_seconds["warm_up"] = time.monotonic() - started
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.stats = EngineStats()
        self._in_flight: InFlightStep | None = None

    # ----------------------------------------------------------------- sizing
    def _num_kv_blocks(self, max_len: int) -> int:
        cfg, config = self.model_config, self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = cfg.kv_bytes_per_token(self.dtype) * config.block_size
        enough = config.max_num_seqs * -(-max_len // config.block_size)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_elsewhere = total - free
            elem = torch.tensor([], dtype=self.dtype).element_size()
            tokens = config.max_num_batched_tokens
            activations = tokens * elem * (6 * cfg.hidden_size + 4 * cfg.intermediate_size
                                           + 3 * cfg.num_heads * cfg.head_dim)
            logits = config.max_num_seqs * cfg.vocab_size * 4 * 4
            budget = total * config.gpu_memory_utilization - used_elsewhere - activations - logits - (1 << 30)
        else:
            budget = config.cpu_kv_cache_gib * (1 << 30)
        blocks = min(int(budget // per_block), enough)
        if blocks < 1:
            raise ValueError("no memory is left for the KV cache: lower max_num_seqs or max_num_batched_tokens, "
                             "or raise gpu_memory_utilization / cpu_kv_cache_gib")
        return blocks

    # --------------------------------------------------------------- requests
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
        return self.tokenizer.encode(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, stream: bool = True) -> None:
        """Validate and queue a request; raises ValueError for bad input, leaving the engine as it was.
        With ``stream=False`` ``step`` reports the request only once it is finished, which spares
        copying its growing output every step (the offline API wants only the end)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling params must be a SamplingParams")
        text = prompt if isinstance(prompt, str) else None
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(ids)
        if params.logprobs is not None and params.logprobs > self.model_config.vocab_size:
            raise ValueError(f"logprobs must be <= the vocabulary size {self.model_config.vocab_size}")
        now = time.monotonic() if arrival_time is None else arrival_time
        seqs = [self._new_sequence(request_id, i, ids, params, now) for i in range(params.n)]
        request = Request(request_id, text, ids, params, seqs, RequestMetrics(arrival_time=now), stream)
        self.requests[request_id] = request
        for seq in seqs:
            self.scheduler.add(seq)

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                             "it must be shorter to leave room for at least one new token")

    def _new_sequence(self, request_id: str, index: int, ids: list[int], params: SamplingParams,
                      now: float) -> Sequence:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed((params.seed * 65537 + index) % (1 << 63))
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        seq = Sequence(next(self._seq_ids), request_id, index, ids, params, now, detok, generator,
                       eos_token_ids=self.model_config.eos_token_ids)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output, or None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            seq.drop_pending()
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        request.finished = True
        request.metrics.finished_time = time.monotonic()
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._in_flight is not None

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One iteration: returns the outputs of the requests that changed.

        Steps overlap: the next step is scheduled and launched before this one's sampled
        ids are read, so the device runs it while the host appends tokens and checks stops
        (its inputs take the pending ids on the device). A sequence that stops here has run
        one step too many, which is thrown away. Penalties need every output token on the
        host, so while a running sequence uses them steps run one at a time.
        """
        if self._in_flight is None:
            self._in_flight = self._launch(None)
            if self._in_flight is None:
                return []
        following = self._launch(self._in_flight) if self._can_overlap() else None
        current, self._in_flight = self._in_flight, following
        return self._complete(current)

    def _can_overlap(self) -> bool:
        return self.config.async_scheduling and not any(seq.params.uses_penalties for seq in self.scheduler.running)

    def _launch(self, previous: InFlightStep | None) -> InFlightStep | None:
        """Schedule and enqueue a step; each sequence that samples gets a ``PENDING`` token."""
        batch = self.scheduler.schedule()
        self.stats.num_preemptions += batch.num_preempted
        if not batch.seqs:
            return None
        step = self.runner.launch(batch, previous)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
        self.stats.record_step(batch)
        for seq in step.sampled_seqs:
            step.pending_index.append(seq.num_tokens)
            seq.token_ids.append(PENDING)
            seq.num_pending += 1
            if self._reaches_length_limit(seq.params, seq.num_output_tokens, seq.num_tokens):
                # This token is its last whatever it is: leave the batch now, not a step late.
                self.scheduler.finish(seq)
        return step

    def _complete(self, step: InFlightStep) -> list[RequestOutput]:
        """Read a launched step's tokens, append them, check stops; the outputs that changed."""
        result = self.runner.collect(step)
        for seq in step.batch.seqs:
            if not seq.is_finished:
                self.kv.commit_computed_blocks(seq)
        for seq, values in result.prompt_logprobs.items():
            if seq.prompt_logprobs is not None:
                seq.prompt_logprobs.extend(values)
        touched: dict[str, Request] = {}
        now = time.monotonic()
        for seq, index, token, logprobs in zip(result.sampled_seqs, step.pending_index, result.token_ids,
                                               result.logprobs):
            if index >= seq.num_tokens or seq.token_ids[index] != PENDING:
                continue  # the sequence ended meanwhile: nobody wants this token
            self._accept_token(seq, index, token, logprobs, now)
            touched[seq.request_id] = self.requests[seq.request_id]
        outputs = []
        for request in touched.values():
            # A sequence that left the batch at launch (its last token) still awaits that token.
            if all(seq.is_finished and not seq.num_pending for seq in request.seqs):
                request.finished = True
                request.metrics.finished_time = now
                del self.requests[request.request_id]
            if request.stream or request.finished:
                outputs.append(self._output(request))
        return outputs

    def _accept_token(self, seq: Sequence, index: int, token: int, logprobs: Logprobs | None, now: float) -> None:
        """Put the sampled token in its placeholder at ``index`` and apply the stop rules as of it."""
        params = seq.params
        request = self.requests[seq.request_id]
        seq.token_ids[index] = token
        seq.num_pending -= 1
        num_output = index + 1 - seq.num_prompt_tokens
        self.stats.generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token]
        finished_by_token = False
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in seq.eos_token_ids:
                seq.finish_reason, finished_by_token = "stop", True
            elif token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason, finished_by_token = "stop", token, True
        if seq.detokenizer is not None and not finished_by_token:
            old_len = len(seq.text)
            seq.text += seq.detokenizer.add(token)
            if params.stop_strings and num_output >= params.min_tokens:
                self._check_stop_strings(seq, old_len)
        if seq.finish_reason is None and self._reaches_length_limit(params, num_output, index + 1):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.drop_pending()
            self.scheduler.finish(seq)

    def _reaches_length_limit(self, params: SamplingParams, num_output: int, num_tokens: int) -> bool:
        return (params.max_tokens is not None and num_output >= params.max_tokens) or num_tokens >= self.max_model_len

    @staticmethod
    def _check_stop_strings(seq: Sequence, old_len: int) -> None:
        """End at the first stop string that the new text completes; the text ends before it."""
        longest = max(len(s) for s in seq.params.stop_strings)
        search_from = max(0, old_len - longest + 1)
        hits = [(seq.text.find(s, search_from), s) for s in seq.params.stop_strings]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return
        index, stop = min(hits)
        end = index + len(stop) if seq.params.include_stop_str_in_output else index
        seq.text = seq.text[:end]
        seq.finish_reason, seq.stop_reason = "stop", stop

    # ---------------------------------------------------------------- outputs
    @staticmethod
    def _visible_text(seq: Sequence) -> str:
        """While a sequence runs, hold back the tail that could still become a stop string,
        so a stream never shows text that the stop string will take back."""
        if seq.is_finished or not seq.params.stop_strings:
            return seq.text
        hold = max(len(s) for s in seq.params.stop_strings) - 1
        return seq.text[:max(0, len(seq.text) - hold)] if hold else seq.text

    def _output(self, request: Request) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=self._visible_text(seq),
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in request.seqs
        ]
        first = request.seqs[0]
        metrics = request.metrics
        metrics.num_cached_tokens = first.num_cached_tokens
        metrics.num_preemptions = sum(s.num_preemptions for s in request.seqs)
        metrics.first_scheduled_time = first.first_scheduled_time
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            metrics=metrics,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            num_cached_tokens=first.num_cached_tokens,
        )


@dataclass
class EngineStats:
    """Counters since start, read by the server's metrics."""

    num_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0

    def record_step(self, batch: ScheduledBatch) -> None:
        """Count the step's prompt tokens (called after ``num_computed_tokens`` moved on)."""
        self.num_steps += 1
        for seq, n in zip(batch.seqs, batch.num_tokens):
            end = seq.num_computed_tokens
            self.prompt_tokens += max(0, min(end, seq.num_prompt_tokens) - (end - n))
