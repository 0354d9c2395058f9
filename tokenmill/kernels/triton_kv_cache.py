"""Triton kernel writing this step's K/V into the paged cache (see ``reference.write_kv_cache``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    kc_stride_block,
    kc_stride_slot,
    kc_stride_head,
    vc_stride_block,
    vc_stride_slot,
    vc_stride_head,
    block_size,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: all of its heads at once, so a token is one contiguous
    # burst of Hkv*D elements on both sides.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # Padding tokens (slot < 0) get zero live heads, so nothing is loaded or stored.
    # (A scalar folded into the mask as a limit, not and-ed in as a bool: the
    # interpreter rejects scalar-bool & tensor-bool masks.)
    live_heads = tl.where(slot >= 0, num_heads, 0)
    mask = (heads < live_heads) & (dims < head_dim)
    block = slot // block_size
    offset = slot % block_size

    k = tl.load(key_ptr + t * key_stride_t + heads * key_stride_h + dims, mask=mask)
    v = tl.load(value_ptr + t * value_stride_t + heads * value_stride_h + dims, mask=mask)
    k_dst = block * kc_stride_block + offset * kc_stride_slot + heads * kc_stride_head + dims
    v_dst = block * vc_stride_block + offset * vc_stride_slot + heads * vc_stride_head + dims
    tl.store(k_cache_ptr + k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into the paged caches; slots < 0 are padding.

    ``key``/``value`` may be strided views (e.g. slices of a fused qkv projection);
    only their last dimension must be contiguous. No host reads: CUDA-graph safe.
    """
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for t in (key, value, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("write_kv_cache needs a contiguous last dimension")
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_cache.shape[1],
        num_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
