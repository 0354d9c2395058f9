"""Kernel-vs-reference checks shared by the interpreter and the GPU tests.

Each ``check_*`` draws fresh random inputs (the seed is in every failure message),
runs the Triton kernel and the torch reference, and asserts agreement. Run as a
script (``python _kernel_cases.py <kernel>``) it executes the small interpreter
cases for one kernel; the caller sets ``TRITON_INTERPRET=1`` in its environment,
which must happen before triton is first imported.
"""

from __future__ import annotations

import itertools
import os
import random
import sys

import torch

from tokenmill.kernels import fp8, q8_0, reference
from tokenmill.layers.sampler import inverse_temperature, largest_logits
from tokenmill.loader.kv_layout import kv_scale_dtype

try:
    import triton
    import triton.language as tl

    from tokenmill.kernels.triton_activation import tanh
except ImportError:  # the checks need triton; importing this module does not
    triton = None

# Relative error ‖out − ref‖ / ‖ref‖ allowed per input dtype. bf16/fp16 attention
# rounds P to the input dtype before the PV product; fp32 uses IEEE dots.
ATTN_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# Elementwise kernels replicate the reference's roundings: differences are a few ulps.
ELEMWISE_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
Q8_FP16_TOL = 6e-3
# A gated GEMV in float16 rounds three times in a row (the gate, its activation, the product), as the
# reference does; where the two float32 sums straddle a rounding point (their order differs), each
# rounding can land an ulp (2^-11) apart and the next carries it on: up to ~1.5e-3 of an output, and
# over 13 outputs a relative error of 1.4e-3 was seen (seed 2265102476), about 1 run in 500.
GATED_FP16_TOL = 3e-3
# The attention kernel's float32 tanh (softcapping), against float64: absolute error anywhere
# (it cancels to a few ulps of 1 near 0), relative error from |x| = 0.5 on.
TANH_ABS_TOL, TANH_REL_TOL = 5e-7, 1e-6


def fresh_generator(device: str) -> tuple[torch.Generator, int]:
    """A generator seeded from the OS, so every run checks new inputs; the seed is reported."""
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen, seed


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    return (torch.linalg.vector_norm(out64 - ref64) / torch.linalg.vector_norm(ref64)).item()


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def check_paged_attention(
    ops,
    specs: list[tuple[int, int]],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    pass_max_query_len: bool = True,
    softcap: float | None = None,
    scale: float | None = None,
) -> float:
    """``specs`` lists (query length, context length incl. the query) per sequence.

    Block 0 of the cache is never written and stays NaN, as do the unused tails of
    the last blocks and the padding columns of the block table (which point at
    block 0): any read outside a sequence's context turns the output NaN.
    """
    gen, seed = fresh_generator(device)
    batch = len(specs)
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in specs]
    num_blocks = 1 + sum(blocks_per_seq) + 3
    width = max(blocks_per_seq) + 2
    perm = (torch.randperm(num_blocks - 1, generator=gen, device=device) + 1).to(torch.int32)
    block_tables = torch.zeros((batch, width), dtype=torch.int32, device=device)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    used = 0
    for b, (_, ctx) in enumerate(specs):
        nb = blocks_per_seq[b]
        block_tables[b, :nb] = perm[used : used + nb]
        used += nb
        pos = torch.arange(ctx, device=device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        reference.write_kv_cache(
            _randn((ctx, num_kv_heads, head_dim), dtype, device, gen),
            _randn((ctx, num_kv_heads, head_dim), dtype, device, gen),
            k_cache,
            v_cache,
            slots,
        )
    q_lens = torch.tensor([q for q, _ in specs], dtype=torch.int32, device=device)
    query_start_loc = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    seq_lens = torch.tensor([ctx for _, ctx in specs], dtype=torch.int32, device=device)
    num_tokens = int(q_lens.sum())
    # The query is a strided view into a fused qkv buffer, as the model produces it.
    qkv = _randn((num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim), dtype, device, gen)
    query = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    scale = head_dim**-0.5 if scale is None else scale

    ref = reference.paged_attention(
        query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window, softcap=softcap
    )
    out = torch.full_like(query, float("nan"))
    got = ops.paged_attention(
        query,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        sliding_window,
        max_query_len=max(q for q, _ in specs) if pass_max_query_len else None,
        softcap=softcap,
        num_splits=num_splits,
        out=out,
    )
    where = (f"seed={seed} specs={specs} Hq={num_q_heads} Hkv={num_kv_heads} D={head_dim} {dtype} "
             f"window={sliding_window} splits={num_splits} softcap={softcap} scale={scale}")
    assert got is out, where
    assert torch.isfinite(out).all(), f"unwritten or poisoned output rows: {where}"
    err = rel_err(out, ref)
    assert err < ATTN_TOL[dtype], f"rel err {err:.2e}: {where}"
    if num_splits is not None and num_splits > 1:
        # Partials are scratch of this launch alone: a second launch merges exactly as the first.
        again = ops.paged_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                    sliding_window, max_query_len=max(q for q, _ in specs), softcap=softcap,
                                    num_splits=num_splits)
        assert torch.equal(again, out), f"a second launch differs: {where}"
    return err


def norm_weight(shape: tuple[int, ...], weighting: str, dtype: torch.dtype, device: str,
                gen: torch.Generator) -> torch.Tensor:
    """Random norm weights: around 1 (Llama's, Gemma 4's), or around 0 with some near -1 for Gemma 3's
    ``1 + w``, so the weight is far from the identity and sometimes near 0."""
    center, spread = (0.0, 0.5) if weighting == "offset" else (1.0, 0.2)
    return (center + spread * _randn(shape, torch.float32, device, gen)).to(dtype)


def check_rms_norm(
    ops,
    *,
    num_tokens: int,
    hidden: int,
    dtype: torch.dtype,
    device: str,
    with_residual: bool,
    weight_dtype: torch.dtype | None = None,
    offset: bool = False,
) -> None:
    """``rms_norm``, or with ``offset`` Gemma's ``offset_rms_norm`` (weights then spread around 0,
    some near -1, so ``1 + w`` is far from 1 and sometimes near 0)."""
    gen, seed = fresh_generator(device)
    x = _randn((num_tokens, hidden), dtype, device, gen)
    spread = 0.5 if offset else 0.1
    weight = ((0.0 if offset else 1.0) + spread * _randn((hidden,), torch.float32, device, gen)).to(weight_dtype or dtype)
    residual = _randn((num_tokens, hidden), dtype, device, gen) if with_residual else None
    x_before = x.clone()
    res_before = residual.clone() if residual is not None else None
    name = "offset_rms_norm" if offset else "rms_norm"
    ref = getattr(reference, name)(x, weight, 1e-6, residual)
    got = getattr(ops, name)(x, weight, 1e-6, residual)
    where = f"seed={seed} {name} T={num_tokens} H={hidden} {dtype} weight={weight.dtype} residual={with_residual}"
    assert torch.equal(x, x_before), f"input modified: {where}"
    if residual is not None:
        assert torch.equal(residual, res_before), f"residual modified: {where}"
        assert isinstance(got, tuple) and len(got) == 2, where
        (out, new_res), (ref_out, ref_res) = got, ref
        assert new_res.dtype == ref_res.dtype and torch.equal(new_res, ref_res), f"residual sum: {where}"
    else:
        out, ref_out = got, ref
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape, where
    err = rel_err(out, ref_out)
    # The normed row is rounded to the input's dtype before a float32 weight multiplies it: where the
    # two statistics differ in their last bit, an element can round an ulp of that dtype apart.
    assert err < max(ELEMWISE_TOL[ref_out.dtype], ELEMWISE_TOL[dtype]), f"rel err {err:.2e}: {where}"


