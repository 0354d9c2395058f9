"""Flattens a scheduled batch into one ragged forward, runs it, and samples.

The model runner owns the device state: the weights, the KV cache tensors,
the sampler. It turns the scheduler's choice into ``input_ids``,
``positions``, ``slot_mapping``, ``query_start_loc``, ``seq_lens``,
``block_tables`` and ``logits_indices`` (the rows that need the LM head), and
returns the sampled token of every sequence that reached the end of its known
tokens this step; a sequence with drafts (speculative decoding) gets a sample at
its last known token and after each draft, for the engine to verify them.

Under tensor parallelism the engine's runner is rank 0's: it sends each step's
``StepPlan`` (the flat batch's host arrays and the forward's path) to the other
ranks' runners, which ``follow`` it through the same forward, and after sampling
it broadcasts the sampled ids, which every rank's next step reads on the device.
Sampling, and every sequence's sampling state, stay on rank 0.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Protocol, cast

import numpy as np
import torch

from tokenmill.distributed import SINGLE, TPGroup, broadcast, sharding_for
from tokenmill.engine.sequence import PENDING, Sequence, SequenceStatus
from tokenmill.engine.step import ScheduledStep, StepResult
from tokenmill.engine.worker.cuda_graphs import DecodeGraphs
from tokenmill.engine.worker.host_staging import HostStaging, to_device
from tokenmill.engine.worker.penalty_counts import PenaltyCounts
from tokenmill.engine.worker.prefill_graphs import PrefillGraphs
from tokenmill.engine.worker.sequence_rows import (
    FLOAT_COLUMNS,
    GRAMMAR,
    LOGIT_BIAS,
    LOGPROBS,
    MIN_TOKENS,
    PENALTIES,
    PROMPT_LOGPROBS,
    SEEDED,
    SamplingColumns,
    SequenceRows,
)
from tokenmill.layers.attention import AttentionMetadata, KVCache
from tokenmill.layers.fp8_linear import load_as_fp8
from tokenmill.layers.grammar_mask import HostBitmask, apply_grammars
from tokenmill.layers.linear import materialize, projections_deferred
from tokenmill.layers.sampler import Sampler, SamplingBatch, gather_logprobs
from tokenmill.loader.kv_layout import KVLayout, is_quantized, kv_scale_dtype
from tokenmill.loader.model_config import ModelConfig
from tokenmill.loader.weights import iter_checkpoint
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.registry import model_class
from tokenmill.outputs import Logprobs
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ForwardPath(enum.Enum):
    """The paths a step's forward takes (every rank takes the one rank 0 chose)."""

    DECODE_GRAPH = "decode_graph"
    VERIFY_GRAPH = "verify_graph"
    PREFILL_GRAPH = "prefill_graph"
    MIXED_GRAPH = "mixed_graph"
    EAGER = "eager"


@dataclass
class PromptLogprobRows:
    """One sequence's prompt positions whose logprobs this step gives: ``first`` onwards,
    ``count`` of them."""

    seq: Sequence
    first: int
    count: int


@dataclass
class PendingSample:
    """A launched step's sampling, held back until the tokens of the step before it are known: a
    grammar's mask is made from every output token so far."""

    logits: torch.Tensor
    batch: SamplingBatch
    greedy_ids: torch.Tensor | None


