"""Triton RoPE fused with the KV-cache write (see ``reference.rotary_embedding_and_write_kv``).

At decode every layer would otherwise run two tiny kernels back to back: rotate
q and k, then scatter k and v into the paged cache. One program per token does
both: it rotates its q heads in place, and writes its rotated k heads and its v
heads straight to the token's cache slot, so k is never stored twice. Qwen3's
per-head RMSNorm of q and k (and Gemma 4's weightless one of v) runs in the same
pass: the program holds whole heads already, so the norms cost no launch and no copy
of the strided q/k/v views.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.reference import kv_qmax
from tokenmill.kernels.triton_convert import mul_rn, ptx_conversions, round_mantissa
from tokenmill.kernels.triton_launch import pdl_launch_args, wait_for_previous_kernel
from tokenmill.kernels.triton_norm import WEIGHTINGS, weigh

# Elements of one rotated half ([heads, head_dim / 2]) a pass holds: 64 heads at head dim 128, 32 at
# 256, 16 at 512 (Gemma 4's global layers); more heads take several passes. At this size and 8 warps
# a bf16 pass with the q/k norm fits in registers on sm_90 (about 160 a thread, no spills).
_MAX_TILE = 4096


@triton.jit
def _rotate(
    x_ptr,
    stride_h,
    num_heads,
    cos,
    sin,
    half,
    norm_ptr,
    eps,
    HAS_NORM: tl.constexpr,
    WEIGHTING: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Both rotated halves of ``num_heads`` heads, in x's dtype; each head RMS-normed first
    (with weight ``norm_ptr``, applied as ``WEIGHTING`` says, see triton_norm) when ``HAS_NORM``."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    idx = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (idx < half)
    lo_ptr = x_ptr + heads * stride_h + idx
    x1 = tl.load(lo_ptr, mask=mask, other=0.0)
    x2 = tl.load(lo_ptr + half, mask=mask, other=0.0)
    dt = x1.dtype
    if HAS_NORM:
        # As the reference RMSNorm rounds: float32 statistics, normed value cast to x's
        # dtype, then the weight product rounded to it.
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        inv = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * half) + eps)[:, None]
        w1 = tl.load(norm_ptr + idx, mask=idx < half, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + half + idx, mask=idx < half, other=0.0).to(tl.float32)
        if WEIGHTING == 0:
            x1 = (w1 * (a * inv).to(dt).to(tl.float32)).to(dt)
            x2 = (w2 * (b * inv).to(dt).to(tl.float32)).to(dt)
        else:  # Gemma: the weight meets the float32 normed value, one rounding
            x1 = weigh(a * inv, w1, WEIGHTING).to(dt)
            x2 = weigh(b * inv, w2, WEIGHTING).to(dt)
    # The reference casts cos/sin to x's dtype and rounds each product and the sum to
    # it; doing the same keeps 16-bit results equal to the reference's, not just close.
    c = cos.to(dt).to(tl.float32)[None, :]
    s = sin.to(dt).to(tl.float32)[None, :]
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = (x1f * c).to(dt).to(tl.float32) + (-x2f * s).to(dt).to(tl.float32)
    o2 = (x2f * c).to(dt).to(tl.float32) + (x1f * s).to(dt).to(tl.float32)
    return o1.to(dt), o2.to(dt)


@triton.jit
def _kv_scale(amax, QMAX: tl.constexpr):
    """A head's scale, as ``reference.quantize_kv`` takes it: its largest magnitude over the dtype's,
    with a margin so that bfloat16 rounding never takes it below; returned rounded to bfloat16 (in
    float32), 1 for an all-zero head."""
    scale = round_mantissa(tl.math.div_rn(amax, QMAX) * (1.0 + 0.0078125), 7)  # to bfloat16's 7 bits
    return tl.where(scale > 0.0, scale, 1.0)


@triton.jit
def _quantize(x, inv_scale, QMAX: tl.constexpr, dtype: tl.constexpr, PTX: tl.constexpr):
    """``x`` (float32) times its head's ``inv_scale`` (the scale's reciprocal, correctly rounded: one
    division a head, not one a value), clamped to the dtype's range, in ``dtype``: int8 rounds to the
    nearest integer (ties away from zero, where torch rounds them to even: a rare half step), float8
    as the cast does. Every step rounds as the reference's, so a value quantizes as it does there."""
    y = tl.minimum(tl.maximum(mul_rn(x, inv_scale, PTX), -QMAX), QMAX)
    if dtype == tl.int8:
        y = tl.where(y >= 0.0, tl.floor(y + 0.5), -tl.floor(-y + 0.5))
    return y.to(dtype)


