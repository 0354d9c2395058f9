"""Triton neox-style rotary embedding of q and k in one launch (see ``reference.rotary_embedding``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    base_ptr,
    stride_h,
    num_heads,
    cos,
    sin,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    idx = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (idx < half)
    lo_ptr = base_ptr + heads * stride_h + idx
    x1 = tl.load(lo_ptr, mask=mask, other=0.0)
    x2 = tl.load(lo_ptr + half, mask=mask, other=0.0)
    dt = x1.dtype
    # The reference casts cos/sin to x's dtype and rounds each product and the sum to
    # it; doing the same keeps 16-bit results equal to the reference's, not just close.
    c = cos.to(dt).to(tl.float32)[None, :]
    s = sin.to(dt).to(tl.float32)[None, :]
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = (x1f * c).to(dt).to(tl.float32) + (-x2f * s).to(dt).to(tl.float32)
    o2 = (x2f * c).to(dt).to(tl.float32) + (x1f * s).to(dt).to(tl.float32)
    tl.store(lo_ptr, o1.to(dt), mask=mask)
    tl.store(lo_ptr + half, o2.to(dt), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    cos_sin_stride,
    num_q_heads,
    num_k_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program per token: its cos/sin row is loaded once for all q and k heads.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    idx = tl.arange(0, BLOCK_HALF)
    cs_row = cos_sin_ptr + pos * cos_sin_stride
    cos = tl.load(cs_row + idx, mask=idx < half, other=0.0)
    sin = tl.load(cs_row + half + idx, mask=idx < half, other=0.0)
    _rotate_heads(q_ptr + t * q_stride_t, q_stride_h, num_q_heads, cos, sin, half, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + t * k_stride_t, k_stride_h, num_k_heads, cos, sin, half, BLOCK_HK, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE on ``query`` ``[T, Hq, D]`` and ``key`` ``[T, Hkv, D]``, IN PLACE; returns ``(query, key)``.

    In place so that q/k views into a fused qkv buffer need no copy. ``rot_dim`` of
    ``cos_sin_cache`` must equal ``D`` (as the reference requires). CUDA-graph safe.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim != head_dim:
        raise ValueError(f"rot_dim {rot_dim} must equal head_dim {head_dim}")
    if query.stride(-1) != 1 or key.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("rotary_embedding needs a contiguous last dimension")
    if num_tokens:
        half = rot_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions,
            query,
            key,
            cos_sin_cache,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            cos_sin_cache.stride(0),
            num_q_heads,
            num_k_heads,
            half,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(num_k_heads),
            BLOCK_HALF=triton.next_power_of_2(half),
        )
    return query, key
