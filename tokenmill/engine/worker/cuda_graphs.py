"""CUDA graphs for pure-decode steps: decoder, LM head and greedy argmax.

A decode step of a small model is dozens of short kernels per layer; launched
one by one from Python, the launch gaps cost more than the work. Each padded
batch size is captured once at start-up and replayed: the step then costs one
graph launch. The graph ends with the LM head and the argmax, so a greedy step
launches nothing else before reading its token ids; other sampling starts from
the graph's logits. Inputs live in static buffers the graphs read; padded rows
point at slot -1 (no cache write) and a context of one token in whatever valid
block their table row last held, so they compute finite garbage that nobody
reads.

Attention splits the KV range across programs when the batch alone cannot fill
the GPU, and a graph fixes the split count at capture. Small batches therefore
get a second graph captured for short contexts (≤ ``SHORT_CONTEXT`` tokens),
whose few splits fit the work of a short context instead of the longest one.

With speculative decoding, the batch sizes that speculate also get graphs of
``verify_len`` query tokens a sequence (the known token and every draft): a step
whose sequences carry fewer drafts is padded to that shape, each sequence's
extra rows after its real ones (so no real row sees them), writing no cache and
reading whatever their table holds; their logits are dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from tokenmill.layers import ops
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

K = TypeVar("K")

SHORT_CONTEXT = 256  # tokens: the context bound of the short-context graphs
SHORT_CONTEXT_MAX_BATCH = 16  # above this the batch fills the GPU without splits


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (≤ 8 rows of padding)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def capture_graphs(
    keys: Iterable[K],
    prepare: Callable[[K], None],
    forward: Callable[[K], None],
    pool: Any = None,
    eager_each: bool = False,
) -> tuple[dict[K, torch.cuda.CUDAGraph], Any]:
    """A graph of ``forward(key)`` for every key, in order, after ``prepare(key)`` (which sets the
    static inputs for the capture, and is not captured), all in one memory pool (``pool``, or a new
    one): the graphs never run at once, and their outputs are static buffers outside it. Returns the
    graphs and the pool. The keys are run eagerly as ``capture_each`` says (``eager_each``: every
    one, as ranks of a tensor-parallel group must, so that all of them launch the same collectives)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def capture(key: K) -> torch.cuda.CUDAGraph:
        nonlocal pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            forward(key)
        pool = graph.pool()
        return graph

    with torch.cuda.stream(stream):
        graphs, retried = capture_each(keys, prepare, forward, capture, eager_each)
    if retried:
        logger.info(
            "%d of %d graphs captured after an eager run of their shape (a kernel or buffer it first needed "
            "could not be made inside a capture)",
            retried,
            len(graphs),
        )
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graphs, pool


def capture_each(
    keys: Iterable[K],
    prepare: Callable[[K], None],
    forward: Callable[[K], None],
    capture: Callable[[K], Any],
    eager_each: bool = False,
) -> tuple[dict[K, Any], int]:
    """``capture(key)`` for every key after ``prepare(key)``. Only the first key runs eagerly before
    its capture (cuBLAS's workspace on the capture stream, the model's kernels loaded): a start-up
    spends most of its time in the host's work of each forward, and an eager run before every
    capture doubled it. A kernel variant first reached inside a later capture compiles or loads
    there, which CUDA drivers from 12.3 allow; a capture that fails (an older driver, a buffer that
    must be made outside any capture) is done again after an eager run. ``eager_each``: run every
    key eagerly first. Returns the graphs and how many captures were done again."""
    graphs: dict[K, Any] = {}
    retried = 0
    for i, key in enumerate(keys):
        prepare(key)
        if i and not eager_each:
            try:
                graphs[key] = capture(key)
                continue
            except RuntimeError as error:
                logger.debug("capturing %s failed (%s): run eagerly first, then captured again", key, error)
                retried += 1
        forward(key)
        graphs[key] = capture(key)
    return graphs, retried