def check_rope_write_kv(
    ops,
    *,
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    num_blocks: int = 64,
    dtype: torch.dtype,
    device: str,
    cache_dtype: torch.dtype | None = None,
    max_positions: int = 4096,
    qk_norm: bool | str = False,
    v_norm: bool = False,
) -> None:
    """q/k/v are strided views into one fused qkv buffer; q is rotated in place; unique random
    slots, a quarter of them padding (-1), take the rotated k and v; nothing else changes.
    ``qk_norm``: per-head RMSNorm of q and k first (Qwen3), with random weights; a weighting name
    (``"offset"``, ``"fp32"``): Gemma 3's or Gemma 4's. ``v_norm``: v heads normed too, weightless
    (Gemma 4)."""
    gen, seed = fresh_generator(device)
    cache_dtype = cache_dtype or dtype
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    cos_sin = reference.rotary_cos_sin(inv_freq, max_positions)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]
    pad = torch.rand(num_tokens, generator=gen, device=device) < 0.25
    slot_mapping = torch.where(pad, -1, slots).to(torch.int64)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = _randn((num_tokens, q_size + 2 * kv_size + 8), dtype, device, gen)
    q = qkv[:, :q_size].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:q_size + 2 * kv_size].view(num_tokens, num_kv_heads, head_dim)
    k_cache = _randn((num_blocks, block_size, num_kv_heads, head_dim), cache_dtype, device, gen)
    v_cache = _randn((num_blocks, block_size, num_kv_heads, head_dim), cache_dtype, device, gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    norms = {}
    if qk_norm:
        weighting = "llama" if qk_norm is True else qk_norm
        norms = {name: norm_weight((head_dim,), weighting, dtype, device, gen)
                 for name in ("q_norm_weight", "k_norm_weight")}
        norms["norm_weighting"] = weighting
    norms["v_norm"] = v_norm
    ref_q = reference.rotary_embedding_and_write_kv(positions, q.clone(), k.clone(), v.clone(), cos_sin, k_ref,
                                                    v_ref, slot_mapping, eps=1e-6, **norms)
    kv_before = qkv[:, q_size:].clone()
    got_q = ops.rotary_embedding_and_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slot_mapping, eps=1e-6,
                                              **norms)
    where = (f"seed={seed} T={num_tokens} Hq={num_q_heads} Hkv={num_kv_heads} D={head_dim} bs={block_size} "
             f"{dtype}->{cache_dtype} qk_norm={qk_norm} v_norm={v_norm}")
    assert got_q.data_ptr() == q.data_ptr(), f"q not rotated in place: {where}"
    assert torch.equal(qkv[:, q_size:], kv_before), f"k/v inputs modified: {where}"
    err = rel_err(got_q, ref_q)
    assert err < ELEMWISE_TOL[dtype], f"q rel err {err:.2e}: {where}"
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    written[slot_mapping[slot_mapping >= 0]] = True
    written = written.view(num_blocks, block_size)
    assert torch.equal(k_cache[~written], k_ref[~written]), f"k cache changed outside the slots: {where}"
    if v_norm:  # normed by the kernel's statistic, as close as the k norm is
        assert torch.equal(v_cache[~written], v_ref[~written]), f"v cache changed outside the slots: {where}"
    else:
        assert torch.equal(v_cache, v_ref), f"v cache: {where}"
    if written.any():
        for name, got, ref in (("k", k_cache, k_ref), ("v", v_cache, v_ref)):
            err = rel_err(got[written], ref[written])
            assert err < ELEMWISE_TOL[cache_dtype], f"cached {name} rel err {err:.2e}: {where}"


def _quantized_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype,
                     device: str) -> tuple[torch.Tensor, ...]:
    """Zeroed quantized K and V caches and their scales, in the engine's dtype for the head dim."""
    shape = (num_blocks, block_size, num_kv_heads)
    scale_dtype = kv_scale_dtype(head_dim)
    return (torch.zeros(*shape, head_dim, dtype=cache_dtype, device=device),
            torch.zeros(*shape, head_dim, dtype=cache_dtype, device=device),
            torch.zeros(shape, dtype=scale_dtype, device=device), torch.zeros(shape, dtype=scale_dtype, device=device))


def check_quantized_kv_write(ops, *, num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                             cache_dtype: torch.dtype, device: str, static: bool = False) -> None:
    """RoPE + the KV write into a quantized cache (int8, float8) against ``reference.write_kv_cache``
    quantizing the same rotated key: the same scales, and the same values up to one unit in the last
    place (an int8 tie, which the reference rounds to even). The rotation itself is the RoPE test's:
    on the GPU a rotated element may differ from the reference's by a rounding, which would move a
    head's scale. ``static``: a checkpoint's largest magnitudes of K and V (below some values, which
    are clipped)."""
    gen, seed = fresh_generator(device)
    num_blocks, block_size = 8, 16
    cos_sin = reference.rotary_cos_sin(1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device) / head_dim)), 64)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]
    slot_mapping = torch.where(torch.rand(num_tokens, generator=gen, device=device) < 0.25, -1, slots).to(torch.int64)
    q = _randn((num_tokens, 2 * num_kv_heads, head_dim), dtype, device, gen)
    k = _randn((num_tokens, num_kv_heads, head_dim), dtype, device, gen) * 3
    v = _randn((num_tokens, num_kv_heads, head_dim), dtype, device, gen)
    kv_amax = torch.tensor([6.0, 1.5], device=device) if static else None
    where = f"seed={seed} T={num_tokens} Hkv={num_kv_heads} D={head_dim} {dtype}->{cache_dtype} static={static}"
    # The kernel's rotated key, from a write to a full-precision cache.
    plain_k = torch.zeros(num_blocks * block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    plain_v = torch.zeros_like(plain_k)
    ops.rotary_embedding_and_write_kv(positions, q.clone(), k, v, cos_sin, plain_k.view(num_blocks, block_size, -1, head_dim),
                                      plain_v.view(num_blocks, block_size, -1, head_dim), slot_mapping)
    rotated_k = plain_k[slot_mapping.clamp(min=0)]  # padding rows are not written either way
    _, ref_rotated_k = reference.rotary_embedding(positions, q, k, cos_sin)
    live = slot_mapping >= 0
    if live.any():
        assert rel_err(rotated_k[live], ref_rotated_k[live]) < ELEMWISE_TOL[dtype], f"rotated k: {where}"
    ref = _quantized_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device)
    got = _quantized_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device)
    reference.write_kv_cache(rotated_k, v, ref[0], ref[1], slot_mapping, k_scale=ref[2], v_scale=ref[3], kv_amax=kv_amax)
    ops.rotary_embedding_and_write_kv(positions, q, k, v, cos_sin, got[0], got[1], slot_mapping,
                                      k_scale=got[2], v_scale=got[3], kv_amax=kv_amax)
    for name, (values, scales), (ref_values, ref_scales) in (("k", got[::2], ref[::2]), ("v", got[1::2], ref[1::2])):
        assert torch.equal(scales, ref_scales), f"{name} scales: {where}"
        got_q, ref_q = values.float(), ref_values.float()
        assert ((got_q - ref_q).abs() <= _unit_in_last_place(ref_q, cache_dtype)).all(), f"{name} values: {where}"


def _unit_in_last_place(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """At most the spacing of ``cache_dtype``'s values around ``x`` (float32 values of that dtype)."""
    if cache_dtype == torch.int8:
        return torch.ones_like(x)
    mantissa_bits = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[cache_dtype]
    smallest_step = torch.finfo(cache_dtype).smallest_normal * 2.0**-mantissa_bits
    return torch.clamp(x.abs() * 2.0**-mantissa_bits, min=smallest_step)


def check_quantized_attention(ops, *, specs: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int,
                              head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype, device: str,
                              sliding_window: int | None = None, num_splits: int | None = None,
                              value_magnitude: float = 1.0, value_decades: float = 0.0, zero_values: int = 0,
                              block_size: int = 16, softcap: float | None = None) -> None:
    """Attention over a quantized cache against the reference reading the same bytes and scales; values
    of ``value_magnitude`` (small ones: scales far below one), each token's scaled by up to
    ``value_decades`` powers of ten either way, the first ``zero_values`` of each sequence zero."""
    gen, seed = fresh_generator(device)
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in specs]
    num_blocks = sum(blocks_per_seq) + 1
    k_cache, v_cache, k_scale, v_scale = _quantized_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype,
                                                          device)
    tables = torch.zeros((len(specs), max(blocks_per_seq)), dtype=torch.int32, device=device)
    first = 1
    for b, (_, ctx) in enumerate(specs):
        tables[b, :blocks_per_seq[b]] = torch.arange(first, first + blocks_per_seq[b], device=device)
        first += blocks_per_seq[b]
        pos = torch.arange(ctx, device=device)
        slots = tables[b, pos // block_size].long() * block_size + pos % block_size
        decades = (torch.rand(ctx, 1, 1, generator=gen, device=device) * 2 - 1) * value_decades
        values = _randn((ctx, num_kv_heads, head_dim), dtype, device, gen) * value_magnitude * 10.0**decades
        values[:zero_values] = 0
        reference.write_kv_cache(_randn((ctx, num_kv_heads, head_dim), dtype, device, gen) * 2, values.to(dtype),
                                 k_cache, v_cache, slots, k_scale, v_scale)
    q_lens = [q for q, _ in specs]
    query_start_loc = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=device)
    seq_lens = torch.tensor([ctx for _, ctx in specs], dtype=torch.int32, device=device)
    query = _randn((sum(q_lens), num_q_heads, head_dim), dtype, device, gen)
    args = (query, k_cache, v_cache, query_start_loc, seq_lens, tables, head_dim**-0.5, sliding_window)
    ref = reference.paged_attention(*args, k_scale=k_scale, v_scale=v_scale, softcap=softcap)
    got = ops.paged_attention(*args, max_query_len=max(q_lens), k_scale=k_scale, v_scale=v_scale,
                              num_splits=num_splits, softcap=softcap)
    where = (f"seed={seed} specs={specs} Hq={num_q_heads} Hkv={num_kv_heads} D={head_dim} {dtype} {cache_dtype} "
             f"softcap={softcap}")
    err = rel_err(got, ref)
    assert err < ATTN_TOL[dtype], f"rel err {err:.2e}: {where}"


