"""One-byte values (int8, float8) to float16, exactly, through inline PTX; the weight formats that the
matmul kernels read them in.

Every int8 and float8 value is a float16, and the GPU gets there cheaply: float8 e4m3 two values an
instruction (``cvt.rn.f16x2.e4m3x2``), e5m2 as a float16's high byte, int8 by placing the byte's
bits in a float16's mantissa (the float16 of bits ``0x64 | (b ^ 0x80)`` is ``1152 + b``) and
subtracting 1152, four values in five instructions, where Triton's own conversions take the SM's
conversion unit (16 values a clock) for each int8 value and bring float8 to bfloat16 one value at a
time. Where the PTX may
run is the caller's choice (``MOVABLE``). Fixed where it is written, a tile bound for ``tl.dot``
goes through shared memory converted, in float16, and reaches the dot through ``ldmatrix``: the
way for a tile whose dot operand gathers values across its rows (attention's V), which the compiler,
moving the conversion past that trip, reads from the one-byte tile a byte at a time (sm_90, Triton
3.6: 64 ``LDS.U8`` an iteration). Movable, the compiler converts in the operand's own layout: the way
for a tile read along its contiguous dimension (attention's K: eight bytes a load), which then
skips the float16 round trip through shared memory.

Triton's interpreter runs no PTX: there (``PTX`` false) the plain conversion, the same values.
Beside them, ``mul_rn``: a float32 product rounded on its own, as the torch references round it;
``dot_f32``: a tile product exact for float32 operands too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.fp8 import FP8Weight
from tokenmill.kernels.q8_0 import Q8Weight
from tokenmill.kernels.triton_launch import interpreted

# How a projection's weight is stored, as the matmul kernels' ``FORMAT`` says it: dense in the
# activations' dtype; Q8_0 (int8, a float16 scale every 32 values); float8 e4m3 with a float32 scale
# a row, or a row and block of ``FP8_GROUP`` columns.
DENSE = tl.constexpr(0)
Q8_0 = tl.constexpr(1)
FP8_ROWS = tl.constexpr(2)
FP8_BLOCKS = tl.constexpr(3)
FP8_GROUP = tl.constexpr(128)


def weight_format(weight: torch.Tensor | Q8Weight | FP8Weight) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``(values, scales, FORMAT)`` of a projection's weight (``scales`` None for a dense one)."""
    if isinstance(weight, Q8Weight):
        return weight.qweight, weight.scales, Q8_0.value
    if isinstance(weight, FP8Weight):
        if weight.block not in (None, FP8_GROUP.value):
            raise ValueError(f"FP8 kernels take a scale a row or a {FP8_GROUP.value}-column block, got {weight.block}")
        if weight.shape[1] % 16:
            raise ValueError(f"FP8 kernels read rows a multiple of 16 long, got {weight.shape[1]}")
        return weight.qweight, weight.scales, FP8_ROWS.value if weight.block is None else FP8_BLOCKS.value
    return weight, None, DENSE.value


# Four one-byte values (one 32-bit register) in, four float16 (two registers) out.
_E4M3_TO_F16 = tl.constexpr(
    "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }"
)
# float8 e5m2 is the high byte of the float16 of the same value: two byte permutes (no conversion
# instruction, so any GPU; float8 e4m3 caches need compute capability 8.9, checked at start-up).
_E5M2_TO_F16 = tl.constexpr("prmt.b32 $0, $2, 0, 0x1404; prmt.b32 $1, $2, 0, 0x3424;")
# int8: four bytes of ``{src}`` to float16 pairs ``{lo}`` (bytes 0, 1) and ``{hi}`` (bytes 2, 3).
_INT8_PAIRS = (
    "xor.b32 t, {src}, 0x80808080; prmt.b32 lo, t, 0x64646464, 0x4140; prmt.b32 hi, t, 0x64646464, 0x4342; "
    "mov.b32 bias, 0x64806480; sub.f16x2 {lo}, lo, bias; sub.f16x2 {hi}, hi, bias;"
)
_INT8_TO_F16 = tl.constexpr("{ .reg .b32 t, lo, hi, bias; " + _INT8_PAIRS.format(src="$2", lo="$0", hi="$1") + " }")


def ptx_conversions() -> bool:
    """The ``PTX`` argument of ``to_f16`` for a launch now: false under the interpreter."""
    return not interpreted()


@triton.jit
def to_f16(x, PTX: tl.constexpr, MOVABLE: tl.constexpr):
    """``x`` (int8, float8 e4m3 or e5m2) in float16, exactly; ``MOVABLE``: the compiler may move it."""
    if not PTX:
        y = x.to(tl.float16)
    elif x.dtype == tl.float8e4nv:
        y = _ptx_to_f16(x, _E4M3_TO_F16, MOVABLE)
    elif x.dtype == tl.float8e5:
        y = _ptx_to_f16(x, _E5M2_TO_F16, MOVABLE)
    else:
        y = _ptx_to_f16(x, _INT8_TO_F16, MOVABLE)
    return y


@triton.jit
def mul_rn(x, y, PTX: tl.constexpr):
    """``x * y`` (float32) rounded on its own: the compiler fuses a product with the sum it feeds (one
    rounding of both), which PTX's ``mul.rn`` keeps apart. The interpreter (``PTX`` false) fuses nothing."""
    if PTX:
        product = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        product = x * y
    return product