def stage_step_inputs(
    static: Any, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, padded: int
) -> None:
    """Copy a step's ids, positions, slots and block tables into a graph's static buffers (``static``'s
    ``input_ids``, ``positions``, ``slot_mapping`` and ``block_tables``), its rows first; the padding
    rows up to ``padded`` write nowhere (slot -1)."""
    rows, seqs, width = input_ids.shape[0], meta.block_tables[0].shape[0], meta.block_tables[0].shape[1]
    static.input_ids[:rows].copy_(input_ids)
    static.positions[:rows].copy_(positions)
    for g, (slots, table) in enumerate(zip(meta.slot_mapping, meta.block_tables)):
        static.slot_mapping[g, :rows].copy_(slots)
        static.block_tables[g, :seqs, :width].copy_(table)
    if rows < padded:
        static.slot_mapping[:, rows:padded].fill_(-1)


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list,
        num_kv_groups: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
        verify_len: int = 0,
        max_verify_seqs: int = 0,
    ) -> None:
        """``verify_len`` > 1: also capture verify steps of that many query tokens a sequence, for
        batches of up to ``max_verify_seqs``."""
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.verify_len = verify_len if verify_len > 1 and max_verify_seqs > 0 else 0
        self.verify_sizes = capture_sizes(max_verify_seqs) if self.verify_len else []
        self.max_context = max_blocks_per_seq * block_size
        n = self.sizes[-1]
        rows = max(n, self.verify_sizes[-1] * self.verify_len if self.verify_sizes else 0)
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((num_kv_groups, rows), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(num_kv_groups, n, max_blocks_per_seq, dtype=torch.int32, device=device)
        # Per query length: where each sequence's rows start (1 a sequence, or verify_len).
        self.query_start_loc = {
            q: torch.arange(n + 1, dtype=torch.int32, device=device) * q for q in {1, self.verify_len} - {0}
        }
        self.logits = torch.zeros(rows, vocab_size, dtype=dtype, device=device)
        self.greedy_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.pool: Any = None  # the graphs' memory pool, which the prefill graphs share
        self.capture_seconds = 0.0
        self.verify_replays = 0

    def _keys(self) -> list[tuple[int, int, int]]:
        """(batch size, context bound, query tokens a sequence) of every graph, largest first."""
        keys = [(size, self.max_context, 1) for size in self.sizes]
        keys += [(size, self.max_context, self.verify_len) for size in self.verify_sizes]
        if SHORT_CONTEXT < self.max_context:
            keys += [(size, SHORT_CONTEXT, 1) for size in self.sizes if size <= SHORT_CONTEXT_MAX_BATCH]
            keys += [
                (size, SHORT_CONTEXT, self.verify_len) for size in self.verify_sizes if size <= SHORT_CONTEXT_MAX_BATCH
            ]
        return sorted(keys, key=lambda key: (key[0] * key[2], key[1]), reverse=True)

    def _forward(self, size: int, context: int, query_len: int) -> None:
        rows = size * query_len
        meta = AttentionMetadata(
            slot_mapping=tuple(self.slot_mapping[:, :rows]),
            query_start_loc=self.query_start_loc[query_len][: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=tuple(self.block_tables[:, :size]),
            max_query_len=query_len,
            max_seq_len=context,
        )
        hidden = self.model(self.input_ids[:rows], self.positions[:rows], self.kv_caches, meta)
        logits = self.model.head_logits(hidden, out=self.logits[:rows])
        self.greedy_ids[:rows] = ops.argmax_rows(logits)

    @torch.inference_mode()
    def capture(self, eager_each: bool = False) -> None:
        """Capture every graph, largest first, so smaller graphs reuse its memory pool
        (``eager_each``: ``capture_graphs``')."""
        started = time.monotonic()

        def prepare(key: tuple[int, int, int]) -> None:
            self.seq_lens.fill_(key[2])  # every sequence holds its query (a context of 0 before it)

        self.graphs, self.pool = capture_graphs(
            self._keys(), prepare, lambda key: self._forward(*key), eager_each=eager_each
        )
        self.seq_lens.fill_(1)
        self.capture_seconds = time.monotonic() - started
        logger.info(
            "captured %d decode graphs (batch sizes %s%s) in %.1f s",
            len(self.graphs),
            self.sizes,
            f"; verify steps of {self.verify_len} tokens at {self.verify_sizes}" if self.verify_len else "",
            self.capture_seconds,
        )

    def padded_size(self, batch_size: int, query_len: int = 1) -> int | None:
        sizes = self.sizes if query_len == 1 else self.verify_sizes
        return next((s for s in sizes if s >= batch_size), None)

    def can_verify(self, batch_size: int, max_query_len: int) -> bool:
        """Whether a step of this many sequences, each with at most ``max_query_len`` tokens, has a graph."""
        return 1 < max_query_len <= self.verify_len and self.padded_size(batch_size, self.verify_len) is not None

    def graph_for(self, batch_size: int, max_seq_len: int | None, query_len: int = 1) -> torch.cuda.CUDAGraph:
        """The graph a step of this many sequences, this longest context and query length replays."""
        size = self.padded_size(batch_size, query_len)
        assert size is not None, f"no graph holds {batch_size} sequences"
        short = (size, SHORT_CONTEXT, query_len)
        if max_seq_len is not None and max_seq_len <= SHORT_CONTEXT and short in self.graphs:
            return self.graphs[short]
        return self.graphs[(size, self.max_context, query_len)]

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the step's inputs into the static buffers, replay; returns the real rows'
        logits and greedy token ids (views of static buffers: read before the next replay)."""
        batch = input_ids.shape[0]
        size = self.padded_size(batch)
        assert size is not None  # the runner chose this path for a batch a graph holds
        stage_step_inputs(self, input_ids, positions, meta, size)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        if batch < size:
            self.seq_lens[batch:size].fill_(1)
        self.graph_for(batch, meta.max_seq_len).replay()
        return self.logits[:batch], self.greedy_ids[:batch]

    def run_verify(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step whose sequences each have 1 … ``verify_len`` query tokens, every one sampled (the
        known token and its drafts): padded to ``verify_len`` a sequence and replayed; returns the
        real rows' logits and greedy ids in the step's order. No host reads: the padding is placed
        on the device from ``query_start_loc``."""
        q, total = self.verify_len, input_ids.shape[0]
        qsl = meta.query_start_loc
        batch = qsl.shape[0] - 1
        size = self.padded_size(batch, q)
        assert size is not None and meta.max_seq_len is not None  # ``can_verify`` held; the runner sets it
        counts = qsl[1:] - qsl[:-1]
        owner = torch.repeat_interleave(torch.arange(batch, device=qsl.device), counts, output_size=total)
        dest = owner * q + (torch.arange(total, device=qsl.device) - qsl[:-1].long()[owner])
        rows = size * q
        # Padding rows: no input worth naming, the position of the sequence's last real token (always
        # within the model's range), no cache write.
        self.input_ids[:rows].zero_()
        self.input_ids[dest] = input_ids
        last = torch.zeros(size, dtype=positions.dtype, device=positions.device)
        last[:batch] = positions[qsl[1:].long() - 1]
        self.positions[:rows].copy_(last.repeat_interleave(q))
        self.positions[dest] = positions
        width = meta.block_tables[0].shape[1]
        self.slot_mapping[:, :rows].fill_(-1)
        for g, (slots, table) in enumerate(zip(meta.slot_mapping, meta.block_tables)):
            self.slot_mapping[g, dest] = slots
            self.block_tables[g, :batch, :width].copy_(table)
        self.seq_lens[:batch].copy_(meta.seq_lens - counts + q)  # each sequence's context, then q rows
        self.seq_lens[batch:size].fill_(q)
        self.graph_for(batch, meta.max_seq_len + q, q).replay()
        self.verify_replays += 1
        return self.logits[dest], self.greedy_ids[dest]
