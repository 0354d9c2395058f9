"""CUDA graphs for prefill steps of one sequence: a lone prompt's time to first token.

Launched eagerly, a prefill step is a few hundred kernels, each costing tens of
microseconds of Python and driver time on the host: for a prompt of a few hundred
tokens that is several times the GPU's own work, so a request arriving at an idle
engine waits on the host. A step whose only sequence brings 2 … ``MAX_TOKENS``
query tokens (a whole short prompt, or one chunk of a longer one, after a cached
prefix or not) is padded to the next captured token count and replayed instead.

Padding rows sit after the sequence's real ones, outside its query (the step's
``query_start_loc`` ends at the real count), so attention gives them nothing and no
real row sees them; they write to slot -1 (no cache write), keep whatever ids and
positions an earlier step left (always in the model's range) and compute garbage
nobody reads. The LM head runs on the last real row alone, so the graph
ends with that row's logits and greedy id. The split count of the KV range is fixed
at capture for a context as long as the padded query, and each program divides the
actual range in the kernel, so a chunk deep into a long prompt gives the same
result, only with fewer programs than an eager step would choose.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from tokenmill.engine.cuda_graphs import capture_graphs, stage_step_inputs
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.sampler import greedy_argmax

logger = logging.getLogger(__name__)

# Padded token counts. Up to a few hundred tokens a step is bound by reading the weights, and padding
# costs little; above, it is bound by FLOPs, and each count is at most a quarter above the one before
# (a fifth of the step wasted at worst). Above the largest the GPU's work outlasts the host's launches.
TOKEN_COUNTS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)
MAX_TOKENS = TOKEN_COUNTS[-1]


class PrefillGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, num_kv_groups: int, max_tokens: int,
                 max_blocks_per_seq: int, vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Graphs for every count of ``TOKEN_COUNTS`` up to ``max_tokens`` (a step's token budget, the
        model's length), and one of ``max_tokens`` itself below the largest count."""
        self.model = model
        self.kv_caches = kv_caches
        limit = min(max_tokens, MAX_TOKENS)
        self.sizes = [n for n in TOKEN_COUNTS if n < limit] + ([limit] if limit >= 2 else [])
        rows = self.sizes[-1] if self.sizes else 0
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((num_kv_groups, rows), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(2, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(num_kv_groups, 1, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.last_row = torch.zeros(1, dtype=torch.int64, device=device)
        self.logits = torch.zeros(1, vocab_size, dtype=dtype, device=device)
        self.greedy_ids = torch.zeros(1, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.replays = 0

    def _forward(self, size: int) -> None:
        meta = AttentionMetadata(
            slot_mapping=tuple(self.slot_mapping[:, :size]),
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=tuple(self.block_tables),
            max_query_len=size,
            max_seq_len=size,
        )
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
        logits = self.model.compute_logits(hidden[self.last_row], out=self.logits)
        self.greedy_ids.copy_(greedy_argmax(logits))

    @torch.inference_mode()
    def capture(self, pool: object = None) -> None:
        """Capture every size, largest first, in ``pool`` (the decode graphs'): the prefill graphs add
        only what their largest step needs beyond the largest decode graph."""
        started = time.monotonic()

        def prepare(size: int) -> None:
            self.query_start_loc[1] = size  # the sequence's whole query, with no context before it
            self.seq_lens.fill_(size)
            self.last_row.fill_(size - 1)

        self.graphs, _ = capture_graphs(sorted(self.sizes, reverse=True), prepare, self._forward, pool)
        self.capture_seconds = time.monotonic() - started
        if self.graphs:
            logger.info("captured %d prefill graphs (one sequence, %s tokens) in %.1f s", len(self.graphs),
                        self.sizes, self.capture_seconds)

    def padded_size(self, num_tokens: int) -> int | None:
        """The captured token count a step of ``num_tokens`` (one sequence) pads to; None if too long."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) and num_tokens >= 2 else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the step's inputs into the static buffers and replay; returns the last row's logits
        ``[1, vocab]`` and greedy id (views of static buffers: read before the next replay)."""
        total = input_ids.shape[0]
        size = self.padded_size(total)
        stage_step_inputs(self, input_ids, positions, meta, size)
        self.query_start_loc.copy_(meta.query_start_loc)
        self.seq_lens.copy_(meta.seq_lens)
        self.last_row.fill_(total - 1)
        self.graphs[size].replay()
        self.replays += 1
        return self.logits, self.greedy_ids
