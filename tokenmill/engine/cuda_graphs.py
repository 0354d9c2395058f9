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
"""

from __future__ import annotations

import logging
import time

import torch

from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.sampler import greedy_argmax

logger = logging.getLogger(__name__)

SHORT_CONTEXT = 256  # tokens: the context bound of the short-context graphs
SHORT_CONTEXT_MAX_BATCH = 16  # above this the batch fills the GPU without splits


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (≤ 8 rows of padding)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, num_kv_groups: int, max_num_seqs: int,
                 max_blocks_per_seq: int, block_size: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_context = max_blocks_per_seq * block_size
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((num_kv_groups, n), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(num_kv_groups, n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits = torch.zeros(n, vocab_size, dtype=dtype, device=device)
        self.greedy_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0

    def _keys(self) -> list[tuple[int, int]]:
        """(batch size, context bound) of every graph, largest first."""
        keys = [(size, self.max_context) for size in self.sizes]
        if SHORT_CONTEXT < self.max_context:
            keys += [(size, SHORT_CONTEXT) for size in self.sizes if size <= SHORT_CONTEXT_MAX_BATCH]
        return sorted(keys, reverse=True)

    def _forward(self, size: int, context: int) -> None:
        meta = AttentionMetadata(
            slot_mapping=tuple(self.slot_mapping[:, :size]),
            query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=tuple(self.block_tables[:, :size]),
            max_query_len=1,
            max_seq_len=context,
        )
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
        logits = self.model.compute_logits(hidden, out=self.logits[:size])
        self.greedy_ids[:size] = greedy_argmax(logits)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph, largest first, so smaller graphs reuse its memory pool."""
        started = time.monotonic()
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for key in self._keys():
                self._forward(*key)  # warm-up: Triton compiles outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._forward(*key)
                pool = graph.pool()
                self.graphs[key] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.capture_seconds = time.monotonic() - started
        logger.info("captured %d decode graphs (batch sizes %s) in %.1f s", len(self.graphs), self.sizes,
                    self.capture_seconds)

    def padded_size(self, batch_size: int) -> int | None:
        return next((s for s in self.sizes if s >= batch_size), None)

    def graph_for(self, batch_size: int, max_seq_len: int | None) -> torch.cuda.CUDAGraph:
        """The graph a step of this many rows and this longest context replays."""
        size = self.padded_size(batch_size)
        if max_seq_len is not None and max_seq_len <= SHORT_CONTEXT and (size, SHORT_CONTEXT) in self.graphs:
            return self.graphs[(size, SHORT_CONTEXT)]
        return self.graphs[(size, self.max_context)]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the step's inputs into the static buffers, replay; returns the real rows'
        logits and greedy token ids (views of static buffers: read before the next replay)."""
        batch = input_ids.shape[0]
        size = self.padded_size(batch)
        width = meta.block_tables[0].shape[1]
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        for g, (slots, table) in enumerate(zip(meta.slot_mapping, meta.block_tables)):
            self.slot_mapping[g, :batch].copy_(slots)
            self.block_tables[g, :batch, :width].copy_(table)
        self.slot_mapping[:, batch:size].fill_(-1)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.seq_lens[batch:size].fill_(1)
        self.graph_for(batch, meta.max_seq_len).replay()
        return self.logits[:batch], self.greedy_ids[:batch]
