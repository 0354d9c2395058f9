"""Triton argmax of each row (``reference.argmax_rows``): the greedy token of every row of logits.

Every greedy decode step ends here, over vocabularies of 128k-262k tokens. torch reduces a row in
one thread block, which at batch 1 leaves most of the GPU idle, and a row split into chunks for it
takes three kernels. Here each program reduces one span of a row with wide loads to its largest
value and that value's first token, and where a row has several spans a second kernel picks the best
of them: ties go to the first token, as torch's argmax gives them, and so do NaNs, which torch counts
above every number. On the H200 (``benchmarks/studies/study_argmax.py``, CUDA graphs), against the chunked
torch path before it: 262,208 tokens at 1 / 32 / 128 / 256 rows 14.7 / 16.3 / 42.8 / 71.5 µs against
19.2 / 25.3 / 48.1 / 78.8 (floors 0.1 / 4.0 / 16.1 / 32.1), 128,256 at 256 rows 40.4 against 49.3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton_launch import num_sms
from tokenmill.kernels.triton_sampling import first_of_best

# Tokens a program reads a loop iteration, and its warps: 16 a thread (two 16-byte loads of bfloat16).
# Of 4,096-16,384 tokens over 4-16 warps the fastest, or within 10% of it, from 32 rows on the H200
# (study_argmax.py; 4 warps took 2.5x as long from 128 rows); at 1-8 rows every tile took 10-19 µs,
# in an order that changed from run to run.
_BLOCK = 4096
_NUM_WARPS = 8
# Spans aim at this many programs an SM in all, each at least _MIN_SPAN tokens, at most _MAX_SPANS a row.
_PROGRAMS_PER_SM = 4
_MIN_SPAN = 1024
_MAX_SPANS = 256


@triton.jit
def _first_best(values, tokens, no_token):
    """Over a vector of candidates: the first token holding a NaN if any, else the first holding the
    largest value; and that value."""
    is_nan = values != values
    first_nan = tl.min(tl.where(is_nan, tokens, no_token), axis=0)
    best, first_best = first_of_best(tl.where(is_nan, float("-inf"), values), tokens, no_token)
    token = tl.where(first_nan < no_token, first_nan, first_best)
    return tl.where(first_nan < no_token, float("nan"), best), token


# The spans a row and their length change with the row count: specialising on them (a constexpr, or
# a value of 1) compiled a variant for every few-rows class the first time a step's sampler met it,
# inside that step (Llama-3-8B's 1,024-request workload: five of them). One variant a logits dtype.
@triton.jit(do_not_specialize=["span", "spans"])
def _argmax_spans_kernel(
    logits_ptr, out_ptr, part_value_ptr, part_token_ptr, stride, vocab, span, spans, BLOCK: tl.constexpr
):
    """Program ``(row, s)``: tokens ``s * span`` … of the row. With one span a row it writes the token
    itself; otherwise its span's best value and token."""
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * span
    end = tl.minimum(start + span, vocab)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_token = tl.zeros([BLOCK], tl.int32) + start  # a row of -inf: its first token
    first_nan = tl.zeros([BLOCK], tl.int32) + vocab
    for tile in range(start, end, BLOCK):
        tokens = tile + lanes
        x = tl.load(logits_ptr + row * stride + tokens, mask=tokens < end, other=float("-inf")).to(tl.float32)
        better = x > best  # strictly: each lane keeps the first of its equal values
        best = tl.where(better, x, best)
        best_token = tl.where(better, tokens, best_token)
        # A lane's first NaN kept apart: folded into ``best``'s comparisons it lengthened the loop's
        # dependency chain (262,208 tokens at 128 rows 65.4 against 43.1 µs).
        first_nan = tl.minimum(first_nan, tl.where(x != x, tokens, vocab))
    value, token = _first_best(
        tl.where(first_nan < vocab, float("nan"), best), tl.where(first_nan < vocab, first_nan, best_token), vocab
    )
    if spans == 1:
        tl.store(out_ptr + row, token.to(tl.int64))
    else:
        tl.store(part_value_ptr + row * spans + tl.program_id(1), value)
        tl.store(part_token_ptr + row * spans + tl.program_id(1), token)


@triton.jit(do_not_specialize=["spans"])
def _argmax_pick_kernel(part_value_ptr, part_token_ptr, out_ptr, vocab, spans, MAX_SPANS: tl.constexpr):
    """Row ``program_id``'s token from its spans' best values (spans in token order)."""
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, MAX_SPANS)
    used = lanes < spans
    value = tl.load(part_value_ptr + row * spans + lanes, mask=used, other=float("-inf"))
    token = tl.load(part_token_ptr + row * spans + lanes, mask=used, other=vocab)  # never before a real span
    tl.store(out_ptr + row, _first_best(value, token, vocab)[1].to(tl.int64))


def row_spans(rows: int, vocab: int, device: torch.device) -> int:
    """Spans a row is cut into: a power of two, so that all rows together give about
    ``_PROGRAMS_PER_SM`` programs an SM, each at least ``_MIN_SPAN`` tokens long."""
    want = min(_MAX_SPANS, triton.cdiv(_PROGRAMS_PER_SM * num_sms(device), max(rows, 1)), triton.cdiv(vocab, _MIN_SPAN))
    return 1 << (want.bit_length() - 1)


def argmax_rows(logits: torch.Tensor, spans: int | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``[rows, vocab]`` logits (the last dim contiguous) as int64 ``[rows]``.
    ``spans``: force the spans a row (a power of two; the study), else ``row_spans``."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"argmax_rows takes [rows, vocab] logits with contiguous rows, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if vocab == 0 or vocab >= 2**31:
        raise ValueError(f"argmax_rows takes 1 to 2^31 - 1 tokens a row, got {vocab}")
    spans = spans or row_spans(rows, vocab, logits.device)
    if spans & (spans - 1) or not 1 <= spans <= _MAX_SPANS:
        raise ValueError(f"spans must be a power of two of at most {_MAX_SPANS}, got {spans}")
    span = triton.cdiv(triton.cdiv(vocab, spans), _MIN_SPAN) * _MIN_SPAN
    # Each span's best value and token, where a row has several (one span writes ``out`` itself; its
    # parts go unused, but typed as the others are: one kernel signature for every span count).
    parts = [torch.empty((rows, spans), dtype=dtype, device=logits.device) for dtype in (torch.float32, torch.int32)]
    _argmax_spans_kernel[(rows, spans)](
        logits, out, *parts, logits.stride(0), vocab, span, spans, _BLOCK, num_warps=_NUM_WARPS
    )
    if spans > 1:
        _argmax_pick_kernel[(rows,)](*parts, out, vocab, spans, _MAX_SPANS)
    return out
