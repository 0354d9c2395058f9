"""Triton paged attention over the ragged batch (see ``reference.paged_attention``).

One kernel serves decode and multi-token queries (prefill chunks, speculative
verification). A program owns one KV head of one sequence and a tile of
``BLOCK_M`` rows, each row a (query token, q head of that KV head's group) pair:
the group's heads share every K/V tile it loads, so GQA reads the cache once.
K/V are gathered token by token through the block table, so a tile spans
several cache blocks and block ids need not be contiguous.

Decode at small batch would leave most SMs idle (batch 1 × 8 KV heads is 8
programs), so the KV range can be split across ``num_splits`` programs
(flash-decoding): each writes an unnormalised partial output with its running
max and sum, and a second kernel merges them. The split count is chosen on the
host from shapes only (batch, KV heads, block-table width or a host-side bound
of the context, SM count) and each
program divides its *actual* range in-kernel, so nothing reads tensor values on
the host: the decode path can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.reference import QUERY_INT8_FLOOR
from tokenmill.kernels.triton_activation import tanh
from tokenmill.kernels.triton_convert import mul_rn, ptx_conversions, to_f16
from tokenmill.kernels.triton_launch import num_sms, pdl_launch_args, wait_for_previous_kernel

_LOG2E = 1.4426950408889634
# Finite stand-in for -inf as the initial running max: exp2(m_old - m_new) stays
# well-defined (never inf - inf) for rows whose first tiles are fully masked.
_NEG_BIG = tl.constexpr(-1.0e30)
_QUERY_INT8_FLOOR = tl.constexpr(QUERY_INT8_FLOOR)
_MAX_SPLITS = 64
# The merge reads a program's splits as one [BLOCK_S, dims] tile: this many rows up to this many splits,
# _MAX_SPLITS past it. Two variants, not one a split count; the small one holds an eighth of the
# registers, so a prompt's thousands of merge programs (one a token and head) fill the SMs.
_FEW_SPLITS = 8
# Query starts a flat-tile program scans at a time.
_SEQ_CHUNK = tl.constexpr(128)
_NO_TILE = tl.constexpr(2**31 - 1)  # past every flat tile: where a scan has not found a sequence's end
# Never fewer KV tokens per split than one K/V tile: a split then costs one tile's latency.
_MIN_TOKENS_PER_SPLIT = 64
# The programs an SM a split grid aims for (``_choose_num_splits``): a decode tile takes an SM's shared
# memory alone; prompt tiles (64 rows and more) keep the target they were first measured under.
_SPLIT_PROGRAMS_PER_SM = 2
_PROMPT_SPLIT_PROGRAMS_PER_SM = 4
# Shared memory for the pipelined K and V tiles (2 x stages x BLOCK_N x BLOCK_D elements): sm_90
# gives a block 227 KiB, and the kernel needs some besides.
_KV_SMEM_BUDGET = 192 * 1024


@triton.jit
def _key_layout(start, block_size, BLOCK_N: tl.constexpr):
    """Where a sequence's tokens ``start`` … ``start + BLOCK_N`` lie: each one's block-table entry past
    ``start // block_size``, and its slot in that block. The same for every tile of a loop whose
    tiles span whole blocks (each then starts as far into a block)."""
    k = start % block_size + tl.arange(0, BLOCK_N)
    return k // block_size, k % block_size


@triton.jit
def _tile_blocks(bt_row, start, end, block_size, BLOCK_N: tl.constexpr, layout, SAME: tl.constexpr):
    """The cache block of each token ``start`` … ``start + BLOCK_N`` of a sequence (0 from ``end`` on);
    where ``SAME``, ``layout`` (``_key_layout``) is the tile's."""
    n = start + tl.arange(0, BLOCK_N)
    entry = start // block_size + layout[0] if SAME else n // block_size
    return tl.load(bt_row + entry, mask=n < end, other=0).to(tl.int64)


