"""One-byte values (int8, float8) to float16, exactly, through inline PTX.

Every int8 and float8 value is a float16, and the GPU gets there cheaply: float8 two values an
instruction (``cvt.rn.f16x2.e4m3x2``), int8 by placing the byte's bits in a float16's mantissa
(the float16 of bits ``0x64 | (b ^ 0x80)`` is ``1152 + b``) and subtracting 1152, four values in
five instructions, where Triton's own conversions take the SM's conversion unit (16 values a clock)
for each int8 value and bring float8 to bfloat16 one value at a time. The PTX is opaque to the
compiler, which therefore leaves it where it is written: a plain conversion of a tile bound for
``tl.dot`` it moves past the tile's trip through shared memory, which then reads the one-byte tile
a byte at a time (sm_90, Triton 3.6: 64 ``LDS.U8`` an iteration of the attention loop).

Triton's interpreter runs no PTX: there (``PTX`` false) the plain conversion, the same values.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.triton_launch import interpreted

# Four one-byte values (one 32-bit register) in, four float16 (two registers) out.
_E4M3_TO_F16 = tl.constexpr("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; "
                            "cvt.rn.f16x2.e4m3x2 $1, hi; }")
_E5M2_TO_F16 = tl.constexpr("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e5m2x2 $0, lo; "
                            "cvt.rn.f16x2.e5m2x2 $1, hi; }")
_INT8_TO_F16 = tl.constexpr("{ .reg .b32 t, lo, hi, bias; xor.b32 t, $2, 0x80808080; prmt.b32 lo, t, 0x64646464, 0x4140; "
                            "prmt.b32 hi, t, 0x64646464, 0x4342; mov.b32 bias, 0x64806480; sub.f16x2 $0, lo, bias; "
                            "sub.f16x2 $1, hi, bias; }")


def ptx_conversions() -> bool:
    """The ``PTX`` argument of ``to_f16`` for a launch now: false under the interpreter."""
    return not interpreted()


@triton.jit
def to_f16(x, PTX: tl.constexpr):
    """``x`` (int8, float8 e4m3 or e5m2) in float16, exactly."""
    if not PTX:
        y = x.to(tl.float16)
    elif x.dtype == tl.float8e4nv:
        y = _ptx_to_f16(x, _E4M3_TO_F16)
    elif x.dtype == tl.float8e5:
        y = _ptx_to_f16(x, _E5M2_TO_F16)
    else:
        y = _ptx_to_f16(x, _INT8_TO_F16)
    return y


@triton.jit
def _ptx_to_f16(x, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16,
                                     is_pure=False, pack=4)
