"""CUDA graphs for steps that carry prefill: a lone prompt's time to first token, and a new
prompt's chunk beside the sequences that decode.

Launched eagerly, a prefill step's few hundred kernels cost the host several times the GPU's
own work for a prompt of a few hundred tokens, so a new request would wait on the host (and hold
up the sequences decoding beside it). Two sets of graphs, one class: steps whose only sequence
brings 2 … ``MAX_TOKENS`` query tokens (a whole short prompt, or one chunk of a longer one,
after a cached prefix or not), and steps of several sequences (chunks and decode rows
together) of up to ``MIXED_MAX_TOKENS`` tokens. Either is padded to the next captured token
count and replayed. Why these sizes and KV splits, with the measured figures: docs/PERFORMANCE.md,
"Tuning: prefill graphs".

Padding rows sit after the real ones, outside every query (the step's
``query_start_loc`` ends at the real count), so attention gives them nothing and no
real row sees them; they write to slot -1 (no cache write), keep whatever ids and
positions an earlier step left (always in the model's range) and compute garbage
nobody reads. A graph of several sequences is captured for ``max_seqs`` of them; the
sequences a step lacks have empty queries, and attention numbers the real query tiles in
one flat range (``triton_attention.query_tiles``) sized at capture for the most that
``max_seqs`` sequences of that many tokens can have, its extra programs exiting at once.
The LM head runs on the rows that sample alone (``logits_rows``; row 0 fills the rest),
so the graph ends with their logits and greedy ids.

A graph fixes how many ranges attention splits each context into, and each program divides
the actual range in the kernel, so any context gives the same result, only at another speed.
The lone-sequence graphs attend over whole contexts (a new prompt's merge of split ranges costs
more than the split saves); a chunk after ``LONG_PREFIX`` tokens or more replays a second graph
of its size, captured for the longest context, whose ranges are split as an eager step's
would be for it, where that split differs. The graphs of several sequences are captured
for a context as long as their padded query.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from tokenmill.engine.worker.cuda_graphs import capture_graphs, stage_step_inputs
from tokenmill.layers import ops
from tokenmill.layers.attention import AttentionMetadata, PagedAttention
from tokenmill.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Padded token counts. Up to a few hundred tokens a step is bound by reading the weights, and padding
# costs little; above, it is bound by FLOPs, and each count is at most a quarter above the one before
# (a fifth of the step wasted at worst). Above the largest the GPU's work outlasts the host's launches.
TOKEN_COUNTS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)
MAX_TOKENS = TOKEN_COUNTS[-1]
MIXED_MAX_TOKENS = 256
# Tokens before a lone sequence's chunk from which it replays the graph whose KV ranges are split.
LONG_PREFIX = 256


def capture_sizes(max_tokens: int, max_seqs: int) -> list[int]:
    """The token counts captured for steps of up to ``max_seqs`` sequences and ``max_tokens`` tokens."""
    limit = min(max_tokens, MAX_TOKENS if max_seqs == 1 else MIXED_MAX_TOKENS)
    return [n for n in TOKEN_COUNTS if n < limit] + ([limit] if limit >= 2 else [])


class PrefillGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list,
        num_kv_groups: int,
        max_tokens: int,
        max_blocks_per_seq: int,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_seqs: int = 1,
    ) -> None:
        """Graphs for steps of up to ``max_seqs`` sequences, for every count of ``TOKEN_COUNTS`` up to
        ``max_tokens`` (a step's token budget, the model's length; ``MIXED_MAX_TOKENS`` for several
        sequences), and one of ``max_tokens`` itself below the largest count."""
        self.model = model
        self.kv_caches = kv_caches
        self.max_seqs = max_seqs
        self.sizes = capture_sizes(max_tokens, max_seqs)
        self.max_context = max_blocks_per_seq * kv_caches[0].k.shape[1]  # (a cache's blocks hold its block size)
        rows = self.sizes[-1] if self.sizes else 0
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((num_kv_groups, rows), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(num_kv_groups, max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.logits_rows = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self.logits = torch.zeros(max_seqs, vocab_size, dtype=dtype, device=device)
        self.greedy_ids = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by (tokens, context bound)
        self.capture_seconds = 0.0
        self.replays = 0
        self.long_prefix_replays = 0

    def _keys(self) -> list[tuple[int, int]]:
        """(token count, context bound) of every graph, largest first: each size for a context as
        long as itself, and a lone sequence's sizes whose attention splits ranges of the longest
        context also for that one."""
        keys = [(size, size) for size in self.sizes]
        if self.max_seqs == 1:
            layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
            keys += [
                (size, self.max_context)
                for size in self.sizes
                if self.max_context > size
                and max(
                    ops.paged_attention_kv_splits(cache.k, layer.num_heads, size, size, self.max_context)
                    for layer, cache in zip(layers, self.kv_caches)
                )
                > 1
            ]
        return sorted(keys, reverse=True)

    def _forward(self, size: int, context: int) -> None:
        meta = AttentionMetadata(
            slot_mapping=tuple(self.slot_mapping[:, :size]),
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=tuple(self.block_tables),
            max_query_len=size,
            max_seq_len=context,
            kv_splits=1 if self.max_seqs == 1 and context == size else None,
        )
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
        rows = min(size, self.max_seqs)  # no step of ``size`` tokens samples more rows
        logits = self.model.head_logits(hidden[self.logits_rows[:rows]], out=self.logits[:rows])
        self.greedy_ids[:rows] = ops.argmax_rows(logits)

    @torch.inference_mode()
    def capture(self, pool: object = None, eager_each: bool = False) -> None:
        """Capture every size, largest first, in ``pool`` (the decode graphs'): these graphs add only
        what their largest step needs beyond the largest decode graph (``eager_each``: ``capture_graphs``')."""
        started = time.monotonic()

        def prepare(key: tuple[int, int]) -> None:
            # The first sequence holds the whole query, with no context before it; the others none.
            size = key[0]
            self.query_start_loc[1:] = size
            self.seq_lens.zero_()
            self.seq_lens[0] = size
            self.logits_rows.fill_(size - 1)

        self.graphs, _ = capture_graphs(self._keys(), prepare, lambda key: self._forward(*key), pool, eager_each)
        self.capture_seconds = time.monotonic() - started
        if self.graphs:
            split = sorted(size for size, context in self.graphs if context != size)
            logger.info(
                "captured %d prefill graphs (%s, %s tokens%s) in %.1f s",
                len(self.graphs),
                "one sequence" if self.max_seqs == 1 else f"up to {self.max_seqs} sequences",
                self.sizes,
                f"; after a long prefix, split: {split}" if split else "",
                self.capture_seconds,
            )

    def padded_size(self, num_tokens: int, num_seqs: int = 1) -> int | None:
        """The captured token count a step of ``num_tokens`` in ``num_seqs`` sequences pads to; None if
        it has no graph."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        fits = i < len(self.sizes) and num_tokens >= 2 and num_seqs <= self.max_seqs
        return self.sizes[i] if fits else None

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logits_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the step's inputs into the static buffers and replay; returns the logits ``[rows,
        vocab]`` and greedy ids of its ``logits_rows`` (views of static buffers: read before the next
        replay)."""
        total, seqs, rows = input_ids.shape[0], meta.seq_lens.shape[0], logits_rows.shape[0]
        size = self.padded_size(total, seqs)
        assert size is not None and meta.max_seq_len is not None  # a graph holds the step; the runner sets it
        stage_step_inputs(self, input_ids, positions, meta, size)
        self.query_start_loc[: seqs + 1].copy_(meta.query_start_loc)
        self.seq_lens[:seqs].copy_(meta.seq_lens)
        if seqs < self.max_seqs:  # (each torch call costs the host microseconds: none for nothing)
            self.query_start_loc[seqs + 1 :] = meta.query_start_loc[-1]  # the missing sequences: empty queries
            self.seq_lens[seqs:].zero_()
        if rows < self.max_seqs:
            self.logits_rows.zero_()  # (every index stays within the rows this graph computes)
        self.logits_rows[:rows].copy_(logits_rows)
        split = (size, self.max_context)
        if split in self.graphs and meta.max_seq_len - total >= LONG_PREFIX:
            self.graphs[split].replay()
            self.long_prefix_replays += 1
        else:
            self.graphs[(size, size)].replay()
        self.replays += 1
        return self.logits[:rows], self.greedy_ids[:rows]