@triton.jit
def dot_f32(a, b, IEEE_DOT: tl.constexpr):
    """``a @ b`` in float32; ``IEEE_DOT`` for float32 operands, which the tensor cores' TF32 would round."""
    if IEEE_DOT:
        product = tl.dot(a, b, input_precision="ieee")
    else:
        product = tl.dot(a, b)
    return product


@triton.jit
def _ptx_to_f16(x, ASM: tl.constexpr, MOVABLE: tl.constexpr):
    return tl.inline_asm_elementwise(
        ASM, "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=MOVABLE, pack=4
    )


# One 32-bit word of four one-byte values (the first in its low byte) in, the four in float32 out:
# int8 through float16 pairs as above, float8 e4m3 two to an instruction.
_INT8X4_TO_F32 = tl.constexpr(
    "{ .reg .b32 t, lo, hi, bias; .reg .b16 a, b, c, d; "
    + _INT8_PAIRS.format(src="$4", lo="lo", hi="hi")
    + " mov.b32 {a, b}, lo; mov.b32 {c, d}, hi; cvt.f32.f16 $0, a; cvt.f32.f16 $1, b;"
    " cvt.f32.f16 $2, c; cvt.f32.f16 $3, d; }"
)
_E4M3X4_TO_F32 = tl.constexpr(
    "{ .reg .b32 lo, hi; .reg .b16 p, q, a, b, c, d; mov.b32 {p, q}, $4;"
    " cvt.rn.f16x2.e4m3x2 lo, p; cvt.rn.f16x2.e4m3x2 hi, q;"
    " mov.b32 {a, b}, lo; mov.b32 {c, d}, hi; cvt.f32.f16 $0, a; cvt.f32.f16 $1, b;"
    " cvt.f32.f16 $2, c; cvt.f32.f16 $3, d; }"
)


@triton.jit
def bytes4_to_f32(words, FP8: tl.constexpr, PTX: tl.constexpr):
    """One-byte values (int8, or float8 e4m3 with ``FP8``) read four to an int32 word (``[R, W]``,
    little-endian) as float32 ``[R, 4 W]`` in memory order. A tile loaded a byte a value reaches PTX
    that takes four bytes a register only after the compiler has taken every byte out of its load and
    packed them again (sm_90, Triton 3.6: about three instructions a value in the Q8_0 GEMV); loaded as
    words, the bytes stay where they came."""
    if PTX:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            _E4M3X4_TO_F32 if FP8 else _INT8X4_TO_F32,
            "=f,=f,=f,=f,r",
            [words],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    elif FP8:  # each byte shifted down and read as float8
        v0 = _e4m3_byte(words)
        v1 = _e4m3_byte(words >> 8)
        v2 = _e4m3_byte(words >> 16)
        v3 = _e4m3_byte(words >> 24)
    else:  # each byte sign-extended by shifts
        v0 = ((words << 24) >> 24).to(tl.float32)
        v1 = ((words << 16) >> 24).to(tl.float32)
        v2 = ((words << 8) >> 24).to(tl.float32)
        v3 = (words >> 24).to(tl.float32)
    # [R, W, 2, 2], a join's new axis last: [.., a, b] is byte 2 a + b, the bytes in memory order.
    values = tl.join(tl.join(v0, v2), tl.join(v1, v3))
    return tl.reshape(values, (values.shape[0], values.shape[1] * 4))


@triton.jit
def _e4m3_byte(word):
    return (word & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def round_mantissa(x, BITS: tl.constexpr):
    """Float32 ``x`` (finite, normal in the target format) rounded to ``BITS`` mantissa bits, ties to
    even, kept in float32 (7: bfloat16's, 3: float8 e4m3's): done on the bits, since the interpreter's
    casts truncate or round a tie up where the GPU's round to nearest."""
    DROP: tl.constexpr = 23 - BITS
    HALF_BELOW: tl.constexpr = (1 << (DROP - 1)) - 1  # just under half the last kept bit
    KEPT: tl.constexpr = 0xFFFFFFFF - ((1 << DROP) - 1)  # the sign, exponent and kept mantissa bits
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + HALF_BELOW + ((bits >> DROP) & 1)) & KEPT
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3(x):
    """Float32 ``x`` within ±448 rounded to the nearest float8 e4m3 value, ties to even, kept in
    float32, so that the cast after it is exact everywhere. Normal values keep three mantissa bits;
    below 2^-6 the step is 2^-9, which float32 addition of 2^14 rounds to."""
    normal = round_mantissa(x, 3)
    magnitude = tl.abs(x)
    tiny = (magnitude + 16384.0) - 16384.0
    return tl.where(magnitude >= 0.015625, normal, tl.where(x < 0, -tiny, tiny))


@triton.jit
def q8_0_tile(w, s_rows, k0, K, rows_ok, PTX: tl.constexpr):
    """A Q8_0 weight tile ``w`` (int8 ``[R, BLOCK_K]``, K positions ``k0`` on) in float32: each value
    (through float16, not the conversion unit) times its block's scale, read from ``s_rows`` (each
    row's scales, ``[R, 1]`` pointers; ``rows_ok``: the rows in range). Rounded to the activations'
    dtype by the caller, it is the reference's dequantized matrix."""
    BLOCK_K: tl.constexpr = w.shape[1]
    kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scale = tl.load(s_rows + kb[None, :], mask=rows_ok[:, None] & (kb[None, :] < K // 32), other=0.0)
    blocks = tl.reshape(to_f16(w, PTX, False).to(tl.float32), (w.shape[0], BLOCK_K // 32, 32))
    return tl.reshape(blocks * scale.to(tl.float32)[:, :, None], (w.shape[0], BLOCK_K))
