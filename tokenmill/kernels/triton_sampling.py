"""Top-k and top-p without sorting the vocabulary: each row's threshold found by bisection.

Sorting every row of a batch's logits to keep its top-k and its nucleus costs more than the rest
of sampling together. Both keep a row's largest values, so each is a threshold: the smallest
value ``v`` with fewer than ``k`` values above it (top-k), and with less than ``p`` of the
probability above it (top-p, over the top-k's renormalised probabilities). One program per row
searches the values' order-preserving integer keys, 16 keys a pass over the row (8 passes a
search, on a row that stays in L2), and writes the threshold: the caller keeps the
values at or above it. Ties at the threshold are all kept, as ``reference.top_k_top_p_threshold``
does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024
_WAYS = 16  # keys tried a pass: 32-bit keys take 8 passes a search


@triton.jit
def _order_key(x):
    """An int32 that orders as the float32 ``x`` does (``-0.0`` as ``+0.0``), widened to int64."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _above(row_ptr, vocab, pivots, top, BLOCK: tl.constexpr):
    """For each of the key ``pivots``: how many of a row's values have a key above it, and their
    mass ``sum(exp(v - top))``."""
    count = tl.zeros(pivots.shape, dtype=tl.int32)
    mass = tl.zeros(pivots.shape, dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        above = _order_key(v)[:, None] > pivots[None, :]
        count += tl.sum(above.to(tl.int32), axis=0)
        mass += tl.sum(tl.where(above, tl.exp(v - top)[:, None], 0.0), axis=0)
    return count, mass


@triton.jit
def _search(row_ptr, vocab, lo, hi, top, k, p_mass, BY_MASS: tl.constexpr, WAYS: tl.constexpr,
            BLOCK: tl.constexpr):
    """The smallest key in ``(lo, hi]`` where fewer than ``k`` values lie above (or, ``BY_MASS``, less
    than ``p_mass`` of mass), given that it holds at ``hi`` and not at ``lo``: each pass over the row
    tries ``WAYS`` evenly spaced keys and keeps the gap where the answer changes."""
    while hi - lo > 1:
        step = (hi - lo + WAYS - 1) // WAYS
        pivots = tl.minimum(lo + step * (tl.arange(0, WAYS) + 1).to(tl.int64), hi)
        count, mass = _above(row_ptr, vocab, pivots, top, BLOCK)
        if BY_MASS:
            holds = mass < p_mass
        else:
            holds = count < k
        new_hi = tl.min(tl.where(holds, pivots, hi))
        lo = tl.max(tl.where(holds, lo, pivots))
        hi = new_hi
    return hi


@triton.jit
def _top_k_top_p_threshold_kernel(logits_ptr, stride, vocab, top_k_ptr, top_p_ptr, out_ptr, WAYS: tl.constexpr,
                                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride
    k = tl.load(top_k_ptr + row).to(tl.int32)
    p = tl.load(top_p_ptr + row).to(tl.float32)
    use_k = (k > 0) & (k < vocab)
    use_p = p < 1.0
    # The row's largest and smallest values bound the search.
    top = tl.full((), float("-inf"), tl.float32)
    bottom = tl.full((), float("inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, tl.max(v))
        bottom = tl.minimum(bottom, tl.min(tl.where(cols < vocab, v, float("inf"))))
    key = _order_key(bottom)  # top-k off: every value kept
    if use_k:
        key = _search(row_ptr, vocab, key - 1, _order_key(top), top, k, 0.0, False, WAYS, BLOCK)
    if use_p:  # within the top-k, by their renormalised mass
        _, kept_mass = _above(row_ptr, vocab, tl.full((1,), 0, tl.int64) + key - 1, top, BLOCK)
        p_mass = p * tl.sum(kept_mass)
        key = _search(row_ptr, vocab, key - 1, _order_key(top), top, k, p_mass, True, WAYS, BLOCK)
    bits = key.to(tl.int32)
    threshold = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)
    threshold = tl.where(use_k | use_p, threshold, float("-inf"))
    tl.store(out_ptr + row, threshold)


def top_k_top_p_threshold(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("top_k_top_p_threshold needs rows with a contiguous last dimension")
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _top_k_top_p_threshold_kernel[(rows,)](logits, logits.stride(0), vocab, top_k, top_p, out,
                                               WAYS=_WAYS, BLOCK=_BLOCK, num_warps=8)
    return out
