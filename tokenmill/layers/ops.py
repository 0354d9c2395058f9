"""The dispatch layer between models and kernels.

Each op runs the Triton kernel on CUDA tensors when Triton is importable and
the torch reference otherwise; ``TOKENMILL_KERNELS=reference`` forces the
reference everywhere (to compare the two paths end to end).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from tokenmill.kernels import reference
from tokenmill.kernels.reference import Weight


@functools.cache
def _triton_ops() -> ModuleType | None:
    if os.environ.get("TOKENMILL_KERNELS", "auto") == "reference":
        return None
    try:
        from tokenmill.kernels import triton_ops
    except ImportError:
        return None
    return triton_ops


def watch_compiles(on_compile: Callable[[str, str], None] | None) -> None:
    """From now on, ``on_compile`` hears the kernel's name and variant before each Triton variant this process compiles
    (``kernels/compile_watch.py``; None stops it). Nothing to watch where Triton is not in use."""
    if _triton_ops() is not None:
        from tokenmill.kernels.compile_watch import watch_compiles as watch

        watch(on_compile)


def backend_for(tensor: torch.Tensor) -> ModuleType:
    """The module whose kernels run on ``tensor``'s device."""
    if tensor.is_cuda:
        ops = _triton_ops()
        if ops is not None:
            return ops
    return reference


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``max_query_len`` (known on the host) spares the kernel a device read, which also
    keeps the call capturable in a CUDA graph; ``max_seq_len`` (an upper bound of
    ``seq_lens``) lets it split the KV range for the contexts it will really see;
    ``num_splits`` fixes how many ranges it splits each context into (None: its own choice,
    ``paged_attention_kv_splits``).
    ``softcap`` caps each scaled score at ``tanh(s / cap) * cap`` before the mask (Gemma).
    ``k_scale``/``v_scale``: a quantized cache's scales. ``out``: where to write (a view of rows)."""
    return backend_for(query).paged_attention(
        query,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        sliding_window,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        softcap=softcap,
        k_scale=k_scale,
        v_scale=v_scale,
        num_splits=num_splits,
        out=out,
    )


def paged_attention_kv_splits(
    k_cache: torch.Tensor, num_q_heads: int, num_tokens: int, max_query_len: int, max_seq_len: int, batch: int = 1
) -> int:
    """How many KV ranges ``paged_attention`` splits each context into for these lengths when not told."""
    return backend_for(k_cache).kv_splits(k_cache, num_q_heads, num_tokens, max_query_len, max_seq_len, batch)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return backend_for(x).rms_norm(x, weight, eps, residual)


def offset_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gemma's ``(1 + w)`` RMSNorm, the weight applied in float32; ``residual`` as ``rms_norm``'s."""
    return backend_for(x).offset_rms_norm(x, weight, eps, residual)


def fp32_weight_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm (weight applied in float32)."""
    return backend_for(x).fp32_weight_rms_norm(x, weight, eps)


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
    """(q/k RMSNorm, weighted as ``norm_weighting`` says, then) RoPE on q and k, with k and v (normed,
    weightless, with ``v_norm``) written to the cache in the same pass (quantized, into a cache with
    ``k_scale``/``v_scale``, from a checkpoint's ``kv_amax`` where it has one); returns the rotated q."""
    return backend_for(query).rotary_embedding_and_write_kv(
        positions,
        query,
        key,
        value,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        q_norm_weight,
        k_norm_weight,
        eps,
        norm_weighting=norm_weighting,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_amax=kv_amax,
        v_norm=v_norm,
    )


def rotary_embedding_query(
    positions: torch.Tensor,
    query: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_weighting: str = "llama",
) -> torch.Tensor:
    """(The q norm, then) RoPE on q alone, nothing written (a layer reading another layer's KV);
    returns the rotated q."""
    return backend_for(query).rotary_embedding_query(
        positions, query, cos_sin_cache, q_norm_weight, eps, norm_weighting
    )


