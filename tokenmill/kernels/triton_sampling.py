"""Triton sampling from top-k/top-p/min-p candidates without sorting a row (``reference.sample``).

Sorting a 150k-token row to find its nucleus costs milliseconds a step at large batches. Instead
each row runs the exponential race over its top-k and checks the winner: when the top-k tokens
more likely than the winner hold less than ``top_p`` of the mass (and the winner passes min-p),
the winner is the race's winner over the candidates too. When not, no token as unlikely as the
winner is a candidate either, so the race runs again over the tokens above it, with the same
noise: the result is exactly the reference's, and most rows finish in one or two passes over the
row (a rejection is at most as likely as the mass outside the nucleus).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_launch import num_sms

# A program streams its row through registers in tiles of BLOCK tokens: 8192 over 16 warps was the
# fastest tile at 1, 8, 64 and 256 rows on the H200 (study_sampling_tiles.py: top-p at 64 rows
# 215 us against 350 us with 4096 over 8 warps).
_BLOCK = 8192
_NUM_WARPS = 16
# At small batches the first pass is spread over up to MAX_SPLITS programs a row, each racing a span
# of the row in tiles of _PART_BLOCK.
MAX_SPLITS = 64
_PART_BLOCK = 1024
_PART_WARPS = 4


@triton.jit
def first_of_best(best_key, best_idx, vocab):
    """The largest key over a program's lanes, and the smallest token id holding it."""
    key = tl.max(best_key, axis=0)
    return key, tl.min(tl.where(best_key == key, best_idx, vocab), axis=0)


@triton.jit
def _threshold(top_k_ptr, top_values_ptr, top_values_stride, max_top_k, row):
    """The row's k-th largest logit, -inf when it has no top-k."""
    top_k = tl.load(top_k_ptr + row)
    kth = float("-inf")
    if (top_k > 0) & (top_k <= max_top_k):
        kth = tl.load(top_values_ptr + row * top_values_stride + top_k - 1)
    return kth


@triton.jit
def _race(logits_row, noise_row, inv_t, kth, start, end, BLOCK: tl.constexpr):
    """Over tokens ``start`` to ``end`` of a row: the largest scaled logit, and the race's best key
    over the top-k with its (first) token id."""
    lanes = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    best_key = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32) + start
    for tile in range(start, end, BLOCK):
        cols = tile + lanes
        valid = cols < end
        raw = tl.load(logits_row + cols, mask=valid, other=float("-inf"))
        noise = tl.load(noise_row + cols, mask=valid, other=1.0)
        x = raw * inv_t
        top = tl.maximum(top, x)
        key = tl.where(valid & (raw >= kth) & (x > float("-inf")), x - tl.log(noise), float("-inf"))
        better = key > best_key
        best_key = tl.where(better, key, best_key)
        best_idx = tl.where(better, cols, best_idx)
    key, winner = first_of_best(best_key, best_idx, end)
    return tl.max(top, axis=0), key, winner


