"""The Triton implementations of every kernel, under the reference's names and signatures.

The dispatch layer calls ``tokenmill.kernels.triton_ops.<name>`` on CUDA tensors;
each function matches ``tokenmill.kernels.reference.<name>`` (extra arguments are
keyword-only and optional).
"""

import torch

from tokenmill.kernels.fp8 import FP8Weight
from tokenmill.kernels.q8_0 import Q8Weight
from tokenmill.kernels.reference import Weight
from tokenmill.kernels.triton_activation import gelu_tanh_and_mul, gelu_tanh_mul, silu_and_mul, softcap_
from tokenmill.kernels.triton_argmax import argmax_rows
from tokenmill.kernels.triton_attention import kv_splits, paged_attention
from tokenmill.kernels.triton_fp8 import fp8_matmul
from tokenmill.kernels.triton_gemv import MAX_ROWS as GEMV_MAX_ROWS
from tokenmill.kernels.triton_gemv import linear as gemv_linear
from tokenmill.kernels.triton_gemv import linear_gelu_mul as gemv_linear_gelu_mul
from tokenmill.kernels.triton_gemv import linear_residual, norm_linear
from tokenmill.kernels.triton_moe import fused_experts
from tokenmill.kernels.triton_norm import add_rms_norm, fp32_weight_rms_norm, join_and_norm, offset_rms_norm, rms_norm
from tokenmill.kernels.triton_penalties import apply_penalties
from tokenmill.kernels.triton_rotary import rotary_embedding_and_write_kv, rotary_embedding_query
from tokenmill.kernels.triton_sampling import sample
from tokenmill.kernels.triton_skinny_matmul import skinny_matmul
from tokenmill.kernels.triton_skinny_matmul import takes as skinny_takes


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``reference.linear`` on the GPU: one row through the GEMV (a packed weight read as it is; at one
    row it streams a dense projection faster than cuBLAS, which splits K and reduces in a second
    kernel), a few dense or FP8 rows and any number of Q8_0 rows through ``triton_skinny_matmul``,
    more dense rows through cuBLAS, more FP8 rows quantized onto FP8 tensor cores (``triton_fp8``:
    ``reference.fp8_linear``, which rounds the rows too)."""
    if x.shape[0] <= GEMV_MAX_ROWS:
        return gemv_linear(x, weight, bias)
    if isinstance(weight, FP8Weight) and x.stride(-1) != 1:
        x = x.contiguous()  # the rows' count alone decides how an FP8 projection reads them
    if skinny_takes(x, weight):
        return skinny_matmul(x, weight, bias)
    if isinstance(weight, FP8Weight):
        return fp8_matmul(x, weight, bias)
    if isinstance(weight, Q8Weight):
        raise ValueError("a Q8_0 projection needs its rows contiguous")
    return torch.nn.functional.linear(x, weight, bias)


def linear_gelu_mul(x: torch.Tensor, weight: Weight, up: torch.Tensor) -> torch.Tensor:
    """``reference.linear_gelu_mul`` on the GPU: one row in one GEMV, the activation and product in its
    epilogue; more rows through ``linear``, then the activation and product in one kernel."""
    if x.shape[0] <= GEMV_MAX_ROWS:
        return gemv_linear_gelu_mul(x, weight, up)
    return gelu_tanh_mul(linear(x, weight, None), up)


__all__ = [
    "GEMV_MAX_ROWS",
    "add_rms_norm",
    "apply_penalties",
    "argmax_rows",
    "fp32_weight_rms_norm",
    "fused_experts",
    "gelu_tanh_and_mul",
    "join_and_norm",
    "kv_splits",
    "linear",
    "linear_gelu_mul",
    "linear_residual",
    "norm_linear",
    "offset_rms_norm",
    "paged_attention",
    "rms_norm",
    "rotary_embedding_and_write_kv",
    "rotary_embedding_query",
    "sample",
    "silu_and_mul",
    "softcap_",
]