def _fused_gemv(backend: ModuleType, x: torch.Tensor) -> bool:
    return backend is not reference and x.shape[0] <= backend.GEMV_MAX_ROWS


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: Weight,
    bias: torch.Tensor | None,
    gated: bool = False,
    weighting: str = "llama",
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the residual stream ``x + residual`` (just ``x`` when ``residual`` is None; its weight
    applied as ``weighting`` says, see ``reference.NORMS``), projected, then with ``gated`` the gate
    half's ``activation`` (``silu`` or ``gelu_tanh``) times the up half; returns ``(projection,
    stream)``. One kernel for one-token decode on the GPU, where the stream arrives whole (see
    ``linear_into_stream``)."""
    backend = backend_for(x)
    if residual is None and _fused_gemv(backend, x) and norm_weight.dtype == x.dtype:
        return backend.norm_linear(
            x, norm_weight, eps, weight, bias, gated, weighting=weighting, activation=activation
        ), x
    if residual is None:
        normed, stream = _NORMS[weighting](x, norm_weight, eps), x
    elif weighting == "fp32":
        raise ValueError("Gemma 4's norm takes no residual: its layers carry the stream whole")
    else:
        normed, stream = _NORMS[weighting](x, norm_weight, eps, residual)
    out = linear(normed, weight, bias)
    return (_GATED[activation](out) if gated else out), stream


def add_norm_linear(
    x: torch.Tensor,
    stream: torch.Tensor,
    add_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: Weight,
    bias: torch.Tensor | None,
    gated: bool = False,
    weighting: str = "offset",
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gemma block's output ``x`` normed into ``stream``, then the next norm and projection of the new
    stream (as ``norm_linear``); returns ``(projection, new stream)``. Two kernels at one-token decode:
    joining the block output inside the GEMV made every program rebuild the joined row from L2, and
    measured slower on the H200 than a norm kernel in front (Gemma-3-27B: 16.1 against 15.4 ms a step).
    Elsewhere the join and the next norm share one kernel (``join_and_norm``) ahead of the matmul."""
    if _fused_gemv(backend_for(x), x) and norm_weight.dtype == x.dtype:
        new_stream = add_rms_norm(x, add_weight, eps, stream, weighting)
        out, _ = norm_linear(new_stream, None, norm_weight, eps, weight, bias, gated, weighting, activation)
        return out, new_stream
    normed, new_stream = backend_for(x).join_and_norm(x, add_weight, eps, stream, norm_weight, weighting)
    out = linear(normed, weight, bias)
    return (_GATED[activation](out) if gated else out), new_stream


def add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
    weighting: str,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + norm(x)``: a Gemma block's normed output joining the stream, in one pass
    (``weighting`` ``offset`` or ``fp32``, see ``reference.NORMS``), times ``scale`` where given."""
    return backend_for(x).add_rms_norm(x, weight, eps, residual, weighting, scale)


def linear_into_stream(
    x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Project ``x`` into the residual stream: returns ``(delta, residual)`` whose sum is the new
    stream. Where a kernel fuses the add (one-token decode on the GPU) the sum comes back whole, as
    ``(stream, None)``; elsewhere the add is left to the next RMSNorm, which fuses it."""
    if fuses_residual(x, weight):
        return backend_for(x).linear_residual(x, weight, bias, residual), None
    return linear(x, weight, bias), residual


def fuses_residual(x: torch.Tensor, weight: Weight) -> bool:
    """Whether ``linear_into_stream`` adds the residual inside its kernel for ``x`` and ``weight``
    (one-token decode on the GPU), returning the stream whole."""
    return _fused_gemv(backend_for(x), x)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: on the GPU one row takes the GEMV, and a packed weight (Q8_0, FP8) is
    read as it is; the reference dequantizes it."""
    return backend_for(x).linear(x, weight, bias)


def linear_gelu_mul(x: torch.Tensor, weight: Weight, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x @ weight.T) * up`` (Gemma 4's per-layer input gate): one kernel for one-token
    decode on the GPU."""
    return backend_for(x).linear_gelu_mul(x, weight, up)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return backend_for(x).silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU: ``gelu_tanh(gate) * up`` for ``x = [gate | up]``."""
    return backend_for(x).gelu_tanh_and_mul(x)


def softcap_(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``tanh(x / cap) * cap`` in place (Gemma's final logits, ``[rows, vocab]``); returns ``x``."""
    return backend_for(x).softcap_(x, cap)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt: torch.Tensor,
    rows: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Repetition, presence and frequency penalties from each row's token tables (``reference.apply_penalties``)."""
    return backend_for(logits).apply_penalties(logits, counts, prompt, rows, repetition, presence, frequency)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token (``reference.argmax_rows``); on the GPU in one pass over the row spread
    across the SMs."""
    return backend_for(logits).argmax_rows(logits)


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
    """A token per row from its top-k/top-p/min-p candidates by the exponential race over ``noise``
    (``reference.sample``; ``top_values``: each row's largest logits in order, enough for every
    top-k); on the GPU without sorting the row."""
    return backend_for(logits).sample(logits, noise, inv_temperature, top_k, top_values, top_p, min_p, greedy_ids)


def moe_routing(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and weights from the router's logits (``reference.moe_routing``), on the device."""
    return reference.moe_routing(router_logits, top_k, renormalize)


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """A sparse MoE block's experts (``reference.fused_experts``): on the GPU two launches over the
    tokens each expert was chosen by (``triton_moe``)."""
    return backend_for(x).fused_experts(x, w13, w2, topk_ids, topk_weights)


_GATED = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}
_NORMS: dict[str, Callable[..., Any]] = {"llama": rms_norm, "offset": offset_rms_norm, "fp32": fp32_weight_rms_norm}