def _interpret_quantized_kv(ops) -> None:
    """int8 only: the interpreter's float8 conversions are not the GPU's (a value of 128 came back
    as 64), so float8 caches are checked on the GPU (test_triton_gpu.py)."""
    for dtype in (torch.float16, torch.float32):
        for static in (False, True):
            check_quantized_kv_write(ops, num_tokens=9, num_kv_heads=3, head_dim=64, dtype=dtype,
                                     cache_dtype=torch.int8, device="cpu", static=static)
        check_quantized_attention(ops, specs=[(1, 40), (5, 33), (1, 7)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                                  dtype=dtype, cache_dtype=torch.int8, device="cpu")
    check_quantized_attention(ops, specs=[(1, 90)], num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                              cache_dtype=torch.int8, device="cpu", sliding_window=40, num_splits=3)
    # Several K/V tiles a program (the scales are read a tile ahead, their blocks two): whole contexts,
    # a chunk, and a window whose first tile starts mid-block.
    check_quantized_attention(ops, specs=[(1, 200), (6, 150), (1, 65)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                              dtype=torch.float16, cache_dtype=torch.int8, device="cpu", num_splits=1)
    check_quantized_attention(ops, specs=[(1, 230)], num_q_heads=4, num_kv_heads=1, head_dim=64, dtype=torch.float32,
                              cache_dtype=torch.int8, device="cpu", sliding_window=101, num_splits=1)
    # Head dim 128: float32 scales, read in their tile's own iteration (decode tiles of 128 keys, split
    # and whole, a window, and a prompt's tiles).
    check_quantized_attention(ops, specs=[(1, 300), (1, 45), (20, 160)], num_q_heads=4, num_kv_heads=1,
                              head_dim=128, dtype=torch.float16, cache_dtype=torch.int8, device="cpu", num_splits=1)
    check_quantized_attention(ops, specs=[(1, 200), (1, 17)], num_q_heads=8, num_kv_heads=2, head_dim=128,
                              dtype=torch.float32, cache_dtype=torch.int8, device="cpu", sliding_window=70, num_splits=3)
    # A prompt's tiles with the scales read in their own tile's iteration, as decode tiles read them
    # (``_pipelined_scales``; only benchmarks/studies/study_attention_tiles.py --pipelined-scales takes it there).
    from tokenmill.kernels import triton_attention

    rule = triton_attention._pipelined_scales
    triton_attention._pipelined_scales = lambda block_m, scale_dtype: scale_dtype == torch.float32
    try:
        check_quantized_attention(ops, specs=[(20, 160), (40, 90), (1, 70)], num_q_heads=4, num_kv_heads=1,
                                  head_dim=128, dtype=torch.float16, cache_dtype=torch.int8, device="cpu",
                                  num_splits=1)
    finally:
        triton_attention._pipelined_scales = rule
    # Blocks of 256 tokens, past the 128-key decode tile, and of 8 (a 64-row prompt tile's 32 keys span four).
    check_quantized_attention(ops, specs=[(1, 300), (20, 160)], num_q_heads=4, num_kv_heads=1, head_dim=128,
                              dtype=torch.float16, cache_dtype=torch.int8, device="cpu", num_splits=1, block_size=256)
    check_quantized_attention(ops, specs=[(1, 100), (40, 90)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                              dtype=torch.float16, cache_dtype=torch.int8, device="cpu", sliding_window=37,
                              block_size=8)
    # Value scales over six decades, and a first tile of zero values (no unit to weigh the others by).
    for splits in (1, 3):
        check_quantized_attention(ops, specs=[(1, 300), (4, 200)], num_q_heads=4, num_kv_heads=1, head_dim=128,
                                  dtype=torch.float16, cache_dtype=torch.int8, device="cpu", num_splits=splits,
                                  value_decades=3.0, zero_values=130)
    # Gemma's head dims (two-byte scales, read a tile ahead): 256 with a window, 512 with GQA 8.
    check_quantized_attention(ops, specs=[(1, 150), (6, 70)], num_q_heads=4, num_kv_heads=2, head_dim=256,
                              dtype=torch.float16, cache_dtype=torch.int8, device="cpu", sliding_window=64)
    check_quantized_attention(ops, specs=[(1, 90), (3, 40)], num_q_heads=8, num_kv_heads=1, head_dim=512,
                              dtype=torch.float32, cache_dtype=torch.int8, device="cpu", num_splits=1)
    # Capped scores (Gemma 2's attention softcap): an int8 query's row steps applied before the cap.
    check_quantized_attention(ops, specs=[(1, 200), (5, 90)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                              dtype=torch.float32, cache_dtype=torch.int8, device="cpu", num_splits=1, softcap=5.0)
    # Head dim 16: the int8 query's scores in float16 dots (integer dots take 32 dims and more).
    check_quantized_attention(ops, specs=[(1, 70), (20, 40)], num_q_heads=4, num_kv_heads=2, head_dim=16,
                              dtype=torch.float16, cache_dtype=torch.int8, device="cpu", num_splits=1)


if triton is not None:
    @triton.jit
    def _tanh_probe_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tanh(tl.load(x_ptr + offs, mask=mask, other=0.0)), mask=mask)


def check_softcap_tanh(device: str) -> None:
    """The softcap's tanh in float32 over ±[1e-30, 1e4] (log-spaced), a dense ±12 and 0, ±inf."""
    mag = torch.logspace(-30, 4, 4001, dtype=torch.float64)
    dense = torch.linspace(-12, 12, 9601, dtype=torch.float64)
    x = torch.cat([mag, -mag, dense, torch.tensor([0.0, float("inf"), -float("inf")], dtype=torch.float64)])
    x = x.float().to(device)
    y = torch.full_like(x, float("nan"))
    _tanh_probe_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    ref = torch.tanh(x.double())
    err = (y.double() - ref).abs()
    assert torch.isfinite(y).all(), "tanh not finite"
    assert err.max().item() < TANH_ABS_TOL, f"tanh abs err {err.max().item():.2e} at x={x[err.argmax()].item()}"
    big = x.abs() >= 0.5
    rel = (err[big] / ref[big].abs()).max().item()
    assert rel < TANH_REL_TOL, f"tanh rel err {rel:.2e} for |x| >= 0.5"
    assert (y * x >= 0).all(), "tanh has the wrong sign"


def check_softcap(ops, *, rows: int, d: int, dtype: torch.dtype, device: str, cap: float = 30.0) -> None:
    """The final-logit softcap in place: logits N(0, 10) with every eleventh N(0, 300) (deep in tanh's
    flat tails), ±inf and 0 in the first row. 16-bit results against the reference's three in-place
    ops on a copy, both rounding to the dtype after each step: equal but where tanh's last float32
    ulps cross a rounding of the dtype. float32 results against the float64 truth, within a few
    ulps (torch's float32 tanh on the CPU, run after the interpreter in one process, was once off
    by 2e-3 on part of a tensor that it got right when run again)."""
    gen, seed = fresh_generator(device)
    x = _randn((rows, d), dtype, device, gen) * 10
    x[:, ::11] *= 30
    x[0, :3] = torch.tensor([float("inf"), -float("inf"), 0.0], dtype=dtype)
    inputs = x.clone()
    ref = (torch.tanh(inputs.double() / cap) * cap if dtype == torch.float32
           else reference.softcap_(x.clone(), cap))
    got = ops.softcap_(x, cap)
    where = f"seed={seed} softcap rows={rows} d={d} {dtype}"
    assert got is x and torch.isfinite(x).all(), where
    assert (x.abs() <= cap).all(), where
    worst = int((x.double() - ref.double()).abs().flatten().argmax())
    assert rel_err(x, ref) < ELEMWISE_TOL[dtype], (
        f"{where}: relative error {rel_err(x, ref):.3g}, the largest at element {worst}: "
        f"{x.flatten()[worst].item()} against {ref.flatten()[worst].item()} for {inputs.flatten()[worst].item()}")
    if dtype != torch.float32:  # equal in all but a few elements, each at most one step of the dtype away
        differ = x != ref
        assert differ.float().mean().item() < 1e-3, f"{differ.sum().item()} elements differ: {where}"
        assert ((x.float() - ref.float()).abs() <= torch.finfo(dtype).eps * cap).all(), where


def check_act_and_mul(ops, *, act: str, num_tokens: int, d: int, dtype: torch.dtype, device: str) -> None:
    """``act`` names the op (``silu_and_mul`` or ``gelu_tanh_and_mul``). Gates are N(0, 3) with every
    seventh N(0, 12), well into both tails (the activation ~0 on the left, ~x on the right)."""
    gen, seed = fresh_generator(device)
    x = _randn((num_tokens, 2 * d), dtype, device, gen) * 3
    x[:, :d:7] *= 4
    ref = getattr(reference, act)(x)
    out = torch.full((num_tokens, d), float("nan"), dtype=dtype, device=device)
    got = getattr(ops, act)(x, out=out)
    where = f"seed={seed} {act} T={num_tokens} d={d} {dtype}"
    assert got is out and torch.isfinite(out).all(), where
    err = rel_err(out, ref)
    assert err < ELEMWISE_TOL[dtype], f"rel err {err:.2e}: {where}"


def check_linear_gelu_mul(ops, *, rows: int, n: int, k: int, dtype: torch.dtype, device: str) -> None:
    """Gemma 4's per-layer input gate, ``gelu_tanh(x @ w.T) * up``, with ``up`` one layer's slice of a
    ``[rows, layers, n]`` tensor (rows a stride apart), as the model passes it: one row through the
    GEMV, more through the projection and then one activation kernel."""
    gen, seed = fresh_generator(device)
    x = _randn((rows, k), dtype, device, gen) * 2
    weight = _randn((n, k), dtype, device, gen) * k**-0.5 * 3
    up = _randn((rows, 3, n), dtype, device, gen)[:, 1]
    ref = reference.linear_gelu_mul(x, weight, up)
    got = ops.linear_gelu_mul(x, weight, up)
    where = f"seed={seed} linear_gelu_mul rows={rows} n={n} k={k} {dtype}"
    assert got.shape == ref.shape and got.dtype == ref.dtype, where
    err = rel_err(got, ref)
    tol = max(ELEMWISE_TOL[dtype], GATED_FP16_TOL) if dtype == torch.float16 else ELEMWISE_TOL[dtype]
    assert err < tol, f"rel err {err:.2e}: {where}"


# "offset"/"fp32": Gemma 3's / Gemma 4's norm in front; "geglu": the gate through tanh-GELU, not SiLU;
# "gelu_mul": the projection through tanh-GELU times an input row (Gemma 4's per-layer input gate).
GEMV_KINDS = ("residual", "norm", "norm_gated", "offset_norm", "offset_norm_geglu", "fp32_norm_geglu", "gelu_mul")


def check_gemv(ops, *, kind: str, n: int, k: int, dtype: torch.dtype, device: str, bias: bool,
               weight_format: str = "dense", tiles: tuple[int, ...] | None = None) -> None:
    """One-row fused GEMV: ``linear_residual`` (kind "residual"), ``linear_gelu_mul`` (kind "gelu_mul",
    which takes no bias) or ``norm_linear`` (plain or gated); the weight in ``weight_format``
    (``pack_weight``'s; the reference dequantizes it); with ``tiles`` the Triton GEMV launched with
    those tiles (``triton_gemv._gemv``'s)."""
    if tiles is not None:
        from tokenmill.kernels import triton_gemv
    gen, seed = fresh_generator(device)
    gated = kind.endswith(("gated", "geglu"))  # the weight holds gate and up rows
    rows = 2 * n if gated else n
    x = _randn((1, k), dtype, device, gen) * 2
    weight = pack_weight(_randn((rows, k), dtype, device, gen) * k**-0.5, weight_format)
    b = _randn((rows,), dtype, device, gen) if bias and kind != "gelu_mul" else None
    if kind == "gelu_mul":
        up = _randn((1, n), dtype, device, gen)
        ref = reference.linear_gelu_mul(x, weight, up)
        got = (ops.linear_gelu_mul(x, weight, up) if tiles is None
               else triton_gemv._gemv(x, weight, None, up=up, activation="gelu_tanh", tiles=tiles))
    elif kind == "residual":
        residual = _randn((1, n), dtype, device, gen)
        ref = reference.linear_residual(x, weight, b, residual)
        got = (ops.linear_residual(x, weight, b, residual) if tiles is None
               else triton_gemv._gemv(x, weight, b, residual=residual, tiles=tiles))
    else:
        weighting = kind.split("_")[0] if kind.startswith(("offset", "fp32")) else "llama"
        norm_w = norm_weight((k,), weighting, dtype, device, gen)
        options = {"weighting": weighting, "activation": "gelu_tanh" if kind.endswith("geglu") else "silu"}
        ref = reference.norm_linear(x, norm_w, 1e-6, weight, b, gated, **options)
        got = (ops.norm_linear(x, norm_w, 1e-6, weight, b, gated, **options) if tiles is None
               else triton_gemv._gemv(x, weight, b, norm_weight=norm_w, eps=1e-6, gated=gated, tiles=tiles, **options))
    where = f"seed={seed} {kind} n={n} k={k} bias={bias} {dtype} {weight_format} tiles={tiles}"
    assert got.shape == ref.shape and got.dtype == ref.dtype, where
    err = rel_err(got, ref)
    # The reference rounds its dequantized Q8_0 matrix to the activations' dtype; the kernel sums each
    # block in float32 unrounded: in float16 that is up to a few parts in 1e3 after the gate.
    tol = ELEMWISE_TOL[dtype]
    if dtype == torch.float16:
        q8 = weight_format == "q8_0"
        tol = max(tol, Q8_FP16_TOL if q8 else GATED_FP16_TOL if gated or kind == "gelu_mul" else tol)
    assert err < tol, f"rel err {err:.2e}: {where}"


def _interpret_attention(ops) -> None:
    f16, f32 = torch.float16, torch.float32
    common = dict(device="cpu", block_size=16)
    # Ragged mixed batch: a decode, a chunked prefill (query shorter than context), a
    # full prompt, a single-token prompt. GQA 4:2, non-power-of-2 head dim.
    mixed = [(1, 37), (20, 53), (29, 29), (1, 1)]
    check_paged_attention(ops, mixed, num_q_heads=4, num_kv_heads=2, head_dim=80, dtype=f16, **common)
    check_paged_attention(ops, mixed, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=f32,
                          sliding_window=13, **common)
    # The same chunked prefill split across programs, and ragged with max_query_len from the host.
    check_paged_attention(ops, mixed, num_q_heads=4, num_kv_heads=1, head_dim=64, dtype=f16,
                          num_splits=3, pass_max_query_len=False, **common)
    # Ragged batches whose longest query takes several tiles: only the real tiles are launched, numbered
    # flat (chunks and decode rows in any order; past the first 128 sequences the scan takes a second chunk).
    check_paged_attention(ops, [(1, 40), (45, 45), (1, 9), (17, 60), (1, 1)], num_q_heads=4, num_kv_heads=1,
                          head_dim=64, dtype=f16, **common)
    check_paged_attention(ops, [(1, 20)] * 129 + [(40, 50), (1, 3)], num_q_heads=4, num_kv_heads=1, head_dim=64,
                          dtype=f32, sliding_window=30, **common)
    # A lone chunk of several query tiles (started last tile first), whole and with its KV split.
    for splits in (None, 2):
        check_paged_attention(ops, [(100, 130)], num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=f16,
                              num_splits=splits, **common)
    # Long prompts at head dim 128, windowed.
    check_paged_attention(ops, [(64, 64), (40, 300), (1, 50)], num_q_heads=8, num_kv_heads=2, head_dim=128,
                          dtype=f16, sliding_window=40, **common)
    # Sharp scores (scale 1 at head dim 64): a prompt tile's running max jumps by tens of log2 units
    # between some key tiles and by a little between others.
    check_paged_attention(ops, [(64, 300), (40, 40)], num_q_heads=4, num_kv_heads=1, head_dim=64,
                          dtype=f16, scale=1.0, **common)
    # Decode batches: T == B with no hint, split and unsplit, windowed, MHA.
    decode = [(1, 70), (1, 5), (1, 33), (1, 16)]
    check_paged_attention(ops, decode, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=f16,
                          pass_max_query_len=False, **common)
    check_paged_attention(ops, decode, num_q_heads=8, num_kv_heads=2, head_dim=80, dtype=f32,
                          num_splits=4, **common)
    # Past 8 splits the merge takes its wide tile (most of these splits are empty: they weigh nothing).
    check_paged_attention(ops, decode, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=f16,
                          num_splits=12, **common)
    check_paged_attention(ops, decode, num_q_heads=2, num_kv_heads=2, head_dim=64, dtype=f16,
                          num_splits=2, sliding_window=20, **common)
    # One program a whole context, the grid under two programs an SM (one here: the CPU counts as
    # one SM), reads 128 keys a tile: two whole tiles and a partial third.
    check_paged_attention(ops, [(1, 300)], num_q_heads=4, num_kv_heads=1, head_dim=128, dtype=f16,
                          num_splits=1, **common)
    # Speculative verification: k+1 = 4 query tokens per sequence, block size 8.
    check_paged_attention(ops, [(4, 40), (4, 9)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                          dtype=f16, device="cpu", block_size=8)
    # Blocks that key tiles do not span whole (each tile then starts elsewhere in a block): 48 tokens
    # a block (not a power of two), windowed, and 128 past a decode tile of 64 keys.
    check_paged_attention(ops, mixed, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=f16, sliding_window=13,
                          device="cpu", block_size=48)
    check_paged_attention(ops, [(1, 300), (1, 70)], num_q_heads=4, num_kv_heads=1, head_dim=64, dtype=f32,
                          num_splits=1, device="cpu", block_size=128)


def _interpret_attention_combinations(ops) -> None:
    """Random combinations of the attention kernel's features, each against the reference: head dim,
    GQA group, a 16-bit or int8 cache, softcap, window, split count, block size, and a batch of decode
    rows and prompt chunks. (Capped scores over a quantized cache once went wrong while each feature
    alone passed.) The seed is in every failure's message."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    for case in range(12):
        head_dim, group = rng.choice([16, 64, 80, 128, 256, 512]), rng.choice([1, 2, 4, 8])
        num_kv_heads = rng.choice([1, 2])
        specs = []
        for _ in range(rng.randint(1, 3)):
            q_len = rng.choice([1, 1, rng.randint(2, 20)])
            specs.append((q_len, rng.randint(q_len, 300)))
        options = dict(num_q_heads=group * num_kv_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       dtype=rng.choice([torch.float16, torch.float32]), device="cpu",
                       sliding_window=rng.choice([None, rng.randint(8, 200)]),
                       num_splits=rng.choice([None, 1, rng.randint(2, 5)]), block_size=rng.choice([8, 16]),
                       softcap=rng.choice([None, 5.0]))
        note = f"combination seed={seed} case={case}: {specs} {options}"
        try:
            if rng.random() < 0.5:
                check_quantized_attention(ops, specs=specs, cache_dtype=torch.int8, **options)
            else:
                check_paged_attention(ops, specs, **options)
        except AssertionError as e:
            raise AssertionError(f"{note}: {e}") from e


def _interpret_attention_edge_masks(ops) -> None:
    """Decode tiles through the loop that masks only the edge tiles (the engine takes it over float8
    caches, which the interpreter cannot convert as the GPU does): the same loop over 16-bit and int8
    caches, contexts whole and split, windowed, shorter than a tile, and blocks that tiles do not span
    whole. A middle tile the loop left masked or an edge it left unmasked fails these."""
    from tokenmill.kernels import triton_attention

    triton_attention._mask_edges_only = lambda block_m, kv_dtype, num_splits: True
    f16, f32 = torch.float16, torch.float32
    decode = [(1, 300), (1, 5), (1, 128), (1, 257)]
    for splits in (1, 3):
        check_paged_attention(ops, decode, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=f16,
                              num_splits=splits, device="cpu", block_size=16)
        check_paged_attention(ops, decode, num_q_heads=4, num_kv_heads=1, head_dim=128, dtype=f32,
                              sliding_window=100, num_splits=splits, device="cpu", block_size=16)
    check_paged_attention(ops, [(1, 300), (1, 70)], num_q_heads=4, num_kv_heads=1, head_dim=64, dtype=f32,
                          num_splits=1, device="cpu", block_size=48)
    check_quantized_attention(ops, specs=decode, num_q_heads=4, num_kv_heads=1, head_dim=128, dtype=f16,
                              cache_dtype=torch.int8, device="cpu", num_splits=1)
    check_quantized_attention(ops, specs=decode, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=f32,
                              cache_dtype=torch.int8, device="cpu", sliding_window=70, num_splits=2)


def _interpret_attention_gemma(ops) -> None:
    """Gemma's head dims (3: 256 everywhere; 4: 256 sliding, 512 global), GQA groups of 2 and 8,
    score softcapping. A cap of 2 at scale 1 saturates most scores (|s| ~ sqrt(D) >> 2); a cap of
    1.5 at the default scale (|s| ~ 1) bends most of them. Either way a kernel that caps 5% off fails."""
    f16, f32 = torch.float16, torch.float32
    common = {"device": "cpu", "block_size": 16}
    check_softcap_tanh("cpu")
    mixed = [(1, 37), (20, 53), (29, 29), (1, 1)]
    decode = [(1, 70), (1, 5), (1, 33), (1, 16)]
    # Prefill-sized queries fill BLOCK_M = 64 rows; decode packs the group into 16.
    check_paged_attention(ops, mixed, num_q_heads=4, num_kv_heads=2, head_dim=256, dtype=f32,
                          softcap=2.0, scale=1.0, **common)
    check_paged_attention(ops, mixed, num_q_heads=4, num_kv_heads=2, head_dim=256, dtype=f16,
                          sliding_window=13, softcap=1.5, **common)
    check_paged_attention(ops, mixed, num_q_heads=8, num_kv_heads=1, head_dim=512, dtype=f16,
                          softcap=2.0, scale=1.0, **common)
    check_paged_attention(ops, mixed, num_q_heads=4, num_kv_heads=2, head_dim=512, dtype=f32,
                          sliding_window=20, **common)
    # Split-KV decode, capped and windowed: the merging split sums whole 256- and 512-wide rows.
    check_paged_attention(ops, decode, num_q_heads=16, num_kv_heads=2, head_dim=256, dtype=f16,
                          num_splits=3, sliding_window=20, softcap=2.0, scale=1.0, **common)
    check_paged_attention(ops, decode, num_q_heads=8, num_kv_heads=1, head_dim=512, dtype=f32,
                          num_splits=4, softcap=1.5, pass_max_query_len=False, **common)
    check_paged_attention(ops, decode, num_q_heads=4, num_kv_heads=2, head_dim=512, dtype=f16,
                          softcap=2.0, scale=1.0, **common)
    # Speculative verification with a cap.
    check_paged_attention(ops, [(4, 40), (4, 9)], num_q_heads=16, num_kv_heads=2, head_dim=256, dtype=f16,
                          softcap=2.0, scale=1.0, device="cpu", block_size=8)


def _interpret_rms_norm(ops) -> None:
    for dtype in (torch.float16, torch.float32):
        for with_residual in (False, True):
            check_rms_norm(ops, num_tokens=7, hidden=96, dtype=dtype, device="cpu", with_residual=with_residual)
    check_rms_norm(ops, num_tokens=3, hidden=64, dtype=torch.float16, device="cpu", with_residual=True,
                   weight_dtype=torch.float32)


def _interpret_offset_rms_norm(ops) -> None:
    for dtype in (torch.float16, torch.float32):
        for with_residual in (False, True):
            check_rms_norm(ops, num_tokens=7, hidden=96, dtype=dtype, device="cpu", with_residual=with_residual,
                           offset=True)
    # A float32 weight leaves the output in the input's dtype (unlike rms_norm's promotion).
    check_rms_norm(ops, num_tokens=3, hidden=64, dtype=torch.float16, device="cpu", with_residual=True,
                   weight_dtype=torch.float32, offset=True)
    # One head per row, as Gemma's per-head q/k norms run it.
    check_rms_norm(ops, num_tokens=5, hidden=256, dtype=torch.float16, device="cpu", with_residual=False,
                   offset=True)


def check_add_rms_norm(ops, *, num_tokens: int, hidden: int, dtype: torch.dtype, device: str,
                       weighting: str, scaled: bool = False) -> None:
    """``residual + norm(x)``, Gemma's post-norm joining the stream (``offset`` or ``fp32`` weighting);
    ``scaled``: then times a layer scalar, as Gemma 4's last join of a layer."""
    gen, seed = fresh_generator(device)
    x, residual = (_randn((num_tokens, hidden), dtype, device, gen) for _ in range(2))
    weight = norm_weight((hidden,), weighting, dtype, device, gen)
    scale = torch.tensor([0.37], dtype=dtype, device=device) if scaled else None
    ref = reference.add_rms_norm(x, weight, 1e-6, residual, weighting, scale)
    got = ops.add_rms_norm(x, weight, 1e-6, residual, weighting, scale)
    where = f"seed={seed} add_rms_norm {weighting} T={num_tokens} H={hidden} {dtype} scaled={scaled}"
    assert got.dtype == ref.dtype and got.shape == ref.shape, where
    err = rel_err(got, ref)
    assert err < ELEMWISE_TOL[dtype], f"rel err {err:.2e}: {where}"


def check_join_and_norm(ops, *, num_tokens: int, hidden: int, dtype: torch.dtype, device: str,
                        weighting: str) -> None:
    """A Gemma block's output normed into the stream and the new stream normed by the next norm, in one
    kernel: both outputs against the reference's two ops."""
    gen, seed = fresh_generator(device)
    x, residual = (_randn((num_tokens, hidden), dtype, device, gen) for _ in range(2))
    weight, next_weight = (norm_weight((hidden,), weighting, dtype, device, gen) for _ in range(2))
    inputs = (x.clone(), residual.clone())
    ref = reference.join_and_norm(x, weight, 1e-6, residual, next_weight, weighting)
    got = ops.join_and_norm(x, weight, 1e-6, residual, next_weight, weighting)
    where = f"seed={seed} join_and_norm {weighting} T={num_tokens} H={hidden} {dtype}"
    for name, g, r in zip(("normed", "stream"), got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape, f"{name}: {where}"
        err = rel_err(g, r)
        assert err < ELEMWISE_TOL[dtype], f"{name} rel err {err:.2e}: {where}"
    assert torch.equal(x, inputs[0]) and torch.equal(residual, inputs[1]), f"inputs written: {where}"


def check_fp32_weight_rms_norm(ops, *, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> None:
    """Gemma 4's norm over the last dim of ``shape``."""
    gen, seed = fresh_generator(device)
    x = _randn(shape, dtype, device, gen) * 3
    weight = norm_weight(shape[-1:], "fp32", dtype, device, gen)
    ref = reference.fp32_weight_rms_norm(x, weight, 1e-6)
    got = ops.fp32_weight_rms_norm(x, weight, 1e-6)
    where = f"seed={seed} fp32_weight_rms_norm {shape} {dtype}"
    assert got.dtype == ref.dtype and got.shape == ref.shape, where
    err = rel_err(got, ref)
    assert err < ELEMWISE_TOL[dtype], f"rel err {err:.2e}: {where}"


def check_rotary_query(ops, *, num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                       device: str) -> None:
    """RoPE on q alone, after Gemma 4's q norm (a KV-shared layer): in place, nothing else touched."""
    gen, seed = fresh_generator(device)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen, device=device)
    cos_sin = torch.randn(64, head_dim, generator=gen, device=device)
    q = _randn((num_tokens, num_heads, head_dim), dtype, device, gen)
    weight = norm_weight((head_dim,), "fp32", dtype, device, gen)
    ref = reference.rotary_embedding_query(positions, q.clone(), cos_sin, weight, 1e-6, "fp32")
    got = ops.rotary_embedding_query(positions, q, cos_sin, weight, 1e-6, "fp32")
    where = f"seed={seed} rotary_embedding_query T={num_tokens} H={num_heads} D={head_dim} {dtype}"
    assert got.shape == ref.shape, where
    err = rel_err(got, ref)
    assert err < ELEMWISE_TOL[dtype], f"rel err {err:.2e}: {where}"


def _interpret_gemma4_norms(ops) -> None:
    for dtype in (torch.float16, torch.float32):
        for weighting in ("offset", "fp32"):
            check_add_rms_norm(ops, num_tokens=7, hidden=96, dtype=dtype, device="cpu", weighting=weighting,
                               scaled=weighting == "fp32")
            check_join_and_norm(ops, num_tokens=5, hidden=96, dtype=dtype, device="cpu", weighting=weighting)
        check_fp32_weight_rms_norm(ops, shape=(5, 3, 64), dtype=dtype, device="cpu")
        check_rotary_query(ops, num_tokens=4, num_heads=3, head_dim=64, dtype=dtype, device="cpu")


def _interpret_rope_write_kv(ops) -> None:
    for dtype in (torch.float16, torch.float32):
        check_rope_write_kv(ops, num_tokens=6, num_q_heads=4, num_kv_heads=2, head_dim=80, dtype=dtype,
                            device="cpu")
    check_rope_write_kv(ops, num_tokens=23, num_q_heads=3, num_kv_heads=1, head_dim=64, block_size=8,
                        num_blocks=4, dtype=torch.float32, cache_dtype=torch.float16, device="cpu")
    for dtype in (torch.float16, torch.float32):
        check_rope_write_kv(ops, num_tokens=7, num_q_heads=4, num_kv_heads=2, head_dim=48, dtype=dtype,
                            device="cpu", qk_norm=True)
    # Gemma's head dims: 256 with GQA 2, 512 with GQA 8; at 512 a pass holds 16 heads, so 40 q heads
    # take three passes (the last one partial) and 20 KV heads two.
    check_rope_write_kv(ops, num_tokens=5, num_q_heads=4, num_kv_heads=2, head_dim=256, dtype=torch.float16,
                        device="cpu")
    check_rope_write_kv(ops, num_tokens=4, num_q_heads=16, num_kv_heads=2, head_dim=512, dtype=torch.float32,
                        device="cpu", qk_norm=True)
    check_rope_write_kv(ops, num_tokens=6, num_q_heads=40, num_kv_heads=20, head_dim=512, dtype=torch.float16,
                        device="cpu", qk_norm=True)
    for dtype in (torch.float16, torch.float32):
        for weighting in ("offset", "fp32"):
            check_rope_write_kv(ops, num_tokens=5, num_q_heads=4, num_kv_heads=2, head_dim=256, dtype=dtype,
                                device="cpu", qk_norm=weighting)
        # Gemma 4's v norm, at its two head dims (512: several passes over the KV heads).
        check_rope_write_kv(ops, num_tokens=5, num_q_heads=4, num_kv_heads=2, head_dim=256, dtype=dtype,
                            device="cpu", qk_norm="fp32", v_norm=True)
    check_rope_write_kv(ops, num_tokens=6, num_q_heads=40, num_kv_heads=20, head_dim=512, dtype=torch.float16,
                        device="cpu", qk_norm="fp32", v_norm=True)


def _interpret_softcap(ops) -> None:
    for dtype in (torch.float16, torch.float32):
        check_softcap(ops, rows=3, d=3000, dtype=dtype, device="cpu")  # rows spanning blocks, the last partial
    check_softcap(ops, rows=2, d=50, dtype=torch.float16, device="cpu", cap=15.0)


def _interpret_act_and_mul(act: str):
    def cases(ops) -> None:
        for dtype in (torch.float16, torch.float32):
            check_act_and_mul(ops, act=act, num_tokens=5, d=300, dtype=dtype, device="cpu")
        check_act_and_mul(ops, act=act, num_tokens=2, d=1500, dtype=torch.float16, device="cpu")
        if act == "gelu_tanh_and_mul":  # gate and up apart: the GEMV at one row, the activation kernel past it
            for rows in (1, 5):
                check_linear_gelu_mul(ops, rows=rows, n=96, k=160, dtype=torch.float16, device="cpu")
    return cases


def _interpret_gemv(ops) -> None:
    for kind in GEMV_KINDS:
        for dtype in (torch.float16, torch.float32):
            # K spans several tiles and ends inside one; N ends inside a program's rows.
            check_gemv(ops, kind=kind, n=13, k=2500, dtype=dtype, device="cpu", bias=dtype == torch.float16)
        check_gemv(ops, kind=kind, n=64, k=64, dtype=torch.float32, device="cpu", bias=True)
    for kind in ("residual", "norm_gated", "offset_norm_geglu", "gelu_mul"):  # Q8_0: K spans tiles, ends inside one
        check_gemv(ops, kind=kind, n=13, k=2528, dtype=torch.float16, device="cpu", bias=False, weight_format="q8_0")
        check_gemv(ops, kind=kind, n=40, k=96, dtype=torch.float32, device="cpu", bias=True, weight_format="q8_0")
    # FP8, a scale a row and a 128-column block: K spans tiles and ends inside one (and inside a block).
    for kind in ("residual", "norm_gated", "fp32_norm_geglu", "gelu_mul"):
        for fmt in ("fp8", "fp8_block"):
            check_gemv(ops, kind=kind, n=13, k=2512, dtype=torch.float16, device="cpu", bias=False, weight_format=fmt)
            check_gemv(ops, kind=kind, n=40, k=96, dtype=torch.float32, device="cpu", bias=True, weight_format=fmt)
    # Several tiles of rows a program, the last program's partly or wholly past N, K ending inside a tile.
    for kind, row_tiles in (("residual", 3), ("norm_gated", 2), ("offset_norm_geglu", 4), ("fp32_norm", 3),
                            ("gelu_mul", 2)):
        check_gemv(ops, kind=kind, n=37, k=600, dtype=torch.float16, device="cpu", bias=True,
                   tiles=(4, 256, 4, row_tiles))
    check_gemv(ops, kind="norm_gated", n=21, k=160, dtype=torch.float32, device="cpu", bias=False,
               weight_format="q8_0", tiles=(4, 64, 4, 3))
    check_gemv(ops, kind="norm_gated", n=21, k=400, dtype=torch.float32, device="cpu", bias=False,
               weight_format="fp8_block", tiles=(4, 256, 4, 3))


# How a test stores a weight (``pack_weight``): "fp8" a scale a row, "fp8_block" a scale a row and
# 128-column block, "fp8_static" a scale a row with a static activation scale.
WEIGHT_FORMATS = ("dense", "q8_0", "fp8", "fp8_block", "fp8_static")


def pack_weight(weight: torch.Tensor, weight_format: str, input_amax: float = 4.0) -> reference.Weight:
    """``weight`` ``[N, K]`` in ``weight_format``; a static activation scale takes ``input_amax`` as the
    calibrated largest input."""
    if weight_format == "dense":
        return weight
    if weight_format == "q8_0":
        return q8_0.quantize(weight)
    if weight_format == "fp8_block":
        return fp8.FP8Weight(*fp8.quantize_groups(weight, 128), 128)
    rows = fp8.quantize_rows(weight)
    if weight_format == "fp8":
        return rows
    scale = torch.tensor([input_amax / fp8.FP8_MAX], dtype=torch.float32, device=weight.device)
    return fp8.FP8Weight(rows.qweight, rows.scales, None, scale)


# FP8 tensor cores' products of FP8 rows and weights against the float32 reference's: the hardware's
# accumulation keeps fewer bits than float32.
FP8_MMA_TOL = 2e-3


def check_matmul(ops, *, m: int, n: int, k: int, dtype: torch.dtype, device: str, bias: bool,
                 weight_format: str = "q8_0", kernel: str | None = None, tiles: tuple[int, ...] | None = None) -> None:
    """Rows times a weight in ``weight_format`` (``pack_weight``'s) against the reference: through
    ``ops.linear``, the few-row matmul (``kernel="skinny"``) or the FP8 rows' matmul
    (``kernel="fp8"``), with ``tiles``. FP8 rows past the few-row matmul's are quantized, as
    ``reference.fp8_linear`` quantizes them."""
    from tokenmill.kernels.triton_skinny_matmul import MAX_FP8_ROWS
    gen, seed = fresh_generator(device)
    x = _randn((m, k), dtype, device, gen)
    x[m // 2] *= 40  # a row of outliers: each row's own scale
    weight = pack_weight(_randn((n, k), dtype, device, gen) * k**-0.5, weight_format,
                         input_amax=x.abs().amax().item())
    b = _randn((n,), dtype, device, gen) if bias else None
    if kernel == "skinny":
        from tokenmill.kernels.triton_skinny_matmul import skinny_matmul
        got = skinny_matmul(x, weight, b, tiles)
    elif kernel == "fp8":
        from tokenmill.kernels.triton_fp8 import fp8_matmul
        got = fp8_matmul(x, weight, b, tiles)
    else:
        got = ops.linear(x, weight, b)
    quantized_rows = kernel == "fp8" or (kernel is None and isinstance(weight, fp8.FP8Weight) and m > MAX_FP8_ROWS)
    ref = reference.fp8_linear(x, weight, b) if quantized_rows else reference.linear(x, weight, b)
    where = f"seed={seed} {kernel or 'linear'} m={m} n={n} k={k} {weight_format} bias={bias} {dtype} tiles={tiles}"
    assert got.shape == ref.shape and got.dtype == ref.dtype, where
    err = rel_err(got, ref)
    tol = max(ELEMWISE_TOL[dtype], FP8_MMA_TOL) if quantized_rows and device == "cuda" else ELEMWISE_TOL[dtype]
    assert err < tol, f"rel err {err:.2e}: {where}"


def check_quantize_rows(*, m: int, k: int, dtype: torch.dtype, device: str, weight_format: str) -> None:
    """Rows quantized to float8 for the FP8 matmul, value for value and scale for scale as the reference
    quantizes them: a row of zeros, a row of outliers, values down in float8's subnormal steps."""
    from tokenmill.kernels.triton_fp8 import quantize_rows
    gen, seed = fresh_generator(device)
    x = _randn((m, k), dtype, device, gen)
    x[0] = 0
    x[-1] *= 1000
    x[m // 2, ::3] *= 1e-4  # below 2^-6 of the row's largest over 448: float8's subnormals
    weight = pack_weight(torch.ones(16, k, device=device), weight_format, input_amax=x.abs().amax().item() / 2)
    values, scales = quantize_rows(x, weight)
    want_values, want_scales = reference.quantize_fp8_activations(x, weight.block, weight.input_scale)
    where = f"seed={seed} quantize_rows m={m} k={k} {dtype} {weight_format}"
    assert values.dtype == want_values.dtype and torch.equal(scales.expand_as(want_scales), want_scales), where
    differ = (values.view(torch.uint8) != want_values.view(torch.uint8)).sum().item()
    assert differ == 0, f"{differ} values differ: {where}"


def _interpret_fp8_matmul(ops) -> None:
    # Rows quantized per token, per token and block, and by a static scale (K ending inside a block);
    # the matmul's tiles: rows, columns and K each ending inside one.
    for fmt in ("fp8", "fp8_block", "fp8_static"):
        for dtype in (torch.float16, torch.float32):
            check_quantize_rows(m=5, k=300, dtype=dtype, device="cpu", weight_format=fmt)
            check_matmul(ops, m=37, n=70, k=288, dtype=dtype, device="cpu", bias=dtype == torch.float16,
                         weight_format=fmt, kernel="fp8", tiles=(16, 32, 128, 4, 2, 2))
        check_matmul(ops, m=70, n=40, k=256, dtype=torch.float16, device="cpu", bias=True, weight_format=fmt)


def _interpret_skinny_matmul(ops) -> None:
    # The few rows ``ops.linear`` sends it (dense, Q8_0, FP8), rows and columns ending inside a tile; K
    # split over 2-4 parts of whole 64-wide steps (5 steps: the last part short or empty), the bias
    # added after the parts' sum; a second call finds the tile counters reset. Q8_0 past 64 rows: the
    # large tile, K a multiple of 32 but not of its step, unsplit and split.
    for dtype in (torch.float16, torch.float32):
        check_matmul(ops, m=70, n=130, k=160, dtype=dtype, device="cpu", bias=True)
        check_matmul(ops, m=130, n=70, k=288, dtype=dtype, device="cpu", bias=False, kernel="skinny",
                     tiles=(128, 128, 64, 8, 3, 2))
        for fmt in ("dense", "q8_0", "fp8", "fp8_block"):
            check_matmul(ops, m=3, n=70, k=96, dtype=dtype, device="cpu", bias=True, weight_format=fmt)
            check_matmul(ops, m=37, n=130, k=160, dtype=dtype, device="cpu", bias=False, weight_format=fmt,
                         kernel="skinny", tiles=(64, 64, 64, 4, 2, 1))
            for split_k, bias in ((2, True), (3, False), (4, True), (4, True)):  # 4 twice: counters reset
                check_matmul(ops, m=5, n=40, k=320, dtype=dtype, device="cpu", bias=bias, weight_format=fmt,
                             kernel="skinny", tiles=(16, 32, 64, 4, 2, split_k))


def check_fused_experts(ops, *, tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype,
                        device: str, tile: tuple[int, ...] | None = None) -> None:
    """A sparse MoE block's experts against the reference (each expert on its own tokens), with tokens
    crowding two experts and leaving others unchosen, rows and columns ending inside tiles."""
    gen, seed = fresh_generator(device)
    x = _randn((tokens, hidden), dtype, device, gen)
    w13 = _randn((experts, 2 * inter, hidden), dtype, device, gen) * hidden**-0.5
    w2 = _randn((experts, hidden, inter), dtype, device, gen) * inter**-0.5
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    logits[:, :2] += 2.0  # most tokens choose experts 0 and 1
    logits[:, -1] -= 100.0  # none the last
    topk_weights, topk_ids = reference.moe_routing(logits, top_k, renormalize=True)
    ref = reference.fused_experts(x, w13, w2, topk_ids, topk_weights, grouped=True)
    if tile is None:
        got = ops.fused_experts(x, w13, w2, topk_ids, topk_weights)
    else:
        from tokenmill.kernels.triton_moe import fused_experts
        got = fused_experts(x, w13, w2, topk_ids, topk_weights, tile)
    where = f"seed={seed} fused_experts tokens={tokens} hidden={hidden} inter={inter} E={experts} k={top_k} {dtype}"
    assert got.shape == ref.shape and got.dtype == ref.dtype, where
    err = rel_err(got, ref)
    tol = max(ELEMWISE_TOL[dtype], GATED_FP16_TOL) if dtype == torch.float16 else ELEMWISE_TOL[dtype]
    assert err < tol, f"rel err {err:.2e}: {where}"


def _interpret_fused_experts(ops) -> None:
    for dtype in (torch.float16, torch.float32):
        check_fused_experts(ops, tokens=37, hidden=80, inter=48, experts=6, top_k=2, dtype=dtype, device="cpu",
                            tile=(16, 32, 32, 4, 2))
        check_fused_experts(ops, tokens=1, hidden=64, inter=32, experts=8, top_k=3, dtype=dtype, device="cpu",
                            tile=(16, 32, 32, 4, 2))


def check_sample(ops, *, rows: int, vocab: int, device: str, splits: int | None = None) -> None:
    """The race over top-k/top-p/min-p candidates against the reference's sort, token for token:
    every kind of row in one batch (greedy, plain, each filter alone and together, banned tokens,
    ties at the top-k's edge, peaked and flat rows, small nuclei that reject many winners)."""
    gen, seed = fresh_generator(device)

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(rows, generator=gen, device=device)

    spread = torch.exp(4 * torch.rand(rows, 1, generator=gen, device=device) - 2)  # flat to peaked rows
    logits = _randn((rows, vocab), torch.float32, device, gen) * spread
    logits[::5, : vocab // 3] = float("-inf")  # banned tokens (a grammar's mask)
    logits[1::7] = logits[1::7].round()  # many ties
    noise = torch.empty(rows, vocab, device=device).exponential_(generator=gen)
    temperature = uniform(0.2, 2.0)
    temperature[::6] = 0.0  # greedy rows
    top_k = torch.randint(0, vocab // 2, (rows,), generator=gen, device=device)
    top_k[1::3] = torch.randint(1, 5, (len(top_k[1::3]),), generator=gen, device=device)  # a few tokens
    top_k[::3] = 0
    top_p = uniform(0.01, 1.0)
    top_p[::4] = 1.0
    min_p = torch.where(torch.rand(rows, generator=gen, device=device) < 0.3, uniform(0.0, 0.5), 0.0)
    top_values = largest_logits(logits, int(top_k.max()))
    inv_temperature = torch.tensor([inverse_temperature(t) for t in temperature.tolist()], device=device)
    greedy = logits.argmax(dim=-1)
    args = (logits, noise, inv_temperature, top_k, top_values, top_p, min_p, greedy)
    ref, got = reference.sample(*args), ops.sample(*args, **({} if splits is None else {"splits": splits}))
    where = f"seed={seed} sample rows={rows} vocab={vocab} splits={splits}"
    assert got.dtype == torch.int64 and got.shape == (rows,), where
    mismatched = torch.nonzero(got != ref).flatten().tolist()
    assert not mismatched, f"rows {mismatched}: {got[mismatched].tolist()} vs {ref[mismatched].tolist()}: {where}"


def check_penalties(ops, *, rows: int, vocab: int, device: str) -> None:
    """Penalised logits to the bit, each row reading its own (shuffled) row of the token tables."""
    gen, seed = fresh_generator(device)
    table_rows = rows + 2
    logits = _randn((rows, vocab), torch.float32, device, gen) * 4
    counts = torch.randint(0, 4, (table_rows, vocab), generator=gen, device=device).float()
    counts *= torch.rand(table_rows, vocab, generator=gen, device=device) < 0.1  # most tokens unseen
    prompt = torch.rand(table_rows, vocab, generator=gen, device=device) < 0.05
    read = torch.randperm(table_rows, generator=gen, device=device)[:rows]

    def per_row(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(rows, generator=gen, device=device)

    args = (logits, counts, prompt, read, per_row(0.5, 2.0), per_row(-1.0, 1.0), per_row(-1.0, 1.0))
    ref, got = reference.apply_penalties(*args), ops.apply_penalties(*args)
    where = f"seed={seed} penalties rows={rows} vocab={vocab}"
    assert got.shape == ref.shape and got.dtype == ref.dtype, where
    assert torch.equal(got, ref), f"max diff {(got - ref).abs().max().item():.3e}: {where}"


def _interpret_penalties(ops) -> None:
    check_penalties(ops, rows=5, vocab=3000, device="cpu")  # the row ends inside a tile


def check_top_k_edges(ops, *, vocab: int, device: str) -> None:
    """The top-k threshold exactly: noise that makes the k-th most likely token win when it is in
    the top-k and the (k+1)-th win when the threshold lets it in, on rows of either sign, with
    -inf and zeros of both signs, for k from 1 to all the finite tokens."""
    gen, seed = fresh_generator(device)
    rows = [_randn((vocab,), torch.float32, device, gen) * 3, -_randn((vocab,), torch.float32, device, gen).abs(),
            _randn((vocab,), torch.float32, device, gen) * 1e-30]
    with_inf = _randn((vocab,), torch.float32, device, gen)
    with_inf[: vocab // 2] = float("-inf")
    with_inf[vocab // 2: vocab // 2 + 3] = torch.tensor([0.0, -0.0, 1e-40])
    rows.append(with_inf)
    one = torch.ones(1, device=device)
    for logits in rows:
        finite = int(logits.isfinite().sum())
        order = logits.argsort(descending=True, stable=True)
        for k in sorted({1, 2, finite // 3, finite - 1, finite} - {0}):
            noise = torch.ones(vocab, device=device)
            noise[order[k - 1]] = 1e-20
            if k < vocab:
                noise[order[k]] = 1e-30
            top_k = torch.tensor([k], device=device)
            got = ops.sample(logits[None], noise[None], one, top_k, largest_logits(logits[None], k), one, one * 0,
                             torch.zeros(1, dtype=torch.int64, device=device))
            assert got.item() == order[k - 1].item(), f"seed={seed} top_k={k} of {finite}: got {got.item()}"


def check_argmax_rows(ops, *, rows: int, vocab: int, dtype: torch.dtype, device: str, spans: int | None = None) -> None:
    """Each row's greedy token (``argmax_rows``) against torch's argmax, on random rows and on rows
    built to catch a wrong pick: ties inside a span and across spans (the first token wins), a row of
    zeros, of -inf, NaNs (the first NaN wins, as torch gives it) beside +inf, a maximum in the last
    token. ``spans``: force the spans a row (else the kernel's own choice)."""
    gen, seed = fresh_generator(device)
    logits = _randn((rows, vocab), dtype, device, gen)
    specials = [[(vocab // 3, 50.0), (vocab - 1, 50.0)], [(vocab - 2, 50.0), (vocab - 1, 50.0)],
                [(vocab - 1, 60.0)], [(vocab // 2, float("inf")), (vocab - 1, float("nan")), (vocab // 4, float("nan"))]]
    for row, marks in enumerate(specials[:rows]):
        for token, value in marks:
            logits[row, token] = value
    if rows > 4:
        logits[4] = 0.0
    if rows > 5:
        logits[5] = float("-inf")
    kernel = ops.argmax_rows if spans is None else (lambda x: ops.argmax_rows(x, spans=spans))
    got = kernel(logits)
    where = f"seed={seed} rows={rows} vocab={vocab} {dtype} spans={spans}"
    assert got.dtype == torch.int64 and got.shape == (rows,), where
    assert torch.equal(got.cpu(), logits.float().cpu().argmax(dim=-1)), where


def _interpret_argmax_rows(ops) -> None:
    for dtype in (torch.float16, torch.float32):
        for rows, vocab in ((1, 7), (6, 1009), (7, 20000), (70, 4096), (2, 151936)):
            for spans in (None, 1, 4, 16):
                check_argmax_rows(ops, rows=rows, vocab=vocab, dtype=dtype, device="cpu", spans=spans)


def _interpret_sample(ops) -> None:
    check_top_k_edges(ops, vocab=300, device="cpu")
    check_sample(ops, rows=24, vocab=3000, device="cpu")  # the row spans tiles, ending inside one
    for splits in (2, 5):  # the first pass spread over programs: spans of 1024 tokens, the last short
        check_sample(ops, rows=9, vocab=3000, device="cpu", splits=splits)
    check_sample(ops, rows=7, vocab=50, device="cpu")
    check_sample(ops, rows=1, vocab=10, device="cpu")


INTERPRET_CASES = {
    "argmax_rows": _interpret_argmax_rows,
    "sample": _interpret_sample,
    "penalties": _interpret_penalties,
    "gemv": _interpret_gemv,
    "skinny_matmul": _interpret_skinny_matmul,
    "fp8_matmul": _interpret_fp8_matmul,
    "fused_experts": _interpret_fused_experts,
    "paged_attention": _interpret_attention,
    "paged_attention_gemma": _interpret_attention_gemma,
    "paged_attention_edge_masks": _interpret_attention_edge_masks,
    "paged_attention_combinations": _interpret_attention_combinations,
    "rms_norm": _interpret_rms_norm,
    "offset_rms_norm": _interpret_offset_rms_norm,
    "gemma_norms": _interpret_gemma4_norms,
    "quantized_kv": _interpret_quantized_kv,
    "rotary_embedding_and_write_kv": _interpret_rope_write_kv,
    "softcap": _interpret_softcap,
    "silu_and_mul": _interpret_act_and_mul("silu_and_mul"),
    "gelu_tanh_and_mul": _interpret_act_and_mul("gelu_tanh_and_mul"),
}

if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 before running the interpreter cases")
    from tokenmill.kernels import triton_ops

    INTERPRET_CASES[sys.argv[1]](triton_ops)
    print(f"{sys.argv[1]}: ok")
