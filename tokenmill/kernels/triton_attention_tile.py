"""One K/V tile of decode or prompt attention over the paged cache: where its keys lie, their scales
over a quantized cache, the query as the dots take it, and the tile folded into the online softmax.
Shared by the kernel that gives each program one KV range (``triton_attention``) and the one that
streams every decode tile of a step through a fixed set of programs (``triton_stream_decode``)."""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.reference import QUERY_INT8_FLOOR
from tokenmill.kernels.triton_activation import tanh
from tokenmill.kernels.triton_convert import mul_rn, to_f16

# Finite stand-in for -inf as the initial running max: exp2(m_old - m_new) stays
# well-defined (never inf - inf) for rows whose first tiles are fully masked.
NEG_BIG = tl.constexpr(-1.0e30)
_QUERY_INT8_FLOOR = tl.constexpr(QUERY_INT8_FLOOR)


@triton.jit
def key_layout(start, block_size, BLOCK_N: tl.constexpr):
    """Where a sequence's tokens ``start`` … ``start + BLOCK_N`` lie: each one's block-table entry past
    ``start // block_size``, and its slot in that block. The same for every tile of a loop whose
    tiles span whole blocks (each then starts as far into a block)."""
    k = start % block_size + tl.arange(0, BLOCK_N)
    return k // block_size, k % block_size


@triton.jit
def tile_blocks(bt_row, start, end, block_size, BLOCK_N: tl.constexpr, layout, SAME: tl.constexpr):
    """The cache block of each token ``start`` … ``start + BLOCK_N`` of a sequence (0 from ``end`` on);
    where ``SAME``, ``layout`` (``key_layout``) is the tile's."""
    n = start + tl.arange(0, BLOCK_N)
    entry = start // block_size + layout[0] if SAME else n // block_size
    return tl.load(bt_row + entry, mask=n < end, other=0).to(tl.int64)


@triton.jit
def tile_scales(scales, block, start, end, kv_head, block_size, BLOCK_N: tl.constexpr, layout, SAME: tl.constexpr):
    """The K and V scales (float32) of tokens ``start`` … ``start + BLOCK_N``, held in ``block``s (0 from
    ``end`` on); ``scales``: each cache's scale pointer and strides (block, slot, head), K's then V's;
    ``layout`` and ``SAME`` as ``tile_blocks`` takes them."""
    k_scale_ptr, ks_stride_block, ks_stride_slot, ks_stride_head, v_scale_ptr, vs_stride_block, vs_stride_slot, \
        vs_stride_head = scales
    n = start + tl.arange(0, BLOCK_N)
    valid = n < end
    slot = layout[1] if SAME else n % block_size
    ks = tl.load(k_scale_ptr + block * ks_stride_block + slot * ks_stride_slot + kv_head * ks_stride_head,
                 mask=valid, other=0.0).to(tl.float32)
    vs = tl.load(v_scale_ptr + block * vs_stride_block + slot * vs_stride_slot + kv_head * vs_stride_head,
                 mask=valid, other=0.0).to(tl.float32)
    return ks, vs


@triton.jit
def prepare_query(q, INT8_CACHE: tl.constexpr, DOT_F16: tl.constexpr, PTX: tl.constexpr):
    """A query tile ``[rows, dims]`` as the dots take it, and each row's int8 step (over an int8 cache;
    zeros otherwise)."""
    q_step = tl.zeros([q.shape[0]], dtype=tl.float32)  # (read over an int8 cache alone)
    if INT8_CACHE:
        # An int8 cache: q on each row's int8 grid (``reference.quantize_query_int8``), so that its
        # scores are integer tensor-core dots with the keys as they are stored.
        # Every step rounded as the reference rounds it: a faster division is off by up to two ulps,
        # and a product fused with the + 0.5 is rounded once, either of which moves an element that
        # close to half a step onto the other step.
        # The step and its reciprocal are taken on a [rows, 1] column: on a row vector broadcast
        # afterwards, the compiler divided again for every element (sm_90 code).
        q = q.to(tl.float32)
        q_step = tl.math.div_rn(tl.maximum(tl.max(tl.abs(q), axis=1, keep_dims=True), _QUERY_INT8_FLOOR), 127.0)
        q = tl.floor(mul_rn(q, tl.math.div_rn(1.0, q_step), PTX) + 0.5).to(tl.int8)
        q_step = tl.reshape(q_step, (q.shape[0],))
    elif DOT_F16:
        # A one-byte cache under a 16-bit query: the dots run in float16, which every int8 and float8
        # value converts to exactly and cheaply (float8 two a packed instruction; to bfloat16 each goes
        # through the conversion unit, a sixteenth of the SM's rate). A bfloat16 query keeps its 8 bits
        # of mantissa from 2^-14 to float16's largest value (clamped there); below, it loses bits worth
        # under 2^-24 each beside scores of order one.
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q, q_step


