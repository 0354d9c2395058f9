"""Torch references for every kernel: the CPU path, and the ground truth the
Triton kernels are tested against.

Layouts shared by all implementations:

- KV cache of one layer: ``k_cache`` and ``v_cache`` of shape
  ``[num_blocks, block_size, num_kv_heads, head_dim]``; token slot ``s`` lives
  at ``[s // block_size, s % block_size]``.
- Ragged batch of ``B`` sequences and ``T`` query tokens: ``query_start_loc``
  ``[B+1]`` int32 (prefix sums of query lengths), ``seq_lens`` ``[B]`` int32
  (context length *including* this step's tokens, whose K/V are already
  written), ``block_tables`` ``[B, max_blocks]`` int32.
- Query token ``i`` of sequence ``b`` sits at position
  ``seq_lens[b] - q_len[b] + i`` and attends to key positions ``j`` with
  ``j <= pos`` and, when ``sliding_window`` is set, ``pos - j < sliding_window``
  (the same window as transformers' masks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tokenmill.kernels import q8_0
from tokenmill.kernels.fp8 import FP8_DTYPE, FP8_MAX, FP8Weight, expand_scales, quantize_groups
from tokenmill.kernels.q8_0 import Q8Weight

# What a projection's weight may be: dense, Q8_0 or FP8.
Weight = torch.Tensor | Q8Weight | FP8Weight

# The smallest row magnitude an int8 query is scaled from (an all-zero row stays zero, no 0/0).
QUERY_INT8_FLOOR = 1e-30


def kv_qmax(cache_dtype: torch.dtype) -> float:
    """The largest value a quantized cache's dtype (int8 or a float8) holds."""
    return float(torch.iinfo(cache_dtype).max if cache_dtype == torch.int8 else torch.finfo(cache_dtype).max)