@triton.jit
def _rope_write_kv_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    cos_sin_stride,
    kc_stride_block,
    kc_stride_slot,
    kc_stride_head,
    vc_stride_block,
    vc_stride_slot,
    vc_stride_head,
    k_scale_ptr,
    v_scale_ptr,
    ks_stride_block,
    ks_stride_slot,
    ks_stride_head,
    vs_stride_block,
    vs_stride_slot,
    vs_stride_head,
    kv_amax_ptr,
    block_size,
    num_q_heads,
    num_kv_heads,
    half,
    head_dim,
    HAS_NORM: tl.constexpr,
    WEIGHTING: tl.constexpr,
    V_NORM: tl.constexpr,
    QUANTIZED: tl.constexpr,
    QMAX: tl.constexpr,
    STATIC_AMAX: tl.constexpr,
    PTX: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # Two programs per token: one rotates its q heads, the other its k heads and writes k and v (a
    # single token, as in decode, then takes two SMs, not one); each loads the token's cos/sin row.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    idx = tl.arange(0, BLOCK_HALF)
    cs_row = cos_sin_ptr + pos * cos_sin_stride
    cos = tl.load(cs_row + idx, mask=idx < half, other=0.0)
    sin = tl.load(cs_row + half + idx, mask=idx < half, other=0.0)

    # Heads go BLOCK_HQ (BLOCK_HK) at a time, so the tile in registers is bounded whatever the
    # head count and dim: one pass up to 64 heads of dim 128, 32 of 256, 16 of 512.
    if tl.program_id(1) == 0:
        q_row = q_ptr + t * q_stride_t
        qh = tl.arange(0, BLOCK_HQ)[:, None]
        for h0 in range(0, num_q_heads, BLOCK_HQ):
            q_heads = q_row + h0 * q_stride_h
            q1, q2 = _rotate(
                q_heads,
                q_stride_h,
                num_q_heads - h0,
                cos,
                sin,
                half,
                q_norm_ptr,
                eps,
                HAS_NORM,
                WEIGHTING,
                BLOCK_HQ,
                BLOCK_HALF,
            )
            qmask = (qh < num_q_heads - h0) & (idx[None, :] < half)
            tl.store(q_heads + qh * q_stride_h + idx[None, :], q1, mask=qmask)
            tl.store(q_heads + qh * q_stride_h + half + idx[None, :], q2, mask=qmask)
    else:
        # Padding tokens (slot < 0) get zero live heads: nothing is written to the cache.
        # (A scalar folded into the mask as a limit, not and-ed in as a bool: the
        # interpreter rejects scalar-bool & tensor-bool masks.)
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        live_heads = tl.where(slot >= 0, num_kv_heads, 0)
        block = slot // block_size
        offset = slot % block_size
        kh = tl.arange(0, BLOCK_HK)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        k_row = k_ptr + t * k_stride_t
        v_row = v_ptr + t * v_stride_t
        k_slot = k_cache_ptr + block * kc_stride_block + offset * kc_stride_slot
        v_slot = v_cache_ptr + block * vc_stride_block + offset * vc_stride_slot
        for h0 in range(0, num_kv_heads, BLOCK_HK):
            k1, k2 = _rotate(
                k_row + h0 * k_stride_h,
                k_stride_h,
                num_kv_heads - h0,
                cos,
                sin,
                half,
                k_norm_ptr,
                eps,
                HAS_NORM,
                WEIGHTING,
                BLOCK_HK,
                BLOCK_HALF,
            )
            kmask = (kh < live_heads - h0) & (idx[None, :] < half)
            k_dst = k_slot + (h0 + kh) * kc_stride_head + idx[None, :]
            vmask = (kh < live_heads - h0) & (dims < head_dim)
            v = tl.load(v_row + (h0 + kh) * v_stride_h + dims, mask=vmask, other=0.0)
            if V_NORM:  # Gemma 4's v norm, weightless: float32 statistics, one rounding
                vf = v.to(tl.float32)
                v = (vf * tl.rsqrt(tl.sum(vf * vf, axis=1) / head_dim + eps)[:, None]).to(v.dtype)
            v_dst = v_slot + (h0 + kh) * vc_stride_head + dims
            if QUANTIZED:
                # One scale per token and head, for K and for V, stored beside the one-byte values.
                heads = h0 + tl.arange(0, BLOCK_HK)
                live = heads < live_heads
                k1f, k2f, vf = k1.to(tl.float32), k2.to(tl.float32), v.to(tl.float32)
                k_amax = tl.maximum(tl.max(tl.abs(k1f), axis=1), tl.max(tl.abs(k2f), axis=1))
                v_amax = tl.max(tl.abs(vf), axis=1)
                if STATIC_AMAX:  # a checkpoint's calibrated magnitudes, for every token and head
                    k_amax = tl.zeros_like(k_amax) + tl.load(kv_amax_ptr)
                    v_amax = tl.zeros_like(v_amax) + tl.load(kv_amax_ptr + 1)
                k_s = _kv_scale(k_amax, QMAX)
                v_s = _kv_scale(v_amax, QMAX)
                tl.store(
                    k_scale_ptr + block * ks_stride_block + offset * ks_stride_slot + heads * ks_stride_head,
                    k_s.to(k_scale_ptr.dtype.element_ty),
                    mask=live,
                )
                tl.store(
                    v_scale_ptr + block * vs_stride_block + offset * vs_stride_slot + heads * vs_stride_head,
                    v_s.to(v_scale_ptr.dtype.element_ty),
                    mask=live,
                )
                k_inv = tl.math.div_rn(1.0, k_s)[:, None]
                v_inv = tl.math.div_rn(1.0, v_s)[:, None]
                tl.store(k_dst, _quantize(k1f, k_inv, QMAX, k_cache_ptr.dtype.element_ty, PTX), mask=kmask)
                tl.store(k_dst + half, _quantize(k2f, k_inv, QMAX, k_cache_ptr.dtype.element_ty, PTX), mask=kmask)
                tl.store(v_dst, _quantize(vf, v_inv, QMAX, v_cache_ptr.dtype.element_ty, PTX), mask=vmask)
            else:
                tl.store(k_dst, k1.to(k_cache_ptr.dtype.element_ty), mask=kmask)
                tl.store(k_dst + half, k2.to(k_cache_ptr.dtype.element_ty), mask=kmask)
                tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=vmask)