@triton.jit
def attend_tile(acc, m_i, l_i, l_cols, v_inv, q, q_step, q_pos, n, n_valid, block, slot, ks, vs, kv_head, cache,
                qk_scale, softcap_log2, window, dims, dim_valid, MASKED: tl.constexpr, KV_SCALED: tl.constexpr,
                DOT_F16: tl.constexpr, PTX: tl.constexpr, USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                IEEE_DOT: tl.constexpr, ONE_TOKEN: tl.constexpr, DEFER_SUM: tl.constexpr):
    """One K/V tile (keys ``n``, held at ``block`` and ``slot``; ``ks``/``vs`` their scales over a
    quantized cache) folded into the online softmax: returns ``acc``, ``m_i`` and the row sums, ``l_i``
    or, with ``DEFER_SUM``, each key column's ``l_cols`` (the other passed through). Over a quantized
    cache ``acc`` is in units of ``1 / v_inv``; ``cache``: the K and V caches' pointers and strides (block,
    slot, head); over an int8 cache ``q`` is int8 and ``q_step`` each row's scale (``prepare_query``).
    Without ``MASKED`` every row may see every key; with ``ONE_TOKEN`` (a lone query token, at its
    sequence's last position) a masked tile masks only the keys ``n_valid`` leaves out."""
    k_cache_ptr, kc_stride_block, kc_stride_slot, kc_stride_head, v_cache_ptr, vc_stride_block, vc_stride_slot, \
        vc_stride_head = cache
    k_off = block * kc_stride_block + slot * kc_stride_slot + kv_head * kc_stride_head
    k = tl.load(
        k_cache_ptr + k_off[None, :] + dims[:, None],
        mask=n_valid[None, :] & dim_valid[:, None],
        other=0.0,
    )
    if q.dtype == tl.int8 and q.shape[1] >= 32:  # integer dots of the int8 query and keys, no conversion of K
        qk = tl.dot(q, k, out_dtype=tl.int32).to(tl.float32)
    elif q.dtype == tl.int8:
        # Integer dots take 32 dims and more: under that, the same products in float16 dots (every
        # int8 is a float16; 16 products of at most 127^2 add up exactly in the float32 accumulator).
        qk = tl.dot(q.to(tl.float16), k.to(tl.float16))
    else:
        k = to_f16(k, PTX, True) if DOT_F16 else k.to(q.dtype)  # read along d: converted in its operand layout
        if IEEE_DOT:
            qk = tl.dot(q, k, input_precision="ieee")
        else:
            qk = tl.dot(q, k)
    # The scores in the log2 domain are qk * scale: a plain score's scale is folded into the
    # exponent's operand (one FMA an element), a scaled or capped one is scaled here.
    scale = qk_scale  # scale * log2(e)
    # An int8 query's scores are in units of each row's step: a capped score needs them in its
    # natural scale; otherwise the step joins the exponent's FMA as a row factor (the row's largest
    # score times it is the largest of the scores times it), one multiply an element fewer.
    ROW_STEP: tl.constexpr = q.dtype == tl.int8 and not SOFTCAP
    if q.dtype == tl.int8 and SOFTCAP:
        qk = qk * q_step[:, None]
    if KV_SCALED:
        # A quantized cache: each key's scale multiplies its scores (q . (s k) = s (q . k)); the
        # one-byte values convert exactly to q's dtype. With the score's scale (under a cap,
        # scale / cap: tanh's argument).
        qk = qk * (ks * qk_scale)[None, :]
        scale = 1.0
    if SOFTCAP:
        # qk_scale is scale / cap: the cap applies to the natural-scale score, and only
        # its result moves to the log2 domain (softcap_log2 = cap * log2(e)).
        qk = tanh(qk * (1.0 if KV_SCALED else qk_scale)) * softcap_log2
        scale = 1.0
    if MASKED:
        allowed = n_valid[None, :]
        # A lone query token sits at its sequence's last position, and its window starts at the split's
        # first key or before: the causal and window masks hold for every key of the split (the
        # padding rows see the same keys as that token). One mask a key column instead of one an
        # element (sm_90 code, decode loops at 128 keys: int8 757 -> 723 instructions, bf16 674 -> 642).
        if not ONE_TOKEN:
            allowed = allowed & (n[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                allowed = allowed & ((q_pos[:, None] - n[None, :]) < window)
        qk = tl.where(allowed, qk, float("-inf"))

    if ROW_STEP:
        row_scale = q_step * scale
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * row_scale)
        p = tl.exp2(qk * row_scale[:, None] - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale)
        p = tl.exp2(qk * scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    if DEFER_SUM:
        l_cols = l_cols * alpha[:, None] + p
    else:
        l_i = l_i * alpha + tl.sum(p, axis=1)
    v_off = block * vc_stride_block + slot * vc_stride_slot + kv_head * vc_stride_head
    v = tl.load(
        v_cache_ptr + v_off[:, None] + dims[None, :],
        mask=n_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    # Gathered across keys: converted first (an int8 query without float16 dots is a float32 one's).
    v = to_f16(v, PTX, False) if DOT_F16 else v.to(tl.float32 if q.dtype == tl.int8 else q.dtype)
    pw = p
    if KV_SCALED:
        # Each value's scale weighs its probability (the sum l_i keeps the unweighted p), relative
        # to the program's unit: p times a small scale would fall among float16's subnormals.
        pw = p * tl.minimum(vs * v_inv, 65504.0)[None, :]
    if IEEE_DOT:
        pv = tl.dot(pw.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(pw.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i, l_cols