def quantize_kv(
    x: torch.Tensor, cache_dtype: torch.dtype, static_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[T, H, D]`` in ``cache_dtype`` (int8 or a float8) with one scale per token and head
    (``[T, H]``, bfloat16), so that ``q * scale`` dequantizes it. The scale is the head's largest
    magnitude (or ``static_amax``, a checkpoint's calibrated one for the whole tensor, beyond which
    values are clipped) over the dtype's largest value, rounded up to bfloat16 before ``x`` is
    scaled by it (times its reciprocal, as the kernel does with one division a head): the stored
    scale is exactly the one used, and nothing overflows. int8 rounds to the nearest integer;
    float8 rounds as the cast does."""
    qmax = kv_qmax(cache_dtype)
    amax = x.float().abs().amax(dim=-1) if static_amax is None else static_amax.float().expand(x.shape[:-1])
    scale = (amax / qmax * (1 + 2**-7)).to(torch.bfloat16)  # bf16 rounds within 2**-9: never below amax / qmax
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(amax))  # an all-zero head stays zero
    scaled = (x.float() * torch.reciprocal(safe)[..., None]).clamp(-qmax, qmax)
    q = scaled.round().to(torch.int8) if cache_dtype == torch.int8 else scaled.to(cache_dtype)
    return q, scale


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_amax: torch.Tensor | None = None,
) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into the paged caches; slots < 0 are padding. A
    quantized cache (int8, float8) takes ``quantize_kv``'s values, and their scales into ``k_scale``/
    ``v_scale`` ``[num_blocks, block_size, Hkv]`` at the same slots; ``kv_amax`` ``[2]``: a checkpoint's
    static largest magnitudes of K and V, used instead of each head's own."""
    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    for i, (x, cache, scales) in enumerate(((key, k_cache, k_scale), (value, v_cache, v_scale))):
        flat = cache.view(num_blocks * block_size, *cache.shape[2:])
        if scales is None:
            flat[slots] = x[valid].to(cache.dtype)
            continue
        q, scale = quantize_kv(x[valid], cache.dtype, None if kv_amax is None else kv_amax[i])
        flat.view(torch.uint8)[slots] = q.view(torch.uint8)  # CPU float8 tensors take no index_put
        scales.view(num_blocks * block_size, -1)[slots] = scale.to(scales.dtype)  # bfloat16 values, held exactly


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """The first ``length`` tokens of one sequence's cache, ``[length, Hkv, D]``; dequantized to
    float32 with ``scales`` (a quantized cache's)."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    ids = block_table[:num_blocks].long()
    tokens = cache[ids].reshape(-1, *cache.shape[2:])[:length]
    if scales is None:
        return tokens
    return tokens.float() * scales[ids].reshape(-1, cache.shape[2])[:length, :, None].float()


def quantize_query_int8(q: torch.Tensor) -> torch.Tensor:
    """``q`` float32 ``[..., D]`` on the int8 grid of each row (its largest magnitude over 127, rounded
    half up): over an int8 cache the scores are integer dots of the query and key values, which
    run on the tensor cores with no conversion of the keys, times the two scales. Each value is
    multiplied by the step's reciprocal (one division a row, each step rounded to float32, as the
    kernel rounds them) rather than divided by the step, so the kernel makes the same grid values
    without a correctly rounded division for every element."""
    step = q.abs().amax(dim=-1, keepdim=True).clamp_min(QUERY_INT8_FLOOR) / 127.0
    return torch.floor(q * torch.reciprocal(step) + 0.5) * step


def kv_splits(
    k_cache: torch.Tensor, num_q_heads: int, num_tokens: int, max_query_len: int, max_seq_len: int, batch: int = 1
) -> int:
    """The KV ranges ``paged_attention`` splits a context into: the reference attends over each whole."""
    return 1


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
    """Causal attention of ``query`` ``[T, Hq, D]`` over the paged cache, in float32; returns ``[T, Hq, D]``
    (in ``out`` where given). ``max_query_len``, ``max_seq_len`` and ``num_splits`` are launch hints for
    kernels; the reference reads the lengths itself and never splits a context. ``softcap`` bounds the
    scaled scores to ``(-softcap, softcap)`` by ``tanh(s / cap) * cap`` before the mask, as Gemma does. A
    quantized cache is read through its scales (``gather_kv``)."""
    if out is None:
        out = torch.empty_like(query)
    num_q_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_lo, q_hi = starts[b], starts[b + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], seq_len, k_scale).float()
        v = gather_kv(v_cache, block_tables[b], seq_len, v_scale).float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[q_lo:q_hi].float().transpose(0, 1)  # [Hq, Q, D]
        if k_cache.dtype == torch.int8:
            q = quantize_query_int8(q)
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [Hq, Q, S]
        if softcap is not None:
            scores = softcap_(scores, softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= (q_pos - k_pos) < sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.matmul(probs, v).transpose(0, 1).to(query.dtype)
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, as transformers computes it (float32 statistics,
    cast back before the weight). With ``residual``: ``x + residual`` is normed and
    also returned as the new residual."""
    return _rms_norm(x, weight, eps, residual, offset=False)


def offset_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gemma's RMSNorm: the weight is an offset from one (``1 + w``, so zeros are the identity)
    and multiplies in float32 before the cast back, unlike ``rms_norm``. ``residual`` as there."""
    return _rms_norm(x, weight, eps, residual, offset=True)


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, offset: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (normed * (1.0 + weight.float())).to(x.dtype) if offset else weight * normed.to(x.dtype)
    return out if residual is None else (out, residual)


def fp32_weight_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm: ``w * norm(x)`` with ``w`` applied in float32 before the cast back (Llama's
    ``rms_norm`` casts first; Gemma 3's adds one to ``w``); ``weight`` None: no scale (its v norm).
    The statistic is ``pow(mean + eps, -0.5)``, as transformers writes it, not ``rsqrt``."""
    xf = x.float()
    normed = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (normed if weight is None else normed * weight.float()).to(x.dtype)