def rotary_embedding_and_write_kv(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_weighting: str = "llama",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_amax: torch.Tensor | None = None,
    v_norm: bool = False,
) -> torch.Tensor:
    """Neox RoPE on ``query`` ``[T, Hq, D]`` (IN PLACE, returned) and ``key`` ``[T, Hkv, D]``; the rotated
    key and ``value`` go to the paged caches at ``slot_mapping`` (< 0: padding). ``key`` itself is left
    as it was. With norm weights (``[D]`` each, both or neither) q and k heads are RMS-normed first
    (their weights applied as ``norm_weighting`` says: see ``reference.NORMS``); with ``v_norm`` v
    heads too, weightless (Gemma 4's). A quantized cache (int8, float8) takes the values over their
    per-token, per-head scales, written to ``k_scale``/``v_scale`` ``[num_blocks, block_size, Hkv]``
    (``reference.quantize_kv``; with a checkpoint's static ``kv_amax`` ``[2]`` float32 for K and V).
    Inputs may be strided views of a fused qkv buffer (last dim contiguous); no host reads, so
    CUDA-graph safe."""
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q and k norm weights, or neither")
    quantized = k_scale is not None  # as the reference decides it
    if (k_scale is None) != (v_scale is None):
        raise ValueError("a quantized cache takes both k and v scales")
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim != head_dim:
        raise ValueError(f"rot_dim {rot_dim} must equal head_dim {head_dim}")
    for t in (query, key, value, cos_sin_cache, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("rotary_embedding_and_write_kv needs a contiguous last dimension")
    if num_tokens:
        half = rot_dim // 2
        block_half = triton.next_power_of_2(half)
        # At most _MAX_TILE elements of each rotated half per pass over the heads.
        max_heads = max(1, _MAX_TILE // block_half)
        block_hq = min(triton.next_power_of_2(num_q_heads), max_heads)
        block_hk = min(triton.next_power_of_2(max(num_kv_heads, 1)), max_heads)  # no KV heads: q alone
        _rope_write_kv_kernel[(num_tokens, 2)](
            positions,
            query,
            key,
            value,
            cos_sin_cache,
            k_cache,
            v_cache,
            slot_mapping,
            q_norm_weight if q_norm_weight is not None else query,
            k_norm_weight if k_norm_weight is not None else key,
            eps,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            cos_sin_cache.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            k_scale if quantized else query,
            v_scale if quantized else query,  # unused when not QUANTIZED
            *(k_scale.stride() if k_scale is not None else (0, 0, 0)),
            *(v_scale.stride() if v_scale is not None else (0, 0, 0)),
            kv_amax if kv_amax is not None else query,
            k_cache.shape[1],
            num_q_heads,
            num_kv_heads,
            half,
            head_dim,
            HAS_NORM=q_norm_weight is not None,
            WEIGHTING=WEIGHTINGS[norm_weighting],
            V_NORM=v_norm,
            QUANTIZED=quantized,
            QMAX=kv_qmax(k_cache.dtype) if quantized else 0.0,
            STATIC_AMAX=quantized and kv_amax is not None,
            PTX=quantized and ptx_conversions(),
            BLOCK_HQ=block_hq,
            BLOCK_HK=block_hk,
            BLOCK_HALF=block_half,
            BLOCK_D=triton.next_power_of_2(head_dim),
            num_warps=4 if block_hq * block_half <= 2048 else 8,
            **pdl_launch_args(query.device),
        )
    return query


def rotary_embedding_query(
    positions: torch.Tensor,
    query: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_weighting: str = "llama",
) -> torch.Tensor:
    """(The q norm, then) RoPE on ``query`` alone, IN PLACE, nothing written: the same kernel with no
    KV heads, for a layer reading another layer's cache (Gemma 4's KV-shared layers)."""
    no_heads = query[:, :0]
    unused_cache = query.unsqueeze(1)  # [T, 1, Hq, D]: a cache-shaped view that no KV head writes
    return rotary_embedding_and_write_kv(
        positions,
        query,
        no_heads,
        no_heads,
        cos_sin_cache,
        unused_cache,
        unused_cache,
        positions,
        q_norm_weight,
        q_norm_weight,
        eps,
        norm_weighting,
    )