@triton.jit(do_not_specialize=["top_values_stride", "max_top_k", "span"])
def _race_parts_kernel(
    logits_ptr,
    noise_ptr,
    inv_temp_ptr,
    top_k_ptr,
    top_values_ptr,
    part_max_ptr,
    part_key_ptr,
    part_idx_ptr,
    logits_stride,
    noise_stride,
    top_values_stride,
    max_top_k,
    vocab,
    span,
    MAX_SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The first pass of ``_sample_kernel`` spread over programs: each races one span of a row."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    inv_t = tl.load(inv_temp_ptr + row)
    if inv_t > 0:
        kth = _threshold(top_k_ptr, top_values_ptr, top_values_stride, max_top_k, row)
        start = split * span
        part_max, key, winner = _race(
            logits_ptr + row * logits_stride,
            noise_ptr + row * noise_stride,
            inv_t,
            kth,
            start,
            tl.minimum(start + span, vocab),
            BLOCK,
        )
        tl.store(part_max_ptr + row * MAX_SPLITS + split, part_max)
        tl.store(part_key_ptr + row * MAX_SPLITS + split, key)
        tl.store(part_idx_ptr + row * MAX_SPLITS + split, winner)


@triton.jit(do_not_specialize=["top_values_stride", "max_top_k", "num_splits"])
def _sample_kernel(
    logits_ptr,
    noise_ptr,
    inv_temp_ptr,
    top_k_ptr,
    top_values_ptr,
    top_p_ptr,
    min_p_ptr,
    greedy_ptr,
    part_max_ptr,
    part_key_ptr,
    part_idx_ptr,
    out_ptr,
    logits_stride,
    noise_stride,
    top_values_stride,
    max_top_k,
    vocab,
    num_splits,
    MAX_SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    inv_t = tl.load(inv_temp_ptr + row)
    token = tl.load(greedy_ptr + row)
    if inv_t > 0:
        logits_row = logits_ptr + row * logits_stride
        noise_row = noise_ptr + row * noise_stride
        kth = _threshold(top_k_ptr, top_values_ptr, top_values_stride, max_top_k, row)
        top_p = tl.load(top_p_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        lanes = tl.arange(0, BLOCK)
        # The race over the row's top-k, and its largest scaled logit: from the spans' parts
        # (``_race_parts_kernel``) or in one pass here.
        if num_splits > 1:
            splits = tl.arange(0, MAX_SPLITS)
            done = splits < num_splits
            row_max = tl.max(tl.load(part_max_ptr + row * MAX_SPLITS + splits, mask=done, other=float("-inf")), axis=0)
            _, winner = first_of_best(
                tl.load(part_key_ptr + row * MAX_SPLITS + splits, mask=done, other=float("-inf")),
                tl.load(part_idx_ptr + row * MAX_SPLITS + splits, mask=done, other=vocab),
                vocab,
            )
        else:
            row_max, _, winner = _race(logits_row, noise_row, inv_t, kth, 0, vocab, BLOCK)
        x_win = tl.load(logits_row + winner) * inv_t
        accepted = (top_p >= 1.0) & (tl.exp(x_win - row_max) >= min_p)
        # Until a winner is a candidate: the top-k's mass, the mass above the winner, and the
        # race over the tokens above it (the next winner, should this one be rejected).
        while accepted == 0:
            total = tl.zeros([BLOCK], tl.float32)
            above_mass = tl.zeros([BLOCK], tl.float32)
            best_key = tl.full([BLOCK], float("-inf"), tl.float32)
            best_idx = tl.zeros([BLOCK], tl.int32)
            for start in range(0, vocab, BLOCK):
                cols = start + lanes
                valid = cols < vocab
                raw = tl.load(logits_row + cols, mask=valid, other=float("-inf"))
                noise = tl.load(noise_row + cols, mask=valid, other=1.0)
                x = raw * inv_t
                in_top_k = valid & (raw >= kth)
                weight = tl.where(in_top_k, tl.exp(x - row_max), 0.0)
                above = x > x_win
                total += weight
                above_mass += tl.where(above, weight, 0.0)
                key = tl.where(in_top_k & above, x - tl.log(noise), float("-inf"))
                better = key > best_key
                best_key = tl.where(better, key, best_key)
                best_idx = tl.where(better, cols, best_idx)
            in_top_p = (top_p >= 1.0) | (tl.sum(above_mass, axis=0) < top_p * tl.sum(total, axis=0))
            next_key, next_winner = first_of_best(best_key, best_idx, vocab)
            # Nothing above the winner: it is the row's best token, which is always a candidate.
            accepted = (in_top_p & (tl.exp(x_win - row_max) >= min_p)) | (next_key == float("-inf"))
            if accepted == 0:
                winner = next_winner
                x_win = tl.load(logits_row + winner) * inv_t
        token = winner.to(tl.int64)
    tl.store(out_ptr + row, token)


def _default_splits(rows: int, vocab: int, device: torch.device) -> int:
    """Enough programs for two per SM when the rows alone are fewer (one span per program)."""
    if device.type != "cuda":
        return 1
    return max(1, min(MAX_SPLITS, 2 * num_sms(device) // max(rows, 1), triton.cdiv(vocab, _PART_BLOCK)))


def sample(
    logits: torch.Tensor,
    noise: torch.Tensor,
    inv_temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_values: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    greedy_ids: torch.Tensor,
    *,
    block: int = _BLOCK,
    num_warps: int = _NUM_WARPS,
    splits: int | None = None,
) -> torch.Tensor:
    """``reference.sample`` on the GPU: a program per row, its first pass spread over ``splits``
    programs a row (by default as many as fill the GPU: small batches); tiles of ``block`` tokens
    (``benchmarks/studies/study_sampling_tiles.py`` compares tiles)."""
    rows, vocab = logits.shape
    if logits.dtype != torch.float32 or noise.dtype != torch.float32:
        raise ValueError("sampling takes float32 logits and noise")
    if logits.stride(-1) != 1 or noise.stride(-1) != 1:
        raise ValueError("sampling needs a contiguous last dimension")
    max_top_k = top_values.shape[-1]
    # (With no top-k the kernel reads no value: any float32 tensor stands in for the empty one.)
    top_values = top_values.float().contiguous() if max_top_k else logits
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    inv_temperature = inv_temperature.float().contiguous()
    top_k = top_k.to(torch.int64).contiguous()
    splits = _default_splits(rows, vocab, logits.device) if splits is None else min(splits, MAX_SPLITS)
    span = triton.cdiv(triton.cdiv(vocab, max(splits, 1)), _PART_BLOCK) * _PART_BLOCK
    splits = triton.cdiv(vocab, span)
    # The spans' parts: the largest scaled logit, the best key and its token, per row and span. Each in
    # an allocation of its own: a slice of one would start wherever the row count put it, and Triton
    # compiles the kernel again for a pointer off a 16-byte boundary (a variant the warm-up cannot see).
    part_shape = (rows, MAX_SPLITS if splits > 1 else 1)
    parts = [torch.empty(part_shape, dtype=torch.float32, device=logits.device) for _ in range(2)]
    part_idx = torch.empty(part_shape, dtype=torch.int32, device=logits.device)
    if splits > 1:
        _race_parts_kernel[(rows, splits)](
            logits,
            noise,
            inv_temperature,
            top_k,
            top_values,
            parts[0],
            parts[1],
            part_idx,
            logits.stride(0),
            noise.stride(0),
            top_values.stride(0),
            max_top_k,
            vocab,
            span,
            MAX_SPLITS=MAX_SPLITS,
            BLOCK=_PART_BLOCK,
            num_warps=_PART_WARPS,
        )
    _sample_kernel[(rows,)](
        logits,
        noise,
        inv_temperature,
        top_k,
        top_values,
        top_p.float().contiguous(),
        min_p.float().contiguous(),
        greedy_ids.to(torch.int64).contiguous(),
        parts[0],
        parts[1],
        part_idx,
        out,
        logits.stride(0),
        noise.stride(0),
        top_values.stride(0),
        max_top_k,
        vocab,
        splits,
        MAX_SPLITS=MAX_SPLITS,
        BLOCK=min(block, triton.next_power_of_2(vocab)),
        num_warps=num_warps,
    )
    return out