def softcap_(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``tanh(x / cap) * cap`` in place (so a CUDA graph's static buffer keeps its storage); returns ``x``."""
    return x.div_(cap).tanh_().mul_(cap)


def rotary_cos_sin(inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0) -> torch.Tensor:
    """Table ``[max_positions, rot_dim]`` of ``cos`` (first half) and ``sin`` (second half), float32."""
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(positions, inv_freq.float())
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) RoPE on ``query`` ``[T, Hq, D]`` and ``key`` ``[T, Hkv, D]``."""
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()]
    cos = cos_sin[:, None, :half].repeat(1, 1, 2)
    sin = cos_sin[:, None, half:].repeat(1, 1, 2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return x * c + torch.cat([-x2, x1], dim=-1) * s

    return rotate(query), rotate(key)


def rotary_embedding_query(
    positions: torch.Tensor,
    query: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_weighting: str = "llama",
) -> torch.Tensor:
    """(Each head normed first, as in ``rotary_embedding_and_write_kv``, then) RoPE on ``query`` alone,
    for layers that read another layer's cache (Gemma 4's KV-shared layers) and so have no key to
    rotate or write; the key given to ``rotary_embedding`` has no heads."""
    if q_norm_weight is not None:
        query = NORMS[norm_weighting](query, q_norm_weight, eps)
    return rotary_embedding(positions, query, query[:, :0], cos_sin_cache)[0]


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
    """RoPE on query and key (each head RMS-normed first when norm weights are given, as Qwen3
    and Gemma do, the weights applied as ``norm_weighting`` says: see ``NORMS``), then the rotated
    key and ``value`` (each head normed first, weightless, with ``v_norm``: Gemma 4's) into the
    paged caches (quantized, with ``k_scale``/``v_scale`` and maybe a checkpoint's ``kv_amax``, as
    ``write_kv_cache`` does); returns the rotated query."""
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q and k norm weights, or neither")
    if q_norm_weight is not None:
        norm = NORMS[norm_weighting]
        query = norm(query, q_norm_weight, eps)
        key = norm(key, k_norm_weight, eps)
    query, key = rotary_embedding(positions, query, key, cos_sin_cache)
    if v_norm:
        value = fp32_weight_rms_norm(value, None, eps)
    write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, kv_amax)
    return query


def quantize_fp8_activations(
    x: torch.Tensor, block: int | None, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[T, K]`` as float8 e4m3 values and float32 scales ``[T, ceil(K / block)]`` (``[T, 1]``
    when ``block`` is None): each token's (block's) largest magnitude over 448, or the static
    ``input_scale`` (the largest of the fused parts') for every value. ``values * scales`` is ``x``
    as an FP8 GEMM reads it."""
    if input_scale is None:
        return quantize_groups(x, block)
    scales = input_scale.amax().float().expand(x.shape[0], 1)
    return (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def fp8_linear(x: torch.Tensor, weight: FP8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x_q @ w_q.T`` with both scales applied (and ``bias``), in float32, rounded to x's dtype: the
    activations quantized as ``quantize_fp8_activations`` does, as an FP8 GEMM reads them (the GPU's
    path for many rows, on FP8 tensor cores)."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    values, scales = quantize_fp8_activations(rows, weight.block, weight.input_scale)
    activations = values.float() * expand_scales(scales, weight.block, rows.shape[1])
    return _float32_linear(activations, weight, bias).to(x.dtype).reshape(*shape[:-1], -1)


def fp8_weight_linear(x: torch.Tensor, weight: FP8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T`` with the FP8 weight's scales applied (and ``bias``), in float32, rounded to x's
    dtype: the activations read as they are (what a GPU kernel streaming the weight computes for one
    and a few rows, and what the CPU computes at every size: it has no FP8 matrix units for the
    rounded activations to pay for)."""
    shape = x.shape
    out = _float32_linear(x.reshape(-1, shape[-1]).float(), weight, bias)
    return out.to(x.dtype).reshape(*shape[:-1], -1)


def _float32_linear(x: torch.Tensor, weight: FP8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight.dequantize(torch.float32), None if bias is None else bias.float())


def _project(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: a Q8_0 weight dequantized to x's dtype first, an FP8 one through
    ``fp8_weight_linear``."""
    if isinstance(weight, FP8Weight):
        return fp8_weight_linear(x, weight, bias)
    return torch.nn.functional.linear(x, q8_0.dense(weight, x.dtype), bias)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` (``_project``)."""
    return _project(x, weight, bias)


def linear_residual(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    """``residual + x @ weight.T (+ bias)``, the projection rounded before the add (``_project``)."""
    return _project(x, weight, bias) + residual


def linear_gelu_mul(x: torch.Tensor, weight: Weight, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x @ weight.T) * up``: Gemma 4's per-layer input gate (``_project``)."""
    return gelu_tanh_mul(_project(x, weight, None), up)


def norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: Weight,
    bias: torch.Tensor | None,
    gated: bool = False,
    weighting: str = "llama",
    activation: str = "silu",
) -> torch.Tensor:
    """``norm(x) @ weight.T (+ bias)`` (the norm ``NORMS[weighting]``; ``_project``), then with ``gated``
    the gate half's ``activation`` (``silu`` or ``gelu_tanh``) times the up half."""
    out = _project(NORMS[weighting](x, norm_weight, eps), weight, bias)
    return GATED_ACTIVATIONS[activation](out) if gated else out


def add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
    weighting: str,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + norm(x)`` (the norm ``NORMS[weighting]``): a Gemma block's output, normed,
    joining the stream; then times ``scale`` where given (Gemma 4's layer scalar)."""
    out = residual + NORMS[weighting](x, weight, eps)
    return out if scale is None else out * scale


def join_and_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor, next_weight: torch.Tensor, weighting: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` (no scale), then the new stream normed by ``next_weight`` (the same
    ``NORMS[weighting]`` and eps): returns ``(normed, new stream)``."""
    stream = add_rms_norm(x, weight, eps, residual, weighting)
    return NORMS[weighting](stream, next_weight, eps), stream


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dim."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``x = [gate | up]`` (GeGLU with transformers' ``gelu_pytorch_tanh``)."""
    return gelu_tanh_mul(*x.chunk(2, dim=-1))


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up``, the activation rounded to the inputs' dtype before the product."""
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def moe_routing(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights from the router's ``[T, E]`` logits: softmax over
    every expert in float32 (as transformers does, whatever the model's dtype), the ``top_k`` largest,
    and with ``renormalize`` those divided by their sum (Mixtral always; Qwen3-MoE's ``norm_topk_prob``).
    Returns ``(topk_weights [T, k] float32, topk_ids [T, k] int64)``, both on the logits' device."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    grouped: bool | None = None,
) -> torch.Tensor:
    """A sparse MoE block's experts: for each token, the sum over its ``k`` experts ``e`` of
    ``topk_weights * (silu(gate) * up) @ w2[e].T`` with ``[gate | up] = x @ w13[e].T``.

    ``x [T, H]``; ``w13 [E, 2*I, H]`` (each expert's gate rows, then its up rows); ``w2 [E, H, I]``;
    ``topk_ids``/``topk_weights`` ``[T, k]``. Returns ``[T, H]`` in ``x``'s dtype: under tensor
    parallelism (each rank holding its share of ``I``) a partial sum, to be all-reduced.

    ``grouped`` (default: on the CPU) gathers each expert's tokens and runs only those, in expert order
    (as transformers adds them up), reading the group sizes on the host. Otherwise every expert runs on
    every token and is weighted by zero where it was not chosen: no host read and fixed shapes, so a
    CUDA graph can capture it, at ``E / k`` times the work (the GPU's path where Triton is not in use:
    ``TOKENMILL_KERNELS=reference``)."""
    if grouped is None:
        grouped = not x.is_cuda
    out = torch.zeros_like(x)
    num_experts, top_k = w13.shape[0], topk_ids.shape[-1]
    if not grouped:
        for e in range(num_experts):
            weight = (topk_weights * (topk_ids == e)).sum(dim=-1).to(x.dtype)
            out += (silu_and_mul(x @ w13[e].t()) @ w2[e].t()) * weight[:, None]
        return out
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order].to(x.dtype)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = tokens[start : start + n]
            y = silu_and_mul(x[rows] @ w13[e].t()) @ w2[e].t()
            out.index_add_(0, rows, y * weights[start : start + n, None])
            start += n
    return out


GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}
# How a family's RMSNorm applies its weight, by the name its norm modules give (``weighting``):
# Llama's ``w * norm(x)`` rounded first, Gemma 3's ``(1 + w)`` and Gemma 4's ``w`` in float32.
# Their signatures differ (only the first two take a residual): callers pick by ``weighting``.
NORMS: dict[str, Callable[..., Any]] = {"llama": rms_norm, "offset": offset_rms_norm, "fp32": fp32_weight_rms_norm}


def sampling_candidates(
    logits: torch.Tensor, inv_temperature: torch.Tensor, kth: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """The tokens each row may sample (``[N, V]`` bool), with ``x = logits * inv_temperature`` and
    ``w = exp(x - max x)``: a token is in the top-k when its logit is at least ``kth`` (the row's
    k-th largest, ties kept whole; -inf: no top-k); in the top-p when the top-k tokens with a larger
    ``x`` hold less than ``top_p`` of the top-k's ``w`` (so the token crossing ``top_p`` stays, and
    1 is off); in the min-p when ``w >= min_p``. A candidate is in all three; the row's best token
    always is."""
    scaled = logits * inv_temperature[:, None]
    weight = torch.exp(scaled - scaled.max(dim=-1, keepdim=True).values)
    in_top_k = logits >= kth[:, None]
    kept = in_top_k & (weight >= min_p[:, None])
    if bool((top_p < 1).any()):
        in_weight = weight.masked_fill(~in_top_k, 0.0)
        order = scaled.sort(dim=-1, descending=True)
        cumulative = torch.nn.functional.pad(in_weight.gather(-1, order.indices).cumsum(dim=-1), (1, 0))
        larger = torch.searchsorted(-order.values, -scaled.contiguous(), side="left")  # strictly larger
        mass_above = cumulative.gather(-1, larger)
        total = in_weight.sum(dim=-1, keepdim=True)
        kept &= (mass_above < top_p[:, None] * total) | (top_p[:, None] >= 1)
    return kept


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token: the first position of its largest value (of its first NaN, if any),
    int64 ``[rows]``."""
    return logits.argmax(dim=-1)


def kth_largest(top_k: torch.Tensor, top_values: torch.Tensor) -> torch.Tensor:
    """Each row's ``top_k``-th largest logit from ``top_values``, its largest logits in order
    (``[N, m]``), or -inf where ``top_k`` is 0 or past ``m`` (the row has no top-k)."""
    m = top_values.shape[-1]
    if m == 0:
        return torch.full(top_k.shape, float("-inf"), dtype=top_values.dtype, device=top_values.device)
    kth = top_values.gather(-1, (top_k.clamp(1, m) - 1)[:, None]).squeeze(-1)
    return torch.where((top_k > 0) & (top_k <= m), kth, float("-inf"))


def sample(
    logits: torch.Tensor,
    noise: torch.Tensor,
    inv_temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_values: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    greedy_ids: torch.Tensor,
) -> torch.Tensor:
    """One token per row of float32 ``logits`` ``[N, V]``: the candidate (``sampling_candidates``, the
    top-k threshold from ``kth_largest(top_k, top_values)``) with the largest ``x - log(noise)``, the
    first on ties. With ``noise ~ Exp(1)`` that is an exact
    draw from ``softmax(x)`` over the candidates (the exponential race), each row's noise its own.
    Rows whose ``inv_temperature`` is 0 take ``greedy_ids``."""
    sampled_rows = inv_temperature > 0
    inv = torch.where(sampled_rows, inv_temperature, 1.0)
    candidates = sampling_candidates(logits, inv, kth_largest(top_k, top_values), top_p, min_p)
    key = (logits * inv[:, None] - noise.log()).masked_fill(~candidates, float("-inf"))
    return torch.where(sampled_rows, key.argmax(dim=-1), greedy_ids)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt: torch.Tensor,
    rows: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Row ``i`` of float32 ``logits`` penalised by row ``rows[i]`` of the token tables (``counts``:
    each token's count in the output, ``prompt``: whether it is in the prompt, both ``[R, V]``):
    the repetition penalty over prompt and output (transformers' rule: divide positive logits,
    multiply negative ones), then frequency and presence over the output (OpenAI's). A new tensor."""
    counts, in_prompt = counts[rows], prompt[rows]
    rep = repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(in_prompt | (counts > 0), penalized, logits)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * (counts > 0).to(logits.dtype)