@dataclass
class InFlightStep:
    """A launched step: what ``collect`` needs to read its results once the device is done."""

    batch: ScheduledStep
    sampled_seqs: list[Sequence] = field(default_factory=list)
    rows_per_seq: list[int] = field(default_factory=list)  # sampled rows of each: 1 + its drafts
    prompt_rows: list[PromptLogprobRows] = field(default_factory=list)
    path: ForwardPath | None = None  # the forward's path
    token_ids: torch.Tensor | None = None  # on the device: the next step's pending inputs
    host: list[torch.Tensor | None] = field(default_factory=list)  # token ids, logprobs, their ids
    generator_states: dict[int, torch.Tensor] | None = None  # sampled row -> its generator's state
    done: torch.cuda.Event | None = None
    # Prompt logprobs on their way to the host: (sequence, values kept a position, values, their ids).
    prompt_logprobs: list[tuple[Sequence, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    prompt_logprobs_done: torch.cuda.Event | None = None
    pending_sample: PendingSample | None = None  # set while ``sample`` is still to run
    sampling_flags: int = 0  # every ``sequence_rows`` flag a sampled row sets
    failed_seqs: dict[Sequence, str] | None = None  # ``StepResult.failed_seqs``, as ``sample`` found them


@dataclass
class StepPlan:
    """A step's forward as every rank runs it, in a form that crosses processes: the flat batch's
    host arrays (ids, positions, slots, block tables, logits rows, pending rows and their sources),
    the path, and the sampled rows whose ids rank 0 broadcasts after it."""

    arrays: dict[str, np.ndarray]
    max_query_len: int
    max_seq_len: int
    path: ForwardPath
    picks_rows: bool  # a decode graph scores every row; the logits rows are picked out after it
    num_sampled_rows: int
    # Every row's id is the step before's sample of the same row (decode after decode of the same
    # sequences): the input ids are those samples as they lie on the device.
    pending_in_order: bool = False
    # A step of several-token queries and one-token ones: the first come first, this many sequences,
    # and each kind attends in a launch of its own where the step runs eagerly (0: one launch).
    num_chunk_seqs: int = 0


class Peers(Protocol):
    """The other ranks of a tensor-parallel engine, as rank 0's runner sees them."""

    def send(self, plan: StepPlan) -> None:
        """Have every other rank run ``plan`` (without waiting for them)."""

    def wait(self, event: torch.cuda.Event) -> None:
        """Wait for ``event`` as ``event.synchronize()`` would, raising if another rank has died."""


@dataclass
class FlatBatch:
    """A step's sequences flattened: the host arrays of its ragged batch (``StepPlan.arrays``) and what
    choosing its path and sampling need to know of it."""

    arrays: dict[str, np.ndarray]
    num_seqs: int
    total: int  # query tokens
    max_query_len: int
    max_seq_len: int
    num_chunk_seqs: int  # ``StepPlan.num_chunk_seqs``
    in_order: bool  # ``StepPlan.pending_in_order``
    sampled: list[Sequence]
    rows_per_seq: list[int]  # sampled rows of each sampled sequence: 1 + its drafts
    prompt_rows: list[PromptLogprobRows]
    sampling_rows: np.ndarray  # each sampled row's ``SequenceRows`` row


@dataclass
class StepInputs:
    """The flat ragged batch of one step: its plan, the plan's arrays and the sampling columns on the
    device, and which rows need the LM head."""

    plan: StepPlan
    tensors: dict[str, torch.Tensor]
    logits_rows: np.ndarray  # int64: prompt-logprob rows first, then each sampled sequence's rows
    sampled: list[Sequence]
    rows_per_seq: list[int]  # sampled rows of each sampled sequence: 1 + its drafts
    sampling_columns: dict[str, torch.Tensor]  # per sampled row, named as SamplingBatch's fields
    prompt_rows: list[PromptLogprobRows]
    host_sampling: SamplingColumns  # the same columns on the host
    sampling_flags: int  # every ``sequence_rows`` flag a sampled row sets


def build_model(
    model_config: ModelConfig,
    model_dir: Path | None,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    seed: int = 0,
    tp: TPGroup = SINGLE,
) -> LlamaForCausalLM:
    """The model (``tp.rank``'s share of it) on ``device`` in ``dtype``, with the checkpoint's weights, or
    random ones (std 0.02) when ``model_dir`` is None (benchmarks in real shapes, dense whatever the
    checkpoint). An FP8 checkpoint's projections are built without memory and made FP8 before it
    loads, so its values and scales are kept as stored and the dense projections are never held."""
    quantization = model_config.quantization if model_dir is not None else None
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        deferred = projections_deferred() if quantization is not None else contextlib.nullcontext()
        with torch.device(device), sharding_for(tp), deferred:
            model = model_class(model_config)(model_config, max_positions)
    finally:
        torch.set_default_dtype(previous)
    if model_dir is None:
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.data.fill_(1.0)
            else:
                param.data.normal_(0.0, 0.02, generator=gen)
    else:
        if quantization is not None:
            count = load_as_fp8(
                model,
                quantization.scheme,
                lambda name: quantization.quantizes(model.checkpoint_projections(name)),
                device,
            )
            materialize(model, device)
            logger.info("%d projections kept in FP8 as the checkpoint stores them: %s", count, quantization.scheme.name)
        model.load_weights(iter_checkpoint(model_dir))
    return model.eval()


def allocate_kv_caches(
    layout: KVLayout, num_blocks: list[int], block_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[list[torch.Tensor], list[KVCache]]:
    """One zeroed tensor per KV group, ``[owners, 2, blocks, block_size, kv_heads, head_dim]`` in ``dtype``
    (with, where it is quantized, one of scales ``[owners, 2, blocks, block_size, kv_heads]``), and each
    layer's ``KVCache``: views of its own slice, or of its source layer's when it shares KV. Returns the
    tensors (caches, then scales) and the layers' caches."""
    tensors: list[torch.Tensor] = []
    own: dict[int, KVCache] = {}
    for g, (spec, count) in enumerate(zip(layout.groups, num_blocks)):
        owners = layout.owners(g)
        shape = (len(owners), 2, count, block_size, spec.num_kv_heads)
        cache = torch.zeros(*shape, spec.head_dim, dtype=dtype, device=device)
        scales = torch.zeros(shape, dtype=kv_scale_dtype(spec.head_dim), device=device) if is_quantized(dtype) else None
        tensors += [cache] if scales is None else [cache, scales]
        for j, layer in enumerate(owners):
            own[layer] = KVCache(
                cache[j, 0], cache[j, 1], *((scales[j, 0], scales[j, 1]) if scales is not None else ())
            )
    return tensors, [own[src] for src in layout.source]


def warm_up_shapes(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> list[tuple[int, int, int]]:
    """The warm-up's forwards as (query tokens of one sequence, its context, decode rows beside it).

    Attention's variants follow its query-tile rows (the next power of two of query tokens times the
    GQA group, up to 128 or 64), whether the tiles of a ragged batch are numbered flat (a chunk longer
    than one tile beside other sequences) and whether the KV range is split (a grid under one program
    an SM), and on how many keys each program streams (``_tile_config``'s pipeline depth, over a
    one-byte cache or at head dim 256). A chunk of 256 tokens fills two tiles of the largest class at
    every group, 64 at groups of 4 and more; the shorter ones take each smaller class."""
    longest = max(2, min(max_num_batched_tokens - 1, max_model_len - 1))
    shapes = {(q, q, 1) for q in (2, 4, 8, 16, 64, 128) if q < longest} | {(longest, longest, 1)}
    # Chunks of every class beside one decode row deep into the longest context, whose KV ranges
    # split, and beside the widest batch, whose grid does not, over short and long ranges.
    few = [q for q in (2, 4, 8, 16, 32, 64, 256) if q < longest]
    if longest > 16:
        shapes |= {(q, max_model_len - 1, 1) for q in few}
    if max_num_seqs > 2:
        shapes |= {(q, context, max_num_seqs - 1) for q in few for context in (q, max_model_len - 1)}
    # Each chunk alone too (a lone sequence's tiles are not flat), but for the longest past 128 tokens:
    # it takes the 128-token one's attention variant and would cost a forward of the whole budget.
    shapes |= {(q, context, 0) for q, context, rows in list(shapes) if rows == 1 and (q < longest or q <= 128)}
    return sorted(shapes)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        model: LlamaForCausalLM,
        num_blocks: list[int],
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_num_seqs: int = 256,
        max_model_len: int = 2048,
        cuda_graphs: bool = True,
        kv_cache_dtype: torch.dtype | None = None,
        verify_len: int = 0,
        max_verify_seqs: int = 0,
        max_num_batched_tokens: int = 8192,
        tp: TPGroup = SINGLE,
        peers: Peers | None = None,
    ) -> None:
        """``num_blocks``: the block count of each KV group (``model_config.kv_layout().groups``);
        ``kv_cache_dtype``: what K and V are stored in (None: ``dtype``); ``verify_len``: query tokens
        a sequence of the speculative verify steps captured as graphs, for up to ``max_verify_seqs``;
        ``max_num_batched_tokens``: a step's token budget (the longest prefill graph);
        ``tp``: the rank's place (its KV heads), ``peers``: on rank 0, the other ranks."""
        self.model_config = model_config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.peers = peers
        self._followed_ids: torch.Tensor | None = None  # a following rank's last broadcast ids
        self.num_kv_groups = len(num_blocks)
        self.max_num_seqs = max_num_seqs
        self.kv_tensors, self.kv_caches = allocate_kv_caches(
            model_config.kv_layout().sharded(tp.size), num_blocks, block_size, kv_cache_dtype or dtype, device
        )
        self.sampler = Sampler()
        self.host_bitmask = HostBitmask()  # structured outputs: the grammars' masks
        self.penalties = PenaltyCounts(model_config.vocab_size, device, max_num_seqs)
        self.staging = HostStaging(device)
        self.rows = SequenceRows(self.num_kv_groups, model_config.vocab_size)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None  # one sequence's prompt or chunk
        self.mixed_graphs: PrefillGraphs | None = None  # short steps of several sequences carrying prefill
        if cuda_graphs and device.type == "cuda":
            max_blocks = -(-max_model_len // block_size)
            self.graphs = DecodeGraphs(
                model,
                self.kv_caches,
                len(num_blocks),
                max_num_seqs,
                max_blocks,
                block_size,
                model_config.vocab_size,
                dtype,
                device,
                verify_len,
                max_verify_seqs,
            )
            eager_each = tp.size > 1  # every rank must launch the same collectives
            self.graphs.capture(eager_each)
            budget = min(max_num_batched_tokens, max_model_len)
            self.prefill_graphs = PrefillGraphs(
                model, self.kv_caches, len(num_blocks), budget, max_blocks, model_config.vocab_size, dtype, device
            )
            self.prefill_graphs.capture(self.graphs.pool, eager_each)
            if max_num_seqs > 1:
                self.mixed_graphs = PrefillGraphs(
                    model,
                    self.kv_caches,
                    len(num_blocks),
                    budget,
                    max_blocks,
                    model_config.vocab_size,
                    dtype,
                    device,
                    max_seqs=max_num_seqs,
                )
                self.mixed_graphs.capture(self.graphs.pool, eager_each)

    @torch.inference_mode()
    def warm_up(self, max_num_batched_tokens: int, max_model_len: int) -> None:
        """Eager forwards in the shapes that prefill steps take (``warm_up_shapes``: chunks of 2 … the
        token budget, alone and beside a decode row, whose attention tiles are numbered differently;
        chunks deep into a long context, and beside the most decode rows a step can hold, whose
        attention grid may take other tiles; beside decode rows both in one launch, as several chunks
        take it, and apart, as chunks and one-token queries do), so that Triton compiles their kernel
        variants at start-up rather than inside the first requests' steps.
        Every token writes to slot -1 (padding) and reads block 0: the cache is left as it was."""
        dev = self.device
        for query_len, context, rows in warm_up_shapes(max_num_batched_tokens, max_model_len, self.max_num_seqs):
            total = query_len + rows
            groups = self.num_kv_groups
            meta = AttentionMetadata(
                slot_mapping=(torch.full((total,), -1, dtype=torch.int64, device=dev),) * groups,
                query_start_loc=torch.tensor([0, *range(query_len, total + 1)], dtype=torch.int32, device=dev),
                seq_lens=torch.tensor([context] + [1] * rows, dtype=torch.int32, device=dev),
                block_tables=(torch.zeros((1 + rows, -(-context // self.block_size)), dtype=torch.int32, device=dev),)
                * groups,
                max_query_len=query_len,
                max_seq_len=context,
            )
            # As one ragged launch (as a step of several chunks takes them), then, beside one-token
            # queries, in a launch for each kind (as a step of both kinds takes them).
            metas = [meta] + ([meta.split_one_token_queries(1, query_len)] if rows and query_len > 1 else [])
            positions = torch.cat(
                [torch.arange(context - query_len, context), torch.zeros(rows, dtype=torch.int64)]
            ).to(dev)
            for meta in metas:
                hidden = self.model(torch.zeros(total, dtype=torch.int64, device=dev), positions, self.kv_caches, meta)
            logits = self.model.compute_logits(hidden[[query_len - 1, total - 1]])
        self._warm_up_sampling(logits)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def _warm_up_sampling(self, logits: torch.Tensor) -> None:
        """Sampled steps with every filter and penalty, as a request's first sampled step takes them:
        a penalised sequence filled into the token table (prompt and output), read and counted, at
        one row and at two, with a small and a larger top-k (torch sorts a larger one with other
        kernels), logprobs, a banned token and a logit bias. So that step launches no kernel for the
        first time: a first launch compiles a Triton variant, or loads the module of one of torch's
        (CUDA loads modules lazily)."""
        seq = Sequence(-1, "warm-up", 0, (0, 1), SamplingParams(repetition_penalty=1.1), 0.0)
        seq.status = SequenceStatus.RUNNING
        seq.token_ids.append(0)  # an output token: a sequence refilled after a preemption counts it

        def full(rows: int, value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.full((rows,), value, dtype=dtype, device=self.device)

        zero = full(1, 0, torch.int64)  # row 0's token 0: banned, and biased
        for rows, top_k, num_logprobs in ((1, 50, -1), (min(2, logits.shape[0]), 2, 2)):
            read, add = self.penalties.rows([seq] * rows)
            out = self.sampler(
                logits[:rows],
                SamplingBatch(
                    temperature=full(rows, 1.0),
                    inv_temperature=full(rows, 1.0),
                    top_k=full(rows, top_k, torch.int64),
                    top_p=full(rows, 0.5),
                    min_p=full(rows, 0.1),
                    repetition_penalty=full(rows, 1.1),
                    presence_penalty=full(rows, 0.5),
                    frequency_penalty=full(rows, 0.5),
                    generators=[None] * rows,
                    num_logprobs=num_logprobs,
                    penalties=(self.penalties.counts, self.penalties.prompt, read),
                    banned=(zero, zero),
                    logit_bias=(zero, zero, full(1, 0.5)),
                    max_top_k=top_k,
                ),
            )
            self.penalties.add(add, out.token_ids)
        seq.status = SequenceStatus.FINISHED  # its row goes back at the next step's rows()

    # ------------------------------------------------------------------ inputs
    def _prepare(self, batch: ScheduledStep, previous: InFlightStep | None) -> StepInputs:
        """The step's plan (its flat batch and path, sent to the other ranks) and its inputs on the device."""
        flat = self._flatten(batch, previous)
        path, picks_rows = self._choose_path(flat)
        plan = StepPlan(
            flat.arrays, flat.max_query_len, flat.max_seq_len, path, picks_rows, sum(flat.rows_per_seq), flat.in_order,
            flat.num_chunk_seqs,
        )  # fmt: skip
        if self.peers is not None:
            self.peers.send(plan)
        sampling = self.rows.sampling_columns(flat.sampling_rows)
        t = self._stage(
            plan,
            previous.token_ids if previous is not None and len(flat.arrays["pending_rows"]) else None,
            {"sampling_floats": sampling.floats, "sampling_top_k": sampling.top_k},
        )
        columns = dict(zip(FLOAT_COLUMNS, t["sampling_floats"].unbind(0)), top_k=t["sampling_top_k"])
        return StepInputs(
            plan, t, flat.arrays["logits_rows"], flat.sampled, flat.rows_per_seq, columns, flat.prompt_rows, sampling,
            self.rows.union_flags(flat.sampling_rows),
        )  # fmt: skip

    def _flatten(self, batch: ScheduledStep, previous: InFlightStep | None) -> FlatBatch:
        """The step's sequences as one ragged batch. Vectorised over tokens: the only per-sequence Python
        is reading its ids and progress (its tables and sampling parameters are kept in ``SequenceRows``).
        ``PENDING`` ids are ``previous``'s samples: which rows take which go in the same copy."""
        bs = self.block_size
        seqs, counts = batch.seqs, np.asarray(batch.num_tokens, dtype=np.int64)
        starts = np.fromiter(map(attrgetter("num_computed_tokens"), seqs), dtype=np.int64, count=len(seqs))
        # Longest context first: attention's programs start in the batch's order, and a long one
        # started last would run on alone while the GPU idles. (Each step's sequences then keep the
        # previous step's order, and its sampled ids stay in place as the next step's inputs.) Beside
        # prompt chunks, the one-token queries come last, to attend in a launch of their own
        # (``AttentionMetadata.split_one_token_queries``).
        one_token = counts == 1
        num_chunk_seqs = int(len(seqs) - one_token.sum()) if one_token.any() else 0
        order = np.lexsort((-(starts + counts), one_token))  # stable: ties keep the previous step's order
        if (order[1:] < order[:-1]).any():
            seqs, counts, starts = [seqs[i] for i in order.tolist()], counts[order], starts[order]
        query_start = np.zeros(len(seqs) + 1, dtype=np.int32)
        query_start[1:] = np.cumsum(counts)
        total = int(query_start[-1])
        rows = self.rows.rows_of(seqs)
        tables = self.rows.block_tables(rows)  # [groups, B, blocks]
        owner = np.repeat(np.arange(len(seqs)), counts)
        positions = np.arange(total) - np.repeat(query_start[:-1].astype(np.int64) - starts, counts)
        slots = tables[:, owner, positions // bs].astype(np.int64) * bs + positions % bs
        if total == len(seqs):  # one token a sequence (every decode step): a known one, never a draft
            ids = np.fromiter(
                map(list.__getitem__, map(attrgetter("token_ids"), seqs), starts.tolist()), dtype=np.int64, count=total
            )
        else:
            ids = np.fromiter(
                itertools.chain.from_iterable(
                    s.scheduled_token_ids(st, n) for s, st, n in zip(seqs, starts.tolist(), counts.tolist())
                ),
                dtype=np.int64,
                count=total,
            )
        ends = starts + counts
        # A sequence samples when the step reaches its last known token (or its last draft).
        all_drafts = np.fromiter(map(len, map(attrgetter("draft_token_ids"), seqs)), dtype=np.int64, count=len(seqs))
        known = np.fromiter(map(len, map(attrgetter("token_ids"), seqs)), dtype=np.int64, count=len(seqs))
        sampling_seqs = np.flatnonzero(ends == known + all_drafts)
        sampled = [seqs[b] for b in sampling_seqs.tolist()]
        drafts = all_drafts[sampling_seqs]
        rows_per_seq = (drafts + 1).tolist()
        prompt_logits_rows: list[int] = []
        prompt_rows: list[PromptLogprobRows] = []
        for b in np.flatnonzero(self.rows.flags[rows] & PROMPT_LOGPROBS).tolist():
            seq = seqs[b]
            # Rows whose next token is still a prompt token give prompt logprobs, each once:
            # a recompute after preemption skips the positions already given.
            first = max(int(starts[b]), seq.next_prompt_logprob_position)
            last = min(int(ends[b]), seq.num_prompt_tokens - 1)
            if first < last:
                row0 = int(query_start[b]) - int(starts[b])
                prompt_rows.append(PromptLogprobRows(seq, first, last - first))
                prompt_logits_rows.extend(range(row0 + first, row0 + last))
        # Then each sampling sequence's rows: its last known token's, then each draft's.
        sample_rows = query_start[1:][sampling_seqs].astype(np.int64) - 1
        sampling_rows = rows[sampling_seqs]
        if drafts.any():
            firsts = np.repeat(sample_rows - drafts, drafts + 1)
            sample_rows = firsts + np.arange(len(firsts)) - np.repeat(np.cumsum(drafts + 1) - drafts - 1, drafts + 1)
            sampling_rows = np.repeat(sampling_rows, drafts + 1)
        logits_rows = np.concatenate([np.asarray(prompt_logits_rows, dtype=np.int64), sample_rows])
        seq_lens = ends.astype(np.int32)
        pending_rows = np.flatnonzero(ids == PENDING)
        if len(pending_rows) and (previous is None or sum(previous.rows_per_seq) != len(previous.sampled_seqs)):
            # (A step with drafts is verified before the next is scheduled: its row per sequence is unknown.)
            raise RuntimeError("a pending token is scheduled, but no step in flight holds it as its one sample")
        in_order = len(pending_rows) == total and previous is not None and previous.sampled_seqs == seqs
        if in_order:
            pending_sources = np.arange(total)
        else:
            sources = previous.sampled_seqs if previous is not None and len(pending_rows) else []
            row_of = {seq: i for i, seq in enumerate(sources)}
            pending_sources = np.fromiter(
                (row_of[seqs[b]] for b in owner[pending_rows].tolist()), dtype=np.int64, count=len(pending_rows)
            )
        arrays = {
            "input_ids": ids,
            "positions": positions,
            "slot_mapping": slots,
            "query_start_loc": query_start,
            "seq_lens": seq_lens,
            "block_tables": tables,
            "logits_rows": logits_rows,
            "pending_rows": pending_rows.astype(np.int64),
            "pending_sources": pending_sources,
        }
        return FlatBatch(
            arrays, len(seqs), total, int(counts.max()), int(seq_lens.max()), num_chunk_seqs, in_order, sampled,
            rows_per_seq, prompt_rows, sampling_rows,
        )  # fmt: skip

    def _choose_path(self, flat: FlatBatch) -> tuple[ForwardPath, bool]:
        """The forward's path for ``flat``: a captured graph where one fits it, else eager; and whether
        the logits rows are picked out after a decode graph, which scores every row."""
        num_seqs, total, max_query_len, prompt_rows = flat.num_seqs, flat.total, flat.max_query_len, flat.prompt_rows
        num_logits_rows = len(flat.arrays["logits_rows"])
        path, picks_rows = ForwardPath.EAGER, False
        if self.graphs is not None and max_query_len == 1 and self.graphs.padded_size(num_seqs):
            # The graph runs the LM head on every row; a row that does not sample (a one-token
            # prefill chunk mid-prompt) or gives prompt logprobs is picked out afterwards.
            path, picks_rows = ForwardPath.DECODE_GRAPH, bool(prompt_rows) or num_logits_rows != num_seqs
        elif (
            self.graphs is not None
            and self.graphs.can_verify(num_seqs, max_query_len)
            and not prompt_rows
            and num_logits_rows == total
        ):
            path = ForwardPath.VERIFY_GRAPH  # every row is a known token or a draft, and every row samples
        elif (
            self.prefill_graphs is not None
            and num_seqs == 1
            and self.prefill_graphs.padded_size(total)
            and not prompt_rows
            and flat.rows_per_seq in ([], [1])
        ):
            path = ForwardPath.PREFILL_GRAPH  # one sequence's prompt or chunk: the LM head on its last row, if any
        elif (
            self.mixed_graphs is not None
            and self.mixed_graphs.padded_size(total, num_seqs)
            and not prompt_rows
            and num_logits_rows == len(flat.sampled)
        ):
            path = ForwardPath.MIXED_GRAPH  # chunks beside decode rows, each sampling sequence one row (no drafts)
        return path, picks_rows

    def _stage(
        self, plan: StepPlan, previous_ids: torch.Tensor | None, extra: dict[str, np.ndarray] | None = None
    ) -> dict[str, torch.Tensor]:
        """The plan's arrays (and ``extra``) on the device in one copy, pending ids filled in from
        ``previous_ids`` (the step before's samples, on the device; taken whole as the input ids
        when every row is pending in their order)."""
        t = self.staging.send({**plan.arrays, **(extra or {})})
        if plan.pending_in_order:
            assert previous_ids is not None  # pending rows are the step before's samples
            t["input_ids"] = previous_ids
        elif len(plan.arrays["pending_rows"]):
            assert previous_ids is not None
            t["input_ids"][t["pending_rows"]] = previous_ids[t["pending_sources"]]
        return t

    def _forward(self, plan: StepPlan, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's forward on the path ``plan`` names (the same on every rank): the head logits of its
        logits rows (None if it has none; ``finish_logits_`` is the reader's), and their greedy ids where a
        graph computed them."""
        meta = AttentionMetadata(
            slot_mapping=tuple(t["slot_mapping"]),
            query_start_loc=t["query_start_loc"],
            seq_lens=t["seq_lens"],
            block_tables=tuple(t["block_tables"]),
            max_query_len=plan.max_query_len,
            max_seq_len=plan.max_seq_len,
        )
        if plan.path == ForwardPath.DECODE_GRAPH:
            assert self.graphs is not None  # ``_choose_path`` takes a graph's path only where there is one
            logits, greedy_ids = self.graphs.run(t["input_ids"], t["positions"], meta)
            return (logits[t["logits_rows"]], None) if plan.picks_rows else (logits, greedy_ids)
        if plan.path == ForwardPath.VERIFY_GRAPH:
            assert self.graphs is not None
            return self.graphs.run_verify(t["input_ids"], t["positions"], meta)
        if plan.path in (ForwardPath.PREFILL_GRAPH, ForwardPath.MIXED_GRAPH):
            graphs = self.prefill_graphs if plan.path == ForwardPath.PREFILL_GRAPH else self.mixed_graphs
            assert graphs is not None
            logits, greedy_ids = graphs.run(t["input_ids"], t["positions"], meta, t["logits_rows"])
            return (logits, greedy_ids) if len(plan.arrays["logits_rows"]) else (None, None)
        if plan.num_chunk_seqs:
            meta = meta.split_one_token_queries(
                plan.num_chunk_seqs, int(plan.arrays["query_start_loc"][plan.num_chunk_seqs])
            )
        hidden = self.model(t["input_ids"], t["positions"], self.kv_caches, meta)
        if not len(plan.arrays["logits_rows"]):
            return None, None  # pure prefill chunks: no LM-head work at all
        return self.model.head_logits(hidden[t["logits_rows"]]), None

    def _sampling_batch(self, seqs: list[Sequence], inputs: StepInputs) -> SamplingBatch:
        """Per-row parameters: the numeric ones arrive as ``inputs.sampling_columns``, already on the
        device. A sequence with drafts has a row per position, each as plain decoding would sample
        there (its seed's generator drawn on in order, its stop tokens banned while that position is
        short of ``min_tokens``). The penalties' token counts are left to ``sample``."""
        host, flags, columns = inputs.host_sampling, inputs.sampling_flags, inputs.sampling_columns
        batch = SamplingBatch(
            temperature=columns["temperature"],
            inv_temperature=columns["inv_temperature"],
            top_k=columns["top_k"],
            top_p=columns["top_p"],
            min_p=columns["min_p"],
            repetition_penalty=columns["repetition_penalty"],
            presence_penalty=columns["presence_penalty"],
            frequency_penalty=columns["frequency_penalty"],
            generators=[None] * len(host["temperature"]),
            num_logprobs=-1,
            all_greedy=bool((host["temperature"] == 0).all()),
            max_top_k=max_top_k(host["temperature"], host["top_k"], self.model_config.vocab_size),
        )
        if not flags & (LOGPROBS | MIN_TOKENS | LOGIT_BIAS | SEEDED):
            return batch  # (most steps: nothing is read from the sequences one by one)
        owners = [(s, offset) for s, n in zip(seqs, inputs.rows_per_seq) for offset in range(n)]
        params = [s.params for s, _ in owners]

        def sparse(entries: list[tuple], *dtypes: torch.dtype) -> tuple[torch.Tensor, ...] | None:
            """The columns of ``entries`` (row, token id, ...) on the device; None if there are none."""
            if not entries:
                return None
            return tuple(to_device(c, d, self.device) for c, d in zip(zip(*entries), dtypes))

        nums = [num_top_logprobs(p.logprobs, self.model_config.vocab_size) for p in params if p.logprobs is not None]
        batch.num_logprobs = max(nums) if nums else -1
        batch.generators = [s.generator for s, _ in owners]
        batch.keep_generator_states = frozenset(
            row for row, (s, _) in enumerate(owners) if s.generator is not None and s.draft_token_ids
        )
        banned = []
        for row in [row for row, p in enumerate(params) if p.min_tokens]:
            seq, offset = owners[row]
            if seq.num_output_tokens + offset < seq.params.min_tokens:
                banned += [(row, tok) for tok in seq.stop_ids]
        batch.banned = cast("tuple[torch.Tensor, torch.Tensor] | None", sparse(banned, torch.int64, torch.int64))
        biased = [
            (row, tok, value) for row, p in enumerate(params) if p.logit_bias for tok, value in p.logit_bias.items()
        ]
        batch.logit_bias = cast(
            "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None",
            sparse(biased, torch.int64, torch.int64, torch.float32),
        )
        return batch

    # --------------------------------------------------------------- execution
    @torch.inference_mode()
    def launch(self, batch: ScheduledStep, previous: InFlightStep | None = None) -> InFlightStep:
        """Enqueue the step on the device and return without waiting for it. Tokens still
        pending on the host (``PENDING``) are the sampled ids of ``previous``, taken on the device."""
        inputs = self._prepare(batch, previous)
        logits_rows, sampled, prompt_rows = inputs.logits_rows, inputs.sampled, inputs.prompt_rows
        step = InFlightStep(
            batch,
            sampled_seqs=sampled,
            rows_per_seq=inputs.rows_per_seq,
            prompt_rows=prompt_rows,
            path=inputs.plan.path,
            sampling_flags=inputs.sampling_flags,
        )
        logits, greedy_ids = self._forward(inputs.plan, inputs.tensors)
        if logits is None:
            return step
        num_prompt_rows = len(logits_rows) - sum(inputs.rows_per_seq)
        if prompt_rows:
            self._prompt_logprobs(self.model.finish_logits_(logits[:num_prompt_rows]), step)
        if sampled:
            sampling = self._sampling_batch(sampled, inputs)
            step.pending_sample = PendingSample(logits[num_prompt_rows:], sampling, greedy_ids)
            if previous is None or not inputs.sampling_flags & GRAMMAR:
                self.sample(step)
        return step

    @torch.inference_mode()
    def sample(self, step: InFlightStep) -> None:
        """Enqueue a launched step's sampling. ``launch`` holds it back (``step.pending_sample``) when a
        row's grammar needs the tokens of the step in flight before it: the engine calls this once
        those are read, while the device still runs this step's forward. (Penalties read token
        counts kept on the device, ``PenaltyCounts``, and never wait.)"""
        pending, step.pending_sample = step.pending_sample, None
        if pending is None:  # sampled at launch already, or nothing to sample
            return
        logits, batch, greedy_ids = pending.logits, pending.batch, pending.greedy_ids
        firsts = itertools.accumulate([0, *step.rows_per_seq[:-1]])
        # (A matcher that took its stop token leaves its row free: its sequence ended there, or ignores eos
        # and goes on unconstrained.)
        grammar_seqs = []
        if step.sampling_flags & GRAMMAR:
            grammar_seqs = [
                (row, seq)
                for row, seq in zip(firsts, step.sampled_seqs)
                if seq.matcher is not None and not seq.matcher.is_terminated()
            ]
        finish: Callable[[torch.Tensor], torch.Tensor] | None = self.model.finish_logits_
        if grammar_seqs:  # structured outputs: only the tokens each grammar allows next
            logits, finish = self.model.finish_logits_(logits).float(), None  # (a copy of a graph's bf16 output)
            failed = apply_grammars(
                logits, [(row, seq.matcher, seq.draft_token_ids) for row, seq in grammar_seqs], self.host_bitmask
            )
            if failed:
                step.failed_seqs = {grammar_seqs[i][1]: reason for i, reason in failed.items()}
            greedy_ids = None
        penalty_rows = None
        if step.sampling_flags & PENALTIES:
            read, penalty_rows = self.penalties.rows(
                [s for s, n in zip(step.sampled_seqs, step.rows_per_seq) for _ in range(n)]
            )
            batch.penalties = (self.penalties.counts, self.penalties.prompt, read)
        out = self.sampler(logits, batch, greedy_ids, finish)
        if penalty_rows is not None:
            self.penalties.add(penalty_rows, out.token_ids)
        # The device ids feed the next step's inputs (every rank's); the host copies are read by
        # ``collect``. Copied now, before another replay can overwrite a graph's static output.
        step.token_ids = broadcast(out.token_ids, self.tp)
        step.generator_states = out.generator_states
        step.host = [
            t.to("cpu", non_blocking=True) if t is not None else None
            for t in (out.token_ids, out.logprobs, out.logprob_token_ids)
        ]
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record()

    def collect(self, step: InFlightStep) -> StepResult:
        """Wait for a launched step's sampled ids (the step's one synchronisation) and read them."""
        result = StepResult(sampled_seqs=step.sampled_seqs, failed_seqs=step.failed_seqs)
        if step.prompt_logprobs:
            self._wait(step.prompt_logprobs_done)
            for seq, keep, values, ids in step.prompt_logprobs:
                result.prompt_logprobs[seq] = [_logprob_dict(i, v, keep) for i, v in zip(ids.tolist(), values.tolist())]
        if not step.sampled_seqs:
            return result
        self._wait(step.done)
        token_ids, logprobs, logprob_ids = step.host
        assert token_ids is not None  # a step that sampled copied its ids
        result.token_ids = token_ids.tolist()
        if len(result.token_ids) != len(step.sampled_seqs):
            result.starts = list(itertools.accumulate(step.rows_per_seq, initial=0))
        if logprobs is None and not step.generator_states:
            return result  # (most steps)
        # Each sampled row's logprobs and their token ids, as lists (None: no row asked for them).
        top = None if logprobs is None or logprob_ids is None else (logprobs.tolist(), logprob_ids.tolist())
        for i, seq in enumerate(step.sampled_seqs):
            rows = result.rows(i)
            if step.generator_states and rows.start in step.generator_states:
                result.generator_states[seq] = [step.generator_states[r] for r in rows]
            if top is not None and seq.params.logprobs is not None:
                keep = 1 + num_top_logprobs(seq.params.logprobs, self.model_config.vocab_size)
                result.logprobs[i] = [_logprob_dict(top[1][r], top[0][r], keep) for r in rows]
        return result

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """A rank other than 0 runs rank 0's step: the same forward on its shard, then the sampled ids
        rank 0 broadcasts, which its next step's pending rows read."""
        self._forward(plan, self._stage(plan, self._followed_ids))
        if plan.num_sampled_rows:
            ids = torch.empty(plan.num_sampled_rows, dtype=torch.int64, device=self.device)
            self._followed_ids = broadcast(ids, self.tp)

    def _wait(self, event: torch.cuda.Event | None) -> None:
        """Until the device has passed ``event`` (None: nothing to wait for, as on the CPU); with
        other ranks, also watching that none of them failed."""
        if event is not None and self.peers is not None:
            self.peers.wait(event)
        elif event is not None:
            event.synchronize()

    def _prompt_logprobs(self, logits: torch.Tensor, step: InFlightStep) -> None:
        """Each of ``step``'s prompt rows' logprobs (``logits`` their rows, in order), enqueued at
        launch with their copies to the host, which ``collect`` reads: the host does not wait for
        the forward here, so a step with prompt logprobs overlaps like any other."""
        logprobs = logits.float().log_softmax(dim=-1)
        row = 0
        for rows in step.prompt_rows:
            seq, first, count = rows.seq, rows.first, rows.count
            targets = to_device(seq.prompt_token_ids[first + 1 : first + 1 + count], torch.int64, self.device)
            assert seq.params.prompt_logprobs is not None  # only such a sequence has prompt rows
            num_top = num_top_logprobs(seq.params.prompt_logprobs, self.model_config.vocab_size)
            values, ids = gather_logprobs(logprobs[row : row + count], targets, num_top)
            step.prompt_logprobs.append(
                (seq, 1 + num_top, values.to("cpu", non_blocking=True), ids.to("cpu", non_blocking=True))
            )
            row += count
        if self.device.type == "cuda":
            step.prompt_logprobs_done = torch.cuda.Event()
            step.prompt_logprobs_done.record()


def max_top_k(temperature: np.ndarray, top_k: np.ndarray, vocab_size: int) -> int:
    """The largest top-k of a sampled row (``SamplingColumns``' top-k, clamped) that cuts the
    vocabulary; 0 if none does."""
    cuts = top_k[(temperature > 0) & (top_k > 0) & (top_k < vocab_size)]
    return int(cuts.max()) if len(cuts) else 0


def num_top_logprobs(requested: int, vocab_size: int) -> int:
    """How many of the best tokens a position's logprobs list besides the chosen one: -1 asks
    for the whole vocabulary, as in vLLM."""
    return vocab_size if requested == -1 else requested


def _logprob_dict(ids: list[int], values: list[float], keep: int) -> Logprobs:
    """Sampled token first, then the top-N (a token in both keeps its one value)."""
    out: Logprobs = {}
    for token, value in zip(ids[:keep], values[:keep]):
        out.setdefault(int(token), float(value))
    return out
