"""A sparse MoE block's experts in two Triton launches (``reference.fused_experts``), each expert reading
only the tokens that chose it.

The (token, expert) pairs are sorted by expert on the device, each expert's run padded to whole tiles
of ``BLOCK_M`` rows, so that every program of a launch owns one tile of one expert's rows: the first
launch multiplies them by the expert's gate and up rows and writes ``silu(gate) * up`` for each pair;
the second multiplies that by the expert's down projection and writes each pair's output times its
routing weight; the ``k`` pairs of a token are summed last. Everything runs at fixed shapes (tiles for
the worst case: every expert's run ending one row into a tile, the spare tiles' programs return at
once), with no read on the host, so a CUDA graph captures it. An expert no token chose costs nothing
but its idle tiles' programs; one that several tokens chose is read once a tile of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_activation import gate_activation
from tokenmill.kernels.triton_convert import dot_f32

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): 16 rows a tile, as decode batches give each expert.
TILE = (16, 64, 64, 4, 3)


def sort_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs (flattened ``[T * k]`` indices) by expert, each expert's run padded to whole tiles of
    ``block_m`` with ``T * k`` (no pair), and each tile's expert (``num_experts`` for a tile past the
    last run); fixed sizes, no host read."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    tiles = triton.cdiv(pairs, block_m) + num_experts
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    first_of_run = torch.cumsum(counts, 0) - counts  # each expert's first pair in ``order``
    expert = flat[order]
    dest = (ends - padded)[expert] + torch.arange(pairs, device=flat.device) - first_of_run[expert]
    sorted_pairs = torch.full((tiles * block_m,), pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs.scatter_(0, dest, order)
    tile_starts = torch.arange(tiles, device=flat.device) * block_m
    tile_experts = torch.searchsorted(ends, tile_starts, right=True)
    return sorted_pairs, tile_experts


@triton.jit
def _moe_matmul_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    pairs_ptr,
    experts_ptr,
    weights_ptr,
    num_pairs,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_out,
    TOP_K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    GATED: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Program ``(t, j)``: tile ``t`` of sorted pairs (one expert's), output columns ``j``. ``GATED``: the
    rows are tokens (pair // TOP_K) of ``a``, times the expert's gate rows ``n`` and up rows ``N + n`` of
    ``w``, written as ``silu(gate) * up`` (each rounded to the output dtype, as the reference rounds);
    else the rows are pairs of ``a``, written times the pair's routing weight. Rows are written by pair."""
    expert = tl.load(experts_ptr + tl.program_id(0))
    if expert >= NUM_EXPERTS:
        return
    pairs = tl.load(pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs // TOP_K if GATED else pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks0 = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_a
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    u_rows = w_rows + N.to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + ks0
        a = tl.load(a_rows + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0)
        w_mask = (cols[:, None] < N) & (ks[None, :] < K)
        acc += dot_f32(a, tl.trans(tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)), IEEE_DOT)
        if GATED:
            acc_u += dot_f32(a, tl.trans(tl.load(u_rows + ks[None, :], mask=w_mask, other=0.0)), IEEE_DOT)
    out_ty = out_ptr.dtype.element_ty
    if GATED:
        gate = gate_activation(acc.to(out_ty).to(tl.float32), False).to(out_ty).to(tl.float32)
        out = gate * acc_u.to(out_ty).to(tl.float32)
    else:
        weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(out_ty).to(tl.float32)
        out = acc.to(out_ty).to(tl.float32) * weight[:, None]
    mask = valid[:, None] & (cols[None, :] < N)
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :], out.to(out_ty), mask=mask)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    tile: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``reference.fused_experts`` on the GPU: two launches over the pairs sorted by expert, then each
    token's ``k`` outputs summed in float32. ``tile``: force ``TILE``."""
    tokens, hidden = x.shape
    num_experts, rows13, _ = w13.shape
    inter = rows13 // 2
    top_k = topk_ids.shape[-1]
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_experts needs x's and the weights' rows contiguous")
    if tokens == 0:
        return torch.zeros_like(x)
    block_m, block_n, block_k, num_warps, num_stages = tile or TILE
    pairs, tile_experts = sort_pairs(topk_ids, num_experts, block_m)
    num_pairs = tokens * top_k
    weights = topk_weights.reshape(-1).contiguous()
    activated = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    options = dict(
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        IEEE_DOT=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NUM_STAGES=num_stages,
        num_warps=num_warps,
    )
    tiles = tile_experts.numel()
    _moe_matmul_kernel[(tiles, triton.cdiv(inter, block_n))](
        x,
        w13,
        activated,
        pairs,
        tile_experts,
        weights,
        num_pairs,
        inter,
        hidden,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        activated.stride(0),
        GATED=True,
        **options,
    )
    _moe_matmul_kernel[(tiles, triton.cdiv(hidden, block_n))](
        activated,
        w2,
        per_pair,
        pairs,
        tile_experts,
        weights,
        num_pairs,
        hidden,
        inter,
        activated.stride(0),
        w2.stride(0),
        w2.stride(1),
        per_pair.stride(0),
        GATED=False,
        **options,
    )
    return per_pair.view(tokens, top_k, hidden).float().sum(dim=1).to(x.dtype)