@triton.jit
def _tile_scales(scales, block, start, end, kv_head, block_size, BLOCK_N: tl.constexpr, layout, SAME: tl.constexpr):
    """The K and V scales (float32) of tokens ``start`` … ``start + BLOCK_N``, held in ``block``s (0 from
    ``end`` on); ``scales``: each cache's scale pointer and strides (block, slot, head), K's then V's;
    ``layout`` and ``SAME`` as ``_tile_blocks`` takes them."""
    (
        k_scale_ptr,
        ks_stride_block,
        ks_stride_slot,
        ks_stride_head,
        v_scale_ptr,
        vs_stride_block,
        vs_stride_slot,
        vs_stride_head,
    ) = scales
    n = start + tl.arange(0, BLOCK_N)
    valid = n < end
    slot = layout[1] if SAME else n % block_size
    ks = tl.load(
        k_scale_ptr + block * ks_stride_block + slot * ks_stride_slot + kv_head * ks_stride_head, mask=valid, other=0.0
    ).to(tl.float32)
    vs = tl.load(
        v_scale_ptr + block * vs_stride_block + slot * vs_stride_slot + kv_head * vs_stride_head, mask=valid, other=0.0
    ).to(tl.float32)
    return ks, vs


@triton.jit
def _flat_tile(query_start_loc_ptr, f, batch, BLOCK_Q: tl.constexpr):
    """The sequence and query tile of flat tile ``f``: a ragged batch's sequences in order, each with
    ``cdiv(q, BLOCK_Q)`` tiles for ``q`` query tokens (none for an empty one), its last tile (causal:
    the most keys) first. The sequence is ``batch`` past the last tile. Every program scans the query
    starts, ``_SEQ_CHUNK`` at a time."""
    seq = 0
    stop = _NO_TILE  # the flat tile after sequence ``seq``'s last
    before = 0  # the tiles of the chunks already scanned
    for b0 in range(0, batch, _SEQ_CHUNK):
        bs = b0 + tl.arange(0, _SEQ_CHUNK)
        valid = bs < batch
        lo = tl.load(query_start_loc_ptr + bs, mask=valid, other=0)
        hi = tl.load(query_start_loc_ptr + bs + 1, mask=valid, other=0)
        ends = before + tl.cumsum(tl.where(valid, (hi - lo + BLOCK_Q - 1) // BLOCK_Q, 0), axis=0)
        done = valid & (ends <= f)  # sequences whose tiles all come before f
        seq += tl.sum(done.to(tl.int32), axis=0)
        stop = tl.minimum(stop, tl.min(tl.where(valid & (ends > f), ends, _NO_TILE), axis=0))
        before = tl.max(ends, axis=0)
    return seq, stop - 1 - f


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    v_inv,
    q,
    q_step,
    q_pos,
    lo,
    hi,
    split_hi,
    bt_row,
    kv_head,
    cache,
    scales,
    qk_scale,
    softcap_log2,
    window,
    dims,
    dim_valid,
    block_size: tl.constexpr,
    MASKED: tl.constexpr,
    KV_SCALED: tl.constexpr,
    PIPELINED_SCALES: tl.constexpr,
    DOT_F16: tl.constexpr,
    PTX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    ONE_TOKEN: tl.constexpr,
):
    """The online softmax over the key tiles ``lo`` … ``hi`` (of a split ending at ``split_hi``) folded
    into ``acc``, ``m_i``, ``l_i``; without ``MASKED`` every row may see every key of every tile; with
    ``ONE_TOKEN`` (every sequence's query is one token) a masked tile masks only the keys past the
    split. Over a quantized cache ``acc`` is in units of ``1 / v_inv``, the program's (``_paged_attention_kernel``).
    ``cache``: the K and V caches' pointers and strides (block, slot, head); ``scales``: theirs.
    Over an int8 cache ``q`` is int8 and ``q_step`` each row's scale (float32; otherwise unused)."""
    (
        k_cache_ptr,
        kc_stride_block,
        kc_stride_slot,
        kc_stride_head,
        v_cache_ptr,
        vc_stride_block,
        vc_stride_slot,
        vc_stride_head,
    ) = cache
    BLOCK_M: tl.constexpr = q.shape[0]
    # A quantized cache's scales. With ``PIPELINED_SCALES`` (``_pipelined_scales``) they are read in
    # their tile's iteration: the pipeline copies them asynchronously with the K/V tiles, and they reach
    # the scores' layout from shared memory. Otherwise they are read a tile ahead, from block ids read a
    # tile before that (no read a tile's dots wait for depends on another read of the same iteration),
    # and cross into the scores' layout through registers every tile (fp8 decode at 128 keys: 13
    # barriers an iteration against 9; sm_90 code).
    # Where tiles span whole blocks, every tile's keys lie at the first tile's block-table steps and
    # slots (``_key_layout``), computed once: the loop keeps only the block ids and their products
    # (sm_90 code: the fp8 decode loop at 128 keys 1,039 -> 900 instructions, bf16's at 64 keys 688 ->
    # 500, a 16-bit prompt's 762 -> 674). Not in a quantized prompt's tile, whose registers are full:
    # its spills grew from 72 to 296 bytes.
    SAME: tl.constexpr = BLOCK_N % block_size == 0 and (BLOCK_M < 64 or not KV_SCALED)
    layout = _key_layout(lo, block_size, BLOCK_N)
    if KV_SCALED and not PIPELINED_SCALES:
        ks_next, vs_next = _tile_scales(
            scales,
            _tile_blocks(bt_row, lo, split_hi, block_size, BLOCK_N, layout, SAME),
            lo,
            split_hi,
            kv_head,
            block_size,
            BLOCK_N,
            layout,
            SAME,
        )
        blocks_next = _tile_blocks(bt_row, lo + BLOCK_N, split_hi, block_size, BLOCK_N, layout, SAME)
    # Decode tiles (under 64 rows) spread a tile's keys over the warps: a row's sum over them would
    # cross warps every tile, so each key column keeps its own running sum, added up once at the end.
    DEFER_SUM: tl.constexpr = BLOCK_M < 64
    m_in = m_i
    if DEFER_SUM:
        l_cols = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        # An unmasked loop's tiles lie wholly before the split's end: their K/V loads take no mask (a
        # prompt tile's loop at 128 rows x 32 keys: a 2,048-token prompt 120.9 -> 117.4 us, 4 x 512
        # over 4k 415.5 -> 397.2; h200-2026-12-02/decode-tiles-971160b).
        n_valid = n < split_hi if MASKED else tl.full([BLOCK_N], True, tl.int1)
        block = _tile_blocks(bt_row, start, split_hi, block_size, BLOCK_N, layout, SAME)
        slot = layout[1] if SAME else n % block_size
        if KV_SCALED and PIPELINED_SCALES:
            ks, vs = _tile_scales(scales, block, start, split_hi, kv_head, block_size, BLOCK_N, layout, SAME)
        elif KV_SCALED:
            ks, vs = ks_next, vs_next
            ks_next, vs_next = _tile_scales(
                scales, blocks_next, start + BLOCK_N, split_hi, kv_head, block_size, BLOCK_N, layout, SAME
            )
            blocks_next = _tile_blocks(bt_row, start + 2 * BLOCK_N, split_hi, block_size, BLOCK_N, layout, SAME)
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
        m_i = m_new
    if DEFER_SUM:
        l_i = l_i * tl.exp2(m_in - m_i) + tl.sum(l_cols, axis=1)
    return acc, m_i, l_i


# The block-table width and the split count change with every batch: specialising on their values
# (1, multiples of 16) would compile new variants inside requests' steps.
@triton.jit(do_not_specialize=["bt_stride", "num_splits", "batch"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    qk_scale,
    softcap_log2,
    window,
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
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
    bt_stride,
    num_q_heads,
    head_dim: tl.constexpr,  # one a model (a few for Gemma 4): a head dim of BLOCK_D needs no masks
    block_size: tl.constexpr,  # an engine's one block size: divisions by it become shifts
    num_splits,
    batch,
    KV_SCALED: tl.constexpr,
    PIPELINED_SCALES: tl.constexpr,
    DOT_F16: tl.constexpr,
    PTX: tl.constexpr,
    FLAT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WRITE_PARTIALS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    MASK_EDGES_ONLY: tl.constexpr,
    ONE_TOKEN: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # The GPU starts a sequence's programs in the order of this index (the grid's first dimension
    # fastest); it is read with the heads and splits fastest, so that a query tile's heads start together.
    start_order = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)
    heads_splits = tl.num_programs(1)
    kv_head = (start_order % heads_splits) // num_splits
    split = start_order % num_splits
    if FLAT:  # a ragged batch: only its real tiles are launched, numbered in one flat range
        seq, q_tile = _flat_tile(query_start_loc_ptr, start_order // heads_splits, batch, BLOCK_Q)
        if seq >= batch:
            return
    else:  # every sequence gets the longest query's tile count, the last (causal: the most keys) first
        q_tile = tl.num_programs(0) - 1 - start_order // heads_splits
        seq = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_lo = q_tile * BLOCK_Q
    if tile_lo >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # position of the sequence's first query token

    rows = tl.arange(0, BLOCK_M)
    tok = tile_lo + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = context + tok
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_row[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    q_step = tl.zeros([BLOCK_M], dtype=tl.float32)  # (read over an int8 cache alone)
    if k_cache_ptr.dtype.element_ty == tl.int8:
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
        q_step = tl.reshape(q_step, (BLOCK_M,))
    elif DOT_F16:
        # A one-byte cache under a 16-bit query: the dots run in float16, which every int8 and float8
        # value converts to exactly and cheaply (float8 two a packed instruction; to bfloat16 each goes
        # through the conversion unit, a sixteenth of the SM's rate). A bfloat16 query keeps its 8 bits
        # of mantissa from 2^-14 to float16's largest value (clamped there); below, it loses bits worth
        # under 2^-24 each beside scores of order one.
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    # Keys this tile can see: causal upper bound from its last token, window lower
    # bound from its first; blocks outside are never loaded.
    kv_hi = context + tl.minimum(q_len, tile_lo + BLOCK_Q)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(context + tile_lo - window + 1, 0)
    chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, num_splits), BLOCK_N) * BLOCK_N
    split_lo = kv_lo + split * chunk
    split_hi = tl.minimum(split_lo + chunk, kv_hi)

    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * bt_stride
    cache = (
        k_cache_ptr,
        kc_stride_block,
        kc_stride_slot,
        kc_stride_head,
        v_cache_ptr,
        vc_stride_block,
        vc_stride_slot,
        vc_stride_head,
    )
    scales = (
        k_scale_ptr,
        ks_stride_block,
        ks_stride_slot,
        ks_stride_head,
        v_scale_ptr,
        vs_stride_block,
        vs_stride_slot,
        vs_stride_head,
    )
    # Over a quantized cache, acc's unit: the largest value scale of the split's first tile (1 where
    # those values are all zero), in which every tile's scales weigh its probabilities in float16. One
    # unit for every tile, where each tile took its own, spares each a maximum across the warps and a
    # rescaled sum (sm_90 code, fp8 decode at 128 keys: 734 -> 676 instructions a tile, 9 -> 6
    # barriers; an fp8 prompt's tile 1,389 -> 1,277, its spills gone). A key whose scale is over 65504
    # times the unit (float16's largest value) weighs as if it were 65504 times.
    v_unit = 1.0
    if KV_SCALED:
        first = _tile_scales(
            scales,
            _tile_blocks(bt_row, split_lo, split_hi, block_size, BLOCK_N, None, False),
            split_lo,
            split_hi,
            kv_head,
            block_size,
            BLOCK_N,
            None,
            False,
        )[1]
        v_unit = tl.max(first, axis=0)
        v_unit = tl.where(v_unit > 0.0, v_unit, 1.0)
    v_inv = 1.0 / v_unit
    if MASK_EDGES_ONLY:
        # The keys every row may see (past the window's edge for the tile's last token, up to its first
        # token's position) go through a loop without the masks; the tiles on either edge keep them (a
        # decode tile's: its last, partial one). Tiles stay aligned to split_lo in all three.
        edge = split_lo
        if USE_WINDOW:
            edge = tl.maximum(kv_hi - window, split_lo)
        full_lo = split_lo + tl.cdiv(edge - split_lo, BLOCK_N) * BLOCK_N
        full_hi = tl.maximum(
            split_lo + (tl.minimum(context + tile_lo + 1, split_hi) - split_lo) // BLOCK_N * BLOCK_N, full_lo
        )
        acc, m_i, l_i = _attend_tiles(
            acc,
            m_i,
            l_i,
            v_inv,
            q,
            q_step,
            q_pos,
            split_lo,
            tl.minimum(full_lo, split_hi),
            split_hi,
            bt_row,
            kv_head,
            cache,
            scales,
            qk_scale,
            softcap_log2,
            window,
            dims,
            dim_valid,
            block_size,
            True,
            KV_SCALED,
            PIPELINED_SCALES,
            DOT_F16,
            PTX,
            BLOCK_N,
            USE_WINDOW,
            SOFTCAP,
            IEEE_DOT,
            ONE_TOKEN,
        )
        acc, m_i, l_i = _attend_tiles(
            acc,
            m_i,
            l_i,
            v_inv,
            q,
            q_step,
            q_pos,
            full_lo,
            full_hi,
            split_hi,
            bt_row,
            kv_head,
            cache,
            scales,
            qk_scale,
            softcap_log2,
            window,
            dims,
            dim_valid,
            block_size,
            False,
            KV_SCALED,
            PIPELINED_SCALES,
            DOT_F16,
            PTX,
            BLOCK_N,
            USE_WINDOW,
            SOFTCAP,
            IEEE_DOT,
            ONE_TOKEN,
        )
        masked_lo = full_hi
    else:
        masked_lo = split_lo
    acc, m_i, l_i = _attend_tiles(
        acc,
        m_i,
        l_i,
        v_inv,
        q,
        q_step,
        q_pos,
        masked_lo,
        split_hi,
        split_hi,
        bt_row,
        kv_head,
        cache,
        scales,
        qk_scale,
        softcap_log2,
        window,
        dims,
        dim_valid,
        block_size,
        True,
        KV_SCALED,
        PIPELINED_SCALES,
        DOT_F16,
        PTX,
        BLOCK_N,
        USE_WINDOW,
        SOFTCAP,
        IEEE_DOT,
        ONE_TOKEN,
    )

    if KV_SCALED:
        acc = acc * v_unit
    if WRITE_PARTIALS:
        # Partials [T, Hq, S, D] and (max, sum) pairs [T, Hq, S, 2]; empty splits
        # write max=_NEG_BIG, sum=0 and so weigh nothing in the merge.
        part = (q_row * num_q_heads + head) * num_splits + split
        tl.store(
            part_acc_ptr + part[:, None] * head_dim + dims[None, :],
            acc,
            mask=row_valid[:, None] & dim_valid[None, :],
        )
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_valid)
    else:
        out = acc / tl.where(row_valid, l_i, 1.0)[:, None]  # padding rows: no 0/0
        tl.store(
            out_ptr + q_row[:, None] * o_stride_t + head[:, None] * o_stride_h + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    o_stride_t,
    o_stride_h,
    num_q_heads,
    num_splits,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_valid = splits < num_splits
    dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    part = (t * num_q_heads + h) * num_splits + splits
    m = tl.load(part_ml_ptr + part * 2, mask=split_valid, other=_NEG_BIG)
    sums = tl.load(part_ml_ptr + part * 2 + 1, mask=split_valid, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - m_max)
    denom = tl.sum(w * sums, axis=0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * head_dim + dims[None, :],
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], axis=0) / denom
    tl.store(out_ptr + t * o_stride_t + h * o_stride_h + dims, out.to(out_ptr.dtype.element_ty), mask=dim_valid)


def _choose_num_splits(work_units: int, max_context: int, device: torch.device, block_d: int, block_m: int) -> int:
    """Split until a decode grid holds ~2 programs an SM (a prompt's ~4), never past it.

    Every decode tile takes most of an SM's shared memory (one program at a time), and two of them
    an SM was the fastest split count, or within 3% of it, at every point measured where the batch
    leaves SMs idle and the context is long enough to split, where ~4 programs an SM had been the
    target (h200-2026-12-02/split-target-80fe5f8): Llama-3-8B's heads, 1 x 4,096 tokens 8.3 us at
    33 splits against 12.1 at 64, 8 x 1,024 12.6 at 4 against 16.7 at 8; Gemma-3-4B's (head dim 256),
    16 x 1,024 26.5 at 4 against 32.1 at 8, 32 x 1,024 45.4 at 2 against 48.8 at 4; head dim 512 in
    groups of 8, 16 x 4,096 80.3 at 8 against 86.4 at 16. Short contexts still split where one
    program a KV range would do (32 x 192 at head dim 256: 16.0 us at 2 splits against 10.1 at one):
    a graph fixes the split count for the longest context it serves.
    Rounded down: on the H200 a partial further wave cost more than the split saved
    (B=32, ctx 4096: 2 splits 135 us, 3 splits 160 us; see benchmarks/results).
    Never under ``_MIN_TOKENS_PER_SPLIT`` tokens a split at full block-table width.
    Head dims up to 128 split only while there are fewer programs than SMs: from one a SM, one
    program per KV range in a deeper tile (``_tile_config``) beat every split count at every
    context measured (Llama-3-8B's heads, 32-128 sequences over 192-8,192 tokens, e.g. 64 x 8k:
    551 us against 530-729 split; 32 x 192: 9.9 us against 15.5 at 2 splits, which also pay a
    merge kernel; benchmarks/results/h200-2026-12-01/attention-splits-315ca5f).
    So do prompt tiles (64 rows and more) at every head dim: each program already streams a long
    context, and the partials of thousands of tokens cost more to write and merge than the split
    saves (Gemma-3-4B, a 4,000-token prompt in two chunks of 125 and 61 tiles x 4 KV heads at head
    dim 256: 2 splits spent 8.0 ms in attention and 14.5 ms in the merge; h200-2026-12-01/prompt-splits-eaf9d1d).
    """
    if (block_d <= 128 or block_m >= 64) and work_units >= num_sms(device):
        return 1
    target = (_PROMPT_SPLIT_PROGRAMS_PER_SM if block_m >= 64 else _SPLIT_PROGRAMS_PER_SM) * num_sms(device)
    by_length = max(1, max_context // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(target // work_units, by_length, _MAX_SPLITS))


def _pipelined_scales(block_m: int, scale_dtype: torch.dtype | None) -> bool:
    """Whether a quantized cache's scales ride the K/V tiles' asynchronous copies (read in their
    tile's iteration) instead of being read a tile ahead into registers: four-byte scales only (two-byte
    ones are too narrow for those copies), in decode tiles (under 64 rows), where it took the loop from
    13 barriers an iteration to 9 (fp8 at 128 keys, sm_90 code). Prompt tiles read them a tile ahead:
    pipelined there, Llama-3-8B's 2,048-token prompt took 275 against 212 us over int8 and 288 against
    230 over fp8 (h200-2026-12-02/at-3d69e8b)."""
    return scale_dtype == torch.float32 and block_m < 64


def _mask_edges_only(block_m: int, kv_dtype: torch.dtype, num_splits: int) -> bool:
    """Whether a tile's keys that every row sees go through a loop without masks (three loops: the
    edge tiles masked, the middle not) instead of one masked loop over all of them.

    Prompt tiles (64 rows and more) always: their causal edge is a small part of their keys. Decode
    tiles only over a float8 cache and a KV range of its own (no splits), where the loop is bound by
    issuing instructions (each key converted to float16 on the way) and the masks' share of them
    pays: Llama-3-8B's heads, 64 x 8k over fp8 405.2 -> 374.1 us (floor 259.2). Everywhere else
    measured the single masked loop was faster: over fp8 with splits (16 x 4k 60.3 -> 66.0 us), int8
    (64 x 8k 377.7 -> 390.1), bf16 (1 x 8k 14.1 -> 20.4, 64 x 8k 488.9 -> 494.5;
    h200-2026-12-02/studies-cff1282). float8_e5m2 runs the same loop with another conversion opcode.
    """
    return block_m >= 64 or (kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and num_splits == 1)


def _block_rows(block_d: int, group: int, max_query_len: int, elem_bytes: int) -> int:
    """Rows of a program's query tile, (token, head) pairs: tl.dot needs at least 16. Decode packs just
    the group; longer queries take up to 128 rows at head dims up to 128 over a 16-bit cache (64
    otherwise) so one K/V tile serves more tokens. With the causal mask kept to a prompt's edge tiles,
    128 rows took Llama-3-8B's four 512-token chunks over 4k contexts in 471 us against 549 for 64
    rows, and a 2,048-token prompt in 187 against 187; over an int8 or float8 cache they lost (1,136
    against 922 us, the K/V converted for every 32 keys; h200-2026-12-01/prefill-rows-5813c17)."""
    most = 128 if block_d <= 128 and elem_bytes > 1 else 64
    return max(16, triton.next_power_of_2(group), min(most, triton.next_power_of_2(max_query_len * group)))


def _tile_config(
    block_d: int, block_m: int, elem_bytes: int, program_keys: int, num_splits: int
) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages, max_registers)`` for a head-dim tile ``block_d``,
    ``block_m`` query rows (``_block_rows``), K/V elements of ``elem_bytes``, at most ``program_keys``
    keys a program streams (its KV range) over ``num_splits`` ranges a sequence; ``max_registers``
    caps a thread's registers (0: the compiler's choice), which decides how many programs an SM holds.

    Each choice was the fastest tile of a sweep on the H200, or within 3% of it. Decode tiles (under 64
    rows) stream 128 keys at head dims up to 128, 64 at 256 and 32 at 512 (wider ones spill); prompt
    tiles take 32 keys (64 over a one-byte cache at head dims up to 128). K/V tiles are pipelined
    through shared memory: at 3 or 4 stages a program waits for its next tile's copies (one K/V
    buffer), while 5 stages add a second buffer so a tile's copies fly while the one before computes,
    which pays where a program streams at least four tiles (one-byte caches at head dims up to 128;
    16-bit caches, unsplit, at 256, in tiles of 32 keys). float32 (tests only) keeps 2 stages and
    halves the K/V tile until it fits ``_KV_SMEM_BUDGET``. The sweeps, their figures and why each
    choice: docs/PERFORMANCE.md, "Tuning: attention tiles".
    """
    if block_d <= 128:
        block_n, num_warps, num_stages = 64, 4, 2
        if block_m < 64:
            block_n, num_stages = 128, 3
            if elem_bytes == 1 and program_keys >= 4 * block_n:
                num_stages = 5
        elif block_m == 128:
            block_n, num_stages = 32, 3
    elif block_d <= 256:
        block_n, num_warps, num_stages = (64, 4, 2) if block_m < 64 else (32, 4, 3)
        if block_m < 64 and elem_bytes == 2 and num_splits == 1 and program_keys >= 4 * 32:
            block_n, num_stages = 32, 5
    else:
        block_n, num_warps, num_stages = (32, 4, 2) if block_m < 64 else (32, 8, 3)
    if elem_bytes > 2:
        num_stages = min(num_stages, 2)
    while 2 * num_stages * block_n * block_d * elem_bytes > _KV_SMEM_BUDGET and block_n > 16:
        block_n //= 2
    return block_m, block_n, num_warps, num_stages, 0


def query_tiles(batch: int, num_tokens: int, max_query_len: int, block_q: int) -> tuple[int, int, bool]:
    """The grid's first two dimensions for a batch, and whether its tiles are flat (``_flat_tile``): a
    ragged batch launches at most one tile more a sequence than its tokens fill, where giving every
    sequence the longest query's count launched (for a 1,024-token chunk beside 255 decode rows) 64
    programs a sequence that nearly all exit at once."""
    q_tiles = triton.cdiv(max_query_len, block_q)
    if batch > 1 and q_tiles > 1:
        return min(batch * q_tiles, triton.cdiv(num_tokens, block_q) + batch), 1, True
    return q_tiles, batch, False


def launch_plan(
    block_d: int,
    group: int,
    num_kv_heads: int,
    batch: int,
    num_tokens: int,
    max_query_len: int,
    max_context: int,
    elem_bytes: int,
    device: torch.device,
    num_splits: int | None = None,
) -> tuple[tuple[int, int, int, int, int], int, tuple[int, int, bool]]:
    """The tile (``_tile_config``), the KV split count (``num_splits`` forces it) and the query tiles
    (``query_tiles``) a launch takes."""
    block_m = _block_rows(block_d, group, max_query_len, elem_bytes)
    grid = query_tiles(batch, num_tokens, max_query_len, block_m // group)
    work_units = grid[0] * grid[1] * num_kv_heads
    if num_splits is None:
        num_splits = _choose_num_splits(work_units, max_context, device, block_d, block_m)
    tile = _tile_config(block_d, block_m, elem_bytes, triton.cdiv(max_context, num_splits), num_splits)
    return tile, num_splits, grid


def kv_splits(
    k_cache: torch.Tensor, num_q_heads: int, num_tokens: int, max_query_len: int, max_seq_len: int, batch: int = 1
) -> int:
    """The KV ranges a launch over ``k_cache`` splits each sequence's context into, for ``num_q_heads``
    query heads and these lengths (``paged_attention``'s choice when no split count is forced)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    return launch_plan(
        triton.next_power_of_2(head_dim),
        num_q_heads // num_kv_heads,
        num_kv_heads,
        batch,
        num_tokens,
        max_query_len,
        max_seq_len,
        k_cache.element_size(),
        k_cache.device,
    )[1]


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, Hq, D]`` over the paged cache; returns ``[T, Hq, D]``.

    Extras over the reference signature (keyword only):

    - ``max_query_len``: longest query of the batch. If None it is taken as 1 when
      ``T == B`` (a pure decode batch: the caller must not pass a ragged batch with
      ``T == B``), else read from ``query_start_loc`` on the host, which syncs and
      is not graph-capturable. Passing it makes every path graph-safe. Never under the longest
      query: at 1 the kernel masks keys by sequence alone, as a lone token's causal mask allows.
    - ``max_seq_len``: an upper bound of ``seq_lens`` known on the host (a CUDA graph's
      context bucket); the split count is chosen for it instead of the block-table width.
    - ``softcap``: as the reference's, ``tanh(s / cap) * cap`` of each scaled score before the mask.
    - ``k_scale``/``v_scale``: a quantized cache's scales ``[num_blocks, block_size, Hkv]``, as the
      reference's: each key's scale multiplies its scores, each value's its probability.
    - ``num_splits``: force the KV split count; default chosen from shapes (``kv_splits``).
    - ``out``: preallocated output (may be a strided view, last dim contiguous).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or batch == 0:
        return out
    for t in (query, k_cache, v_cache, out):
        if t.stride(-1) != 1:
            raise ValueError("paged_attention needs a contiguous last dimension")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("give both k and v scales (a quantized cache), or neither")
    if max_query_len is None:
        if num_tokens == batch:
            max_query_len = 1
        else:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())

    if num_splits is not None and not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {_MAX_SPLITS}], got {num_splits}")
    block_d = triton.next_power_of_2(head_dim)
    max_context = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
    (block_m, block_n, num_warps, num_stages, max_registers), num_splits, (tiles, seqs, flat) = launch_plan(
        block_d,
        group,
        num_kv_heads,
        batch,
        num_tokens,
        max_query_len,
        max_context,
        k_cache.element_size(),
        query.device,
        num_splits,
    )
    block_q = block_m // group
    write_partials = num_splits > 1
    if write_partials:
        part_acc = torch.empty(
            (num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty((num_tokens, num_q_heads, num_splits, 2), dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused by the kernel when WRITE_PARTIALS is off

    pdl = pdl_launch_args(query.device)
    # The GPU starts programs in the order of their grid index, the first dimension fastest: the
    # kernel reads it as a query tile's heads (and splits) together, a prompt's last tile first, and
    # sequences in the batch's order, which the engine gives longest first (``ModelRunner._flatten``),
    # so that no long program is left to start last and run on alone while the rest of the GPU idles.
    _paged_attention_kernel[(tiles, num_kv_heads * num_splits, seqs)](
        query,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_ml,
        query_start_loc,
        seq_lens,
        block_tables,
        float(scale) / float(softcap) if softcap is not None else float(scale) * _LOG2E,
        float(softcap) * _LOG2E if softcap is not None else 0.0,
        sliding_window if sliding_window is not None else 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_scale if k_scale is not None else out,  # unused by the kernel when KV_SCALED is off
        v_scale if v_scale is not None else out,
        *(k_scale.stride() if k_scale is not None else (0, 0, 0)),
        *(v_scale.stride() if v_scale is not None else (0, 0, 0)),
        block_tables.stride(0),
        num_q_heads,
        head_dim,
        block_size,
        num_splits,
        batch,
        KV_SCALED=k_scale is not None,
        PIPELINED_SCALES=_pipelined_scales(block_m, None if k_scale is None else k_scale.dtype),
        DOT_F16=k_cache.element_size() == 1 and query.dtype != torch.float32,
        PTX=ptx_conversions(),
        FLAT=flat,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        USE_WINDOW=sliding_window is not None,
        SOFTCAP=softcap is not None,
        WRITE_PARTIALS=write_partials,
        IEEE_DOT=query.dtype == torch.float32,
        MASK_EDGES_ONLY=_mask_edges_only(block_m, k_cache.dtype, num_splits),
        ONE_TOKEN=max_query_len == 1,
        num_warps=num_warps,
        num_stages=num_stages,
        **({"maxnreg": max_registers} if max_registers else {}),
        **pdl,
    )
    if write_partials:
        # A program merges at most 128 dims: [splits, 128] float32 is the most it holds.
        merge_d = min(block_d, 128)
        _merge_splits_kernel[(num_tokens, num_q_heads, triton.cdiv(head_dim, merge_d))](
            part_acc,
            part_ml,
            out,
            out.stride(0),
            out.stride(1),
            num_q_heads,
            num_splits,
            head_dim,
            BLOCK_S=_FEW_SPLITS if num_splits <= _FEW_SPLITS else _MAX_SPLITS,  # masked rows cost no reads
            BLOCK_D=merge_d,
            **pdl,
        )
    return out
