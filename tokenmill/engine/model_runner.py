"""Flattens a scheduled batch into one ragged forward, runs it, and samples.

The model runner owns the device state: the weights, the KV cache tensors,
the sampler. It turns the scheduler's choice into ``input_ids``,
``positions``, ``slot_mapping``, ``query_start_loc``, ``seq_lens``,
``block_tables`` and ``logits_indices`` (the rows that need the LM head), and
returns the sampled token of every sequence that reached the end of its known
tokens this step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tokenmill.engine.scheduler import ScheduledBatch
from tokenmill.engine.sequence import Sequence
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.sampler import Sampler, SamplingBatch, gather_logprobs
from tokenmill.loader.hf_config import ModelConfig
from tokenmill.loader.weights import iter_checkpoint
from tokenmill.models.registry import model_class
from tokenmill.outputs import Logprobs

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """Sampled tokens for the sequences that sample this step, in batch order."""

    sampled_seqs: list[Sequence] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs | None] = field(default_factory=list)
    # Prompt logprobs computed this step: seq -> logprobs of its next prompt positions.
    prompt_logprobs: dict[Sequence, list[Logprobs]] = field(default_factory=dict)


def build_model(cfg: ModelConfig, model_dir: Path | None, dtype: torch.dtype, device: torch.device,
                max_positions: int, seed: int = 0) -> torch.nn.Module:
    """The model on ``device`` in ``dtype``, with the checkpoint's weights, or random
    ones (std 0.02) when ``model_dir`` is None (benchmarks in real shapes)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(cfg)(cfg, max_positions)
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
        model.load_weights(iter_checkpoint(model_dir))
    return model.eval()


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(self, cfg: ModelConfig, model: torch.nn.Module, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.num_blocks = num_blocks
        cache = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                            dtype=dtype, device=device)
        self.kv_cache = cache
        self.kv_caches = [(cache[i, 0], cache[i, 1]) for i in range(cfg.num_layers)]
        self.sampler = Sampler()

    # ------------------------------------------------------------------ inputs
    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                          list[int], list[Sequence], list[tuple[Sequence, int, int]]]:
        bs = self.block_size
        ids, positions, slots = [], [], []
        query_start = [0]
        seq_lens = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        prompt_rows: list[tuple[Sequence, int, int]] = []  # (seq, first position, count)
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        tables = np.zeros((len(batch.seqs), max_blocks), dtype=np.int32)
        for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.num_computed_tokens
            pos = np.arange(start, start + n)
            table = np.asarray(seq.block_table, dtype=np.int64)
            tables[b, :len(table)] = table
            ids.append(np.asarray(seq.token_ids[start:start + n], dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            row0 = query_start[-1]
            if seq.prompt_logprobs is not None:
                # Rows whose next token is still a prompt token give prompt logprobs.
                first = len(seq.prompt_logprobs) - 1
                last = min(start + n, seq.num_prompt_tokens - 1)
                if first < last and first >= start:
                    prompt_rows.append((seq, first, last - first))
                    logits_rows.extend(range(row0 + first - start, row0 + last - start))
            query_start.append(row0 + n)
            seq_lens.append(start + n)
            if start + n == seq.num_tokens:
                logits_rows.append(query_start[-1] - 1)
                sampled.append(seq)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            max_query_len=max(batch.num_tokens),
        )
        input_ids = torch.from_numpy(np.concatenate(ids)).to(dev)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(dev)
        return input_ids, pos_t, meta, logits_rows, sampled, prompt_rows

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        dev = self.device
        params = [s.params for s in seqs]

        def col(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        nums = [p.logprobs for p in params if p.logprobs is not None]
        batch = SamplingBatch(
            temperature=col([p.temperature for p in params], torch.float32),
            top_k=col([p.top_k if p.top_k > 0 else 0 for p in params], torch.int64),
            top_p=col([p.top_p for p in params], torch.float32),
            min_p=col([p.min_p for p in params], torch.float32),
            repetition_penalty=col([p.repetition_penalty for p in params], torch.float32),
            presence_penalty=col([p.presence_penalty for p in params], torch.float32),
            frequency_penalty=col([p.frequency_penalty for p in params], torch.float32),
            generators=[s.generator for s in seqs],
            num_logprobs=max(nums) if nums else -1,
            all_greedy=all(p.temperature == 0 for p in params),
            needs_top_k_top_p=any(p.top_k > 0 or p.top_p < 1 for p in params),
            needs_min_p=any(p.min_p > 0 for p in params),
        )
        banned = [(row, tok) for row, seq in enumerate(seqs) if seq.num_output_tokens < seq.params.min_tokens
                  for tok in seq.stop_token_ids_for_min_tokens]
        if banned:
            rows, toks = zip(*banned)
            batch.banned = (col(list(rows), torch.int64), col(list(toks), torch.int64))
        if any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params):
            vocab = self.cfg.vocab_size
            counts = torch.zeros(len(seqs), vocab, dtype=torch.float32, device=dev)
            mask = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=dev)
            for row, seq in enumerate(seqs):
                out = torch.tensor(seq.output_token_ids, dtype=torch.int64, device=dev)
                counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
                mask[row, torch.tensor(seq.prompt_token_ids, dtype=torch.int64, device=dev)] = True
            batch.output_counts, batch.prompt_mask = counts, mask
        return batch

    # --------------------------------------------------------------- execution
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        input_ids, positions, meta, logits_rows, sampled, prompt_rows = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        result = StepResult(sampled_seqs=sampled)
        if not logits_rows:
            return result  # pure prefill chunks: no LM-head work at all
        rows = torch.tensor(logits_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        num_prompt_rows = len(logits_rows) - len(sampled)
        if prompt_rows:
            self._prompt_logprobs(logits[:num_prompt_rows], prompt_rows, result)
        if sampled:
            sample_logits = logits[num_prompt_rows:]
            out = self.sampler(sample_logits, self._sampling_batch(sampled))
            result.token_ids = out.token_ids.tolist()
            if out.logprobs is None:
                result.logprobs = [None] * len(sampled)
            else:
                values, ids = out.logprobs.tolist(), out.logprob_token_ids.tolist()
                result.logprobs = [
                    _logprob_dict(ids[i], values[i], 1 + (seq.params.logprobs or 0))
                    if seq.params.logprobs is not None else None
                    for i, seq in enumerate(sampled)
                ]
        return result

    def _prompt_logprobs(self, logits: torch.Tensor, prompt_rows: list[tuple[Sequence, int, int]],
                         result: StepResult) -> None:
        logprobs = logits.float().log_softmax(dim=-1)
        row = 0
        for seq, first, count in prompt_rows:
            targets = torch.tensor(seq.prompt_token_ids[first + 1:first + 1 + count], device=self.device)
            values, ids = gather_logprobs(logprobs[row:row + count], targets, seq.params.prompt_logprobs)
            values, ids = values.tolist(), ids.tolist()
            result.prompt_logprobs[seq] = [
                _logprob_dict(ids[i], values[i], 1 + seq.params.prompt_logprobs) for i in range(count)]
            row += count


def _logprob_dict(ids: list[int], values: list[float], keep: int) -> Logprobs:
    """Sampled token first, then the top-N (a token in both keeps its one value)."""
    out: Logprobs = {}
    for token, value in zip(ids[:keep], values[:keep]):
        out.setdefault(int(token), float(value))
    return out
