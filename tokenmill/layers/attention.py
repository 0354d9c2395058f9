"""Attention over the paged KV cache for one flat ragged batch.

The same path serves decode (one query token per sequence), prefill chunks
and speculative verification: only ``query_start_loc`` differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from tokenmill.layers import ops
from tokenmill.layers.norm import NormParams
from tokenmill.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class KVCache:
    """One layer's cache ``[num_blocks, block_size, kv_heads, head_dim]`` for K and for V, and where
    it is quantized (int8, float8) their scales ``[num_blocks, block_size, kv_heads]``."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged cache (see kernels/reference.py for layouts).
    Each KV group (loader/kv_layout.py) has its own blocks: one slot mapping and one block
    table per group, indexed by a layer's ``kv_group``."""

    slot_mapping: tuple[torch.Tensor, ...]  # per group: [T] int64, -1 for padding
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    block_tables: tuple[torch.Tensor, ...]  # per group: [B, max_blocks] int32
    max_query_len: int  # host-side; 1 for a pure decode step
    max_seq_len: int | None = None  # host-side upper bound of seq_lens; None: the block-table width
    kv_splits: int | None = None  # the KV ranges every context is split into; None: the kernel's choice
    # A step of prompt chunks and one-token queries, the chunks' sequences first: each kind attends
    # in a launch of its own (``split_one_token_queries``).
    parts: tuple[int, AttentionMetadata, AttentionMetadata] | None = None

    def split_one_token_queries(self, num_seqs: int, num_tokens: int) -> AttentionMetadata:
        """This step with its first ``num_seqs`` sequences (several query tokens each, ``num_tokens``
        in all) and the rest (one each) attending apart. In one launch the tiles fit the longest query,
        and every one-token sequence computes a whole prompt tile's rows for its one (32-128 rows, at a
        group of 4 only 4 of them real) over every key of its context; apart, the one-token sequences
        take the decode tiles, whose cost is reading their keys. The second part's lengths and block
        tables are copies, so that they start on the 16-byte boundary every compiled kernel variant
        assumes (its slots are not read: the step's K/V are written before)."""
        chunks = AttentionMetadata(
            tuple(s[:num_tokens] for s in self.slot_mapping),
            self.query_start_loc[: num_seqs + 1],
            self.seq_lens[:num_seqs],
            tuple(t[:num_seqs] for t in self.block_tables),
            self.max_query_len,
            self.max_seq_len,
        )
        ones = AttentionMetadata(
            tuple(s[num_tokens:] for s in self.slot_mapping),
            self.query_start_loc[num_seqs:] - num_tokens,
            self.seq_lens[num_seqs:].clone(),
            tuple(t[num_seqs:].clone() for t in self.block_tables),
            1,
            self.max_seq_len,
        )
        return replace(self, parts=(num_tokens, chunks, ones))


class PagedAttention(nn.Module):
    """Rotates q and k (after Qwen3's or Gemma's per-head norms, when given: norm modules with
    ``weight``, ``eps`` and ``weighting``, see layers/norm.py), writes this step's K/V
    into the cache (one fused pass), then attends over the whole context. ``scale``
    defaults to ``head_dim ** -0.5``; ``softcap`` caps the scores (Gemma); ``kv_group`` picks
    the slot mapping and block table of the layer's KV group."""

    kv_amax: torch.Tensor | None  # a buffer

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None,
        rotary: RotaryEmbedding,
        scale: float | None = None,
        softcap: float | None = None,
        kv_group: int = 0,
    ) -> None:
        super().__init__()
        self.kv_group = kv_group
        # A checkpoint's calibrated largest magnitudes of K and V (``k_scale``/``v_scale`` tensors, for a
        # float8 e4m3 cache), which a quantized cache then uses for every token; None: each token's own.
        self.register_buffer("kv_amax", None)
        self.rotary = rotary
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        self.sliding_window = sliding_window

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        q_norm: NormParams | None = None,
        k_norm: NormParams | None = None,
        v_norm: bool = False,
    ) -> torch.Tensor:
        """``v_norm``: each v head RMS-normed, weightless, on its way to the cache (Gemma 4)."""
        q = ops.rotary_embedding_and_write_kv(
            positions,
            q,
            k,
            v,
            self.rotary.cos_sin_cache,
            kv_cache.k,
            kv_cache.v,
            meta.slot_mapping[self.kv_group],
            q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 1e-6,
            norm_weighting=q_norm.weighting if q_norm is not None else "llama",
            k_scale=kv_cache.k_scale,
            v_scale=kv_cache.v_scale,
            kv_amax=self.kv_amax,
            v_norm=v_norm,
        )
        return self.attend(q, kv_cache, meta)

    def load_checkpoint_scale(self, which: str, scale: torch.Tensor) -> None:
        """A checkpoint's per-tensor ``k_scale`` or ``v_scale`` (``which``): the e4m3 scale that maps the
        tensor's calibrated largest magnitude to 448, kept as that magnitude."""
        if scale.numel() != 1:
            raise ValueError(f"{which} must hold one value (a per-tensor scale), got shape {tuple(scale.shape)}")
        if not (math.isfinite(float(scale)) and float(scale) > 0):
            raise ValueError(f"{which} must be a finite positive scale, got {float(scale)}")
        if self.kv_amax is None:
            self.kv_amax = torch.full((2,), float("nan"), dtype=torch.float32, device=self.rotary.cos_sin_cache.device)
        self.kv_amax[0 if which == "k_scale" else 1] = float(scale) * torch.finfo(torch.float8_e4m3fn).max

    def attend(
        self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention of the rotated ``q`` over the layer's cache (written before), into ``out`` if given."""
        if meta.parts is not None:
            first, chunks, ones = meta.parts
            out = torch.empty_like(q) if out is None else out
            self.attend(q[:first], kv_cache, chunks, out[:first])
            self.attend(q[first:], kv_cache, ones, out[first:])
            return out
        return ops.paged_attention(
            q,
            kv_cache.k,
            kv_cache.v,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables[self.kv_group],
            self.scale,
            self.sliding_window,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            softcap=self.softcap,
            k_scale=kv_cache.k_scale,
            v_scale=kv_cache.v_scale,
            num_splits=meta.kv_splits,
            out=out,
        )
