"""Decode attention as one stream of key tiles shared evenly by a fixed set of programs (stream-K).

The paged kernel (``triton_attention``) gives each program one KV head of one sequence. At the short
contexts of a busy server a program streams ten tiles or so, and every program pays fixed costs its
tiles do not hide: its start, its pipeline filling and draining, and the grid's last wave running on
part of the GPU. Over a one-byte cache, where a tile is half the bytes, those costs are a large part
of the step (int8, 85 sequences of 1,280 tokens: the kernel at 60% of its floor, against 94% at 8k
tokens a sequence).

Here every (KV head, sequence) pair's tiles are laid end to end, heads outermost, and each of
``programs`` programs (as many as the GPU holds at once) takes an equal run of them. A program walks
its run in one pipelined loop: where a run enters a new sequence the softmax state restarts, where a
sequence ends inside the run its output is written. A sequence cut between programs leaves partial
states (an unnormalised output, its running max and sum) that a second kernel merges.

Where each tile's keys lie is laid out once a step by a small kernel (``_plan_tiles_kernel``): each
tile's sequence and index in it, and its block-table entries copied in tile order, so that the main
loop's loads depend on one load each, as the paged kernel's do. Every length is read on the device:
the whole path can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_attention_tile import NEG_BIG, attend_tile, prepare_query, tile_scales
from tokenmill.kernels.triton_convert import ptx_conversions
from tokenmill.kernels.triton_launch import num_sms, pdl_launch_args, wait_for_previous_kernel

# A tile's sequence and its index in it share one int32 (``_SEQ_SHIFT`` bits for the index).
_SEQ_SHIFT = tl.constexpr(16)
_INDEX_MASK = tl.constexpr(2**16 - 1)
MAX_SEQS = 2**15
MAX_TILES_PER_SEQ = 2**16
# Sequences a planning program sums at a time.
_PLAN_CHUNK = tl.constexpr(128)


@triton.jit(do_not_specialize=["batch", "bt_width", "bt_stride"])
def _plan_tiles_kernel(seq_lens_ptr, block_tables_ptr, tile_info_ptr, tile_blocks_ptr, num_tiles_ptr, batch,
                       bt_width, bt_stride, block_size: tl.constexpr, BLOCK_N: tl.constexpr, COPY: tl.constexpr):
    """Sequence ``program_id`` lays out its tiles after those of the sequences before it: each tile's
    sequence and index (``tile_info``), its ``BLOCK_N // block_size`` block-table entries (``tile_blocks``);
    the last sequence writes the tile count."""
    seq = tl.program_id(0)
    before = 0
    for b0 in range(0, seq, _PLAN_CHUNK):
        bs = b0 + tl.arange(0, _PLAN_CHUNK)
        lens = tl.load(seq_lens_ptr + bs, mask=bs < seq, other=0)
        before += tl.sum((lens + BLOCK_N - 1) // BLOCK_N, axis=0)
    seq_len = tl.load(seq_lens_ptr + seq)
    tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    per_tile: tl.constexpr = BLOCK_N // block_size
    for c in range(0, tiles * per_tile, COPY):
        e = c + tl.arange(0, COPY)
        entry = tl.load(block_tables_ptr + seq.to(tl.int64) * bt_stride + e, mask=e < bt_width, other=0)
        tl.store(tile_blocks_ptr + before * per_tile + e, entry, mask=e < tiles * per_tile)
    for c in range(0, tiles, COPY):
        j = c + tl.arange(0, COPY)
        tl.store(tile_info_ptr + before + j, (seq << _SEQ_SHIFT) | j, mask=j < tiles)
    if seq == tl.num_programs(0) - 1:
        tl.store(num_tiles_ptr, before + tiles)


@triton.jit
def _prepare_queries_kernel(q_ptr, q_stride_t, q_stride_h, prepared_ptr, steps_ptr, num_q_heads,
                            head_dim: tl.constexpr, INT8_CACHE: tl.constexpr, DOT_F16: tl.constexpr,
                            PTX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``BLOCK_R * program_id(1)`` … of token ``program_id(0)``'s query heads as the dots take them
    (``prepare_query``), and over an int8 cache each row's step: the stream's loop reads them tile by tile
    where a query carried from one sequence of its run to the next took every register (sm_90 code: 255
    and spills, against 191)."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_D)
    valid = (heads < num_q_heads)[:, None] & (dims < head_dim)[None, :]
    q = tl.load(q_ptr + token * q_stride_t + heads[:, None] * q_stride_h + dims[None, :], mask=valid, other=0.0)
    q, step = prepare_query(q, INT8_CACHE, DOT_F16, PTX)
    row = token * num_q_heads + heads
    _store_rows(prepared_ptr, head_dim, row, dims, heads < num_q_heads, dims < head_dim, q)
    if INT8_CACHE:
        tl.store(steps_ptr + row, step, mask=heads < num_q_heads)


@triton.jit
def _store_rows(ptr, row_stride, rows, dims, row_valid, dim_valid, values):
    tl.store(ptr + rows[:, None] * row_stride + dims[None, :], values, mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def _stream_decode_kernel(
    q_ptr, q_steps_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, tile_info_ptr,
    tile_blocks_ptr, num_tiles_ptr, seq_lens_ptr, qk_scale, softcap_log2,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h,
    kc_stride_block, kc_stride_slot, kc_stride_head, vc_stride_block, vc_stride_slot, vc_stride_head,
    k_scale_ptr, v_scale_ptr, ks_stride_block, ks_stride_slot, ks_stride_head,
    vs_stride_block, vs_stride_slot, vs_stride_head,
    num_kv_heads, head_dim: tl.constexpr, block_size: tl.constexpr,
    KV_SCALED: tl.constexpr, DOT_F16: tl.constexpr, PTX: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
    IEEE_DOT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    seq_tiles = tl.load(num_tiles_ptr)  # tiles of every sequence, one KV head
    per_program = tl.cdiv(seq_tiles * num_kv_heads, tl.num_programs(0))
    t_lo = pid * per_program
    t_hi = tl.minimum(t_lo + per_program, seq_tiles * num_kv_heads)

    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    keys = tl.arange(0, BLOCK_N)
    entry = keys // block_size  # a key's block-table entry within its tile (every tile starts a block)
    slot = keys % block_size
    cache = (k_cache_ptr, kc_stride_block, kc_stride_slot, kc_stride_head,
             v_cache_ptr, vc_stride_block, vc_stride_slot, vc_stride_head)
    scales = (k_scale_ptr, ks_stride_block, ks_stride_slot, ks_stride_head,
              v_scale_ptr, vs_stride_block, vs_stride_slot, vs_stride_head)
    INT8_CACHE: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.int8

    # The state of the run's current sequence, restarted where a sequence starts.
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # (unused: decode tiles sum by key column)
    l_cols = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    v_unit = 1.0
    first_index = 0  # the index in its sequence of the run's first tile of the current one
    for t in range(t_lo, t_hi):
        kv_head = t // seq_tiles
        u = t - kv_head * seq_tiles
        info = tl.load(tile_info_ptr + u)
        seq = info >> _SEQ_SHIFT
        index = info & _INDEX_MASK
        seq_len = tl.load(seq_lens_ptr + seq)
        n = index * BLOCK_N + keys
        n_valid = n < seq_len
        block = tl.load(tile_blocks_ptr + u * (BLOCK_N // block_size) + entry).to(tl.int64)
        head = kv_head * GROUP + rows
        q_row = seq.to(tl.int64)
        # The query as the dots take it (``_prepare_queries_kernel``), read with the tile.
        q = tl.load(q_ptr + q_row * q_stride_t + head[:, None] * q_stride_h + dims[None, :],
                    mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
        q_step = tl.zeros([BLOCK_M], dtype=tl.float32)
        if INT8_CACHE:
            q_step = tl.load(q_steps_ptr + q_row * (num_kv_heads * GROUP) + head, mask=row_valid, other=0.0)
        if KV_SCALED:
            ks, vs = tile_scales(scales, block, 0, seq_len - index * BLOCK_N, kv_head, block_size, BLOCK_N,
                                 (entry, slot), True)
        else:  # (unused)
            ks = v_unit
            vs = v_unit
        if (t == t_lo) | (index == 0):
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
            l_cols = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            first_index = index
            if KV_SCALED:
                # acc's unit: the largest value scale of the sequence's first tile in this run, as the
                # paged kernel takes its range's (1 where those values are all zero).
                v_unit = tl.max(vs, axis=0)
                v_unit = tl.where(v_unit > 0.0, v_unit, 1.0)
        acc, m_i, l_i, l_cols = attend_tile(acc, m_i, l_i, l_cols, 1.0 / v_unit, q, q_step, m_i, n, n_valid, block,
                                            slot, ks, vs, kv_head, cache, qk_scale, softcap_log2, 0, dims, dim_valid,
                                            True, KV_SCALED, DOT_F16, PTX, False, SOFTCAP, IEEE_DOT, True, True)
        ends = (index + 1) * BLOCK_N >= seq_len  # the sequence's last tile
        if (t == t_hi - 1) | ends:
            l_run = tl.sum(l_cols, axis=1)
            acc_run = acc
            if KV_SCALED:
                acc_run = acc * v_unit
            if (first_index == 0) & ends:  # the whole sequence: its output
                out = acc_run / tl.where(row_valid, l_run, 1.0)[:, None]
                _store_rows(out_ptr + q_row * o_stride_t, o_stride_h, head, dims, row_valid, dim_valid,
                            out.to(out_ptr.dtype.element_ty))
            else:  # cut: a partial state, the first of the run's (0) where it began before the run, else 1
                part = (pid * 2 + (first_index == 0).to(tl.int32)) * GROUP + rows
                _store_rows(part_acc_ptr, head_dim, part, dims, row_valid, dim_valid, acc_run)
                tl.store(part_ml_ptr + part * 2, m_i, mask=row_valid)
                tl.store(part_ml_ptr + part * 2 + 1, l_run, mask=row_valid)


@triton.jit
def _merge_runs_kernel(part_acc_ptr, part_ml_ptr, out_ptr, tile_info_ptr, num_tiles_ptr, seq_lens_ptr, o_stride_t,
                       o_stride_h, num_kv_heads, head_dim: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Program ``b`` merges the sequence cut between programs ``b`` and ``b + 1``, where it began in ``b``
    (a sequence cut several times is merged once, by the program where it began)."""
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0)
    programs = tl.num_programs(0)
    seq_tiles = tl.load(num_tiles_ptr)
    total = seq_tiles * num_kv_heads
    per_program = tl.cdiv(total, programs)
    t = (b + 1) * per_program  # the next program's first tile
    if t >= total:
        return
    kv_head = t // seq_tiles
    info = tl.load(tile_info_ptr + t - kv_head * seq_tiles)
    index = info & _INDEX_MASK
    if (index == 0) | (t - index < b * per_program):
        return
    seq = info >> _SEQ_SHIFT
    last = (t - index + tl.cdiv(tl.load(seq_lens_ptr + seq), BLOCK_N) - 1) // per_program
    rows = tl.arange(0, BLOCK_G)
    row_valid = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    part = (b * 2 + 1) * GROUP + rows
    m = tl.load(part_ml_ptr + part * 2, mask=row_valid, other=0.0)
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=row_valid, other=1.0)
    acc = tl.load(part_acc_ptr + part[:, None] * head_dim + dims[None, :],
                  mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    for p in range(b + 1, last + 1):
        part = p * 2 * GROUP + rows
        m_p = tl.load(part_ml_ptr + part * 2, mask=row_valid, other=0.0)
        l_p = tl.load(part_ml_ptr + part * 2 + 1, mask=row_valid, other=0.0)
        acc_p = tl.load(part_acc_ptr + part[:, None] * head_dim + dims[None, :],
                        mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
        m_new = tl.maximum(m, m_p)
        w, w_p = tl.exp2(m - m_new), tl.exp2(m_p - m_new)
        acc = acc * w[:, None] + acc_p * w_p[:, None]
        l = l * w + l_p * w_p
        m = m_new
    _store_rows(out_ptr + seq.to(tl.int64) * o_stride_t, o_stride_h, kv_head * GROUP + rows, dims, row_valid,
                dim_valid, (acc / l[:, None]).to(out_ptr.dtype.element_ty))


def stream_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            seq_lens: torch.Tensor, block_tables: torch.Tensor, qk_scale: float,
                            softcap_log2: float, max_context: int, tile: tuple[int, int, int, int],
                            k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, out: torch.Tensor,
                            programs: int | None = None) -> torch.Tensor:
    """One query token a sequence (``query`` ``[B, Hq, D]``) over its whole context, no window, through
    ``programs`` programs (default: two an SM, as many as the paged kernel's decode tile lets an SM hold).
    ``qk_scale``/``softcap_log2`` as the paged kernel takes them; ``tile``: its ``(BLOCK_M, BLOCK_N,
    num_warps, num_stages)``; ``max_context``: an upper bound of ``seq_lens`` known on the host."""
    batch, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = tile
    if block_n % block_size or batch > MAX_SEQS or triton.cdiv(max_context, block_n) > MAX_TILES_PER_SEQ:
        raise ValueError(f"stream decode takes tiles of whole blocks ({block_n} keys over blocks of {block_size}), "
                         f"at most {MAX_SEQS} sequences of {MAX_TILES_PER_SEQ} tiles")
    if programs is None:
        programs = 2 * num_sms(query.device)
    device = query.device
    max_tiles = batch * triton.cdiv(max_context, block_n)
    tile_info = torch.empty(max_tiles, dtype=torch.int32, device=device)
    tile_blocks = torch.empty(max_tiles * (block_n // block_size), dtype=torch.int32, device=device)
    num_tiles = torch.empty(1, dtype=torch.int32, device=device)
    part_acc = torch.empty((programs, 2, group, head_dim), dtype=torch.float32, device=device)
    part_ml = torch.empty((programs, 2, group, 2), dtype=torch.float32, device=device)
    int8_cache = k_cache.dtype == torch.int8
    dot_f16 = k_cache.element_size() == 1 and query.dtype != torch.float32
    block_d = triton.next_power_of_2(head_dim)
    pdl = pdl_launch_args(device)
    _plan_tiles_kernel[(batch,)](seq_lens, block_tables, tile_info, tile_blocks, num_tiles, batch,
                                 block_tables.shape[1], block_tables.stride(0), block_size, block_n, COPY=128)
    prepared, steps = query, out  # (steps: read over an int8 cache alone)
    if int8_cache or dot_f16:
        prepared = torch.empty(query.shape, dtype=torch.int8 if int8_cache else torch.float16, device=device)
        steps = torch.empty((batch, num_q_heads), dtype=torch.float32, device=device)
        rows = min(triton.next_power_of_2(num_q_heads), 16)
        _prepare_queries_kernel[(batch, triton.cdiv(num_q_heads, rows))](
            query, query.stride(0), query.stride(1), prepared, steps, num_q_heads, head_dim, int8_cache, dot_f16,
            ptx_conversions(), rows, block_d)
    _stream_decode_kernel[(programs,)](
        prepared, steps, k_cache, v_cache, out, part_acc, part_ml, tile_info, tile_blocks, num_tiles, seq_lens,
        qk_scale, softcap_log2, prepared.stride(0), prepared.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        k_scale if k_scale is not None else out, v_scale if v_scale is not None else out,
        *(k_scale.stride() if k_scale is not None else (0, 0, 0)),
        *(v_scale.stride() if v_scale is not None else (0, 0, 0)),
        num_kv_heads, head_dim, block_size,
        KV_SCALED=k_scale is not None, DOT_F16=dot_f16, PTX=ptx_conversions(), GROUP=group, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=block_d, SOFTCAP=softcap_log2 != 0.0, IEEE_DOT=query.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )
    _merge_runs_kernel[(programs,)](part_acc, part_ml, out, tile_info, num_tiles, seq_lens, out.stride(0),
                                    out.stride(1), num_kv_heads, head_dim, group, triton.next_power_of_2(group),
                                    block_n, block_d, **pdl)
    return out
