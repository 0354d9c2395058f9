"""Every Triton kernel against the torch reference on the GPU (``-m gpu``; skipped without CUDA).

Fresh random inputs each run (seeds in failure messages). Tolerances, as relative
error ‖out − ref‖/‖ref‖: attention 1e-2 bf16, 2e-3 fp16, 1e-4 fp32 (IEEE dots);
the elementwise kernels (norms, RoPE, SiLU and GeGLU) 8e-3 bf16, 1e-3 fp16, 1e-5 fp32;
V written to the cache exactly; the softcap's float32 tanh within 5e-7 absolute and
1e-6 relative from |x| = 0.5.
Outputs are poisoned with NaN before the call where the API takes ``out=``, and
the KV cache is NaN outside the written context, so unwritten outputs and stray
reads both fail.
"""

from __future__ import annotations

import functools
import importlib.util
import random
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
    pytest.skip("needs CUDA and triton", allow_module_level=True)

from tokenmill.kernels import q8_0, reference, triton_ops  # noqa: E402
from tokenmill.layers.sampler import largest_logits  # noqa: E402


def _load_cases():
    # Loaded by path so the tests work under any pytest import mode.
    spec = importlib.util.spec_from_file_location("_kernel_cases", Path(__file__).with_name("_kernel_cases.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cases = _load_cases()
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_rng = random.SystemRandom()


def _decode_specs(batch: int, max_ctx: int) -> list[tuple[int, int]]:
    return [(1, max_ctx)] + [(1, _rng.randint(1, max_ctx)) for _ in range(batch - 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", [(128, 32, 8), (64, 16, 2), (128, 8, 8)])
@pytest.mark.parametrize("batch,max_ctx", [(1, 4096), (7, 1000), (64, 2048)])
@pytest.mark.parametrize("window", [None, 256])
def test_paged_attention_decode(dtype, head_dim, num_q_heads, num_kv_heads, batch, max_ctx, window) -> None:
    cases.check_paged_attention(
        triton_ops,
        _decode_specs(batch, max_ctx),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device="cuda",
        sliding_window=window,
        pass_max_query_len=False,
    )


@pytest.mark.parametrize("num_splits", [1, 5, 64])
def test_paged_attention_decode_forced_splits(num_splits: int) -> None:
    cases.check_paged_attention(
        triton_ops, _decode_specs(3, 3000), num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
        dtype=torch.bfloat16, device="cuda", num_splits=num_splits,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("window", [None, 700])
def test_paged_attention_mixed_batch(dtype, head_dim, window) -> None:
    """Chunked prefills (query shorter than context), a full prompt, decodes and a k+1 verify."""
    specs = [(512, 4096), (1, 1500), (300, 300), (5, 2000), (1, 17), (129, 1000)]
    cases.check_paged_attention(
        triton_ops, specs, num_q_heads=16, num_kv_heads=4, head_dim=head_dim, block_size=16,
        dtype=dtype, device="cuda", sliding_window=window,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 700])
@pytest.mark.parametrize("scale", [None, 1.0])
def test_paged_attention_long_prompts(dtype, head_dim, window, scale) -> None:
    """Long prompts (a whole prompt, a chunk deep in its context) beside a decode row; at scale 1 the
    scores are sharp (a row's running max jumps by tens of log2 units between some key tiles and by a
    little between others, and each jump rescales what the tiles before it summed)."""
    cases.check_paged_attention(
        triton_ops, [(2048, 2048), (1000, 3000), (1, 500)], num_q_heads=32, num_kv_heads=8, head_dim=head_dim,
        block_size=16, dtype=dtype, device="cuda", sliding_window=window, scale=scale,
    )


@pytest.mark.parametrize("pass_max_query_len", [True, False])
def test_paged_attention_spec_verify(pass_max_query_len: bool) -> None:
    specs = [(4, _rng.randint(4, 3000)) for _ in range(16)]
    cases.check_paged_attention(
        triton_ops, specs, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=32,
        dtype=torch.bfloat16, device="cuda", pass_max_query_len=pass_max_query_len,
    )


@pytest.mark.parametrize("hq,hkv,d,window,softcap", [(32, 8, 128, None, None), (16, 8, 256, 1024, 1.5),
                                                     (16, 2, 512, None, 1.5)])
def test_paged_attention_decode_cuda_graph(hq, hkv, d, window, softcap) -> None:
    """Capture a decode call once, then change lengths, block tables and queries in place and replay."""
    batch, bs, width = 8, 16, 128
    num_blocks = batch * width + 1
    k_cache = torch.randn(num_blocks, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    query = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch,), 40, device="cuda", dtype=torch.int32)
    block_tables = torch.randperm(num_blocks - 1, device="cuda")[: batch * width].view(batch, width).int() + 1
    out = torch.empty_like(query)

    def step() -> None:
        triton_ops.paged_attention(query, k_cache, v_cache, qsl, seq_lens, block_tables, d**-0.5, window,
                                   softcap=softcap, out=out)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        seq_lens.copy_(torch.randint(1, width * bs + 1, (batch,), device="cuda", dtype=torch.int32))
        block_tables.copy_(torch.randperm(num_blocks - 1, device="cuda")[: batch * width].view(batch, width) + 1)
        query.copy_(torch.randn_like(query))
        out.fill_(float("nan"))
        graph.replay()
        ref = reference.paged_attention(query, k_cache, v_cache, qsl, seq_lens, block_tables, d**-0.5, window,
                                        softcap=softcap)
        assert torch.isfinite(out).all()
        assert cases.rel_err(out, ref) < cases.ATTN_TOL[torch.bfloat16]


# Gemma's attention shapes: head dim 256 (Gemma 3, Gemma 4's sliding layers) and 512 (Gemma 4's
# global layers), GQA groups of 2 and 8.
GEMMA_SHAPES = [(256, 16, 8), (256, 16, 2), (512, 16, 8), (512, 16, 2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", GEMMA_SHAPES)
@pytest.mark.parametrize("batch,max_ctx,window,softcap", [(1, 4096, None, 1.5), (33, 1500, None, None),
                                                          (33, 1500, 700, 1.5)])
def test_paged_attention_gemma_decode(dtype, head_dim, num_q_heads, num_kv_heads, batch, max_ctx, window,
                                      softcap) -> None:
    cases.check_paged_attention(
        triton_ops, _decode_specs(batch, max_ctx), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=16, dtype=dtype, device="cuda", sliding_window=window, softcap=softcap,
        pass_max_query_len=False,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", GEMMA_SHAPES)
@pytest.mark.parametrize("window,softcap", [(None, 1.5), (700, None), (700, 1.5)])
def test_paged_attention_gemma_mixed_batch(dtype, head_dim, num_q_heads, num_kv_heads, window, softcap) -> None:
    specs = [(512, 4096), (1, 1500), (300, 300), (5, 2000), (1, 17), (129, 1000)]
    cases.check_paged_attention(
        triton_ops, specs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=16, dtype=dtype, device="cuda", sliding_window=window, softcap=softcap,
    )


@pytest.mark.parametrize("head_dim", [256, 512])
@pytest.mark.parametrize("num_splits", [1, 5, 64])
def test_paged_attention_gemma_forced_splits(head_dim: int, num_splits: int) -> None:
    """A cap of 2 at scale 1 saturates most scores; the merge takes D in chunks of 128."""
    cases.check_paged_attention(
        triton_ops, _decode_specs(3, 3000), num_q_heads=16, num_kv_heads=2, head_dim=head_dim, block_size=16,
        dtype=torch.bfloat16, device="cuda", num_splits=num_splits, softcap=2.0, scale=1.0,
    )


def test_paged_attention_gemma_spec_verify() -> None:
    specs = [(4, _rng.randint(4, 3000)) for _ in range(16)]
    cases.check_paged_attention(
        triton_ops, specs, num_q_heads=16, num_kv_heads=8, head_dim=256, block_size=16,
        dtype=torch.bfloat16, device="cuda", sliding_window=512, softcap=1.5,
    )


def test_softcap_tanh() -> None:
    cases.check_softcap_tanh("cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,d", [(1, 262144), (128, 262144), (5, 3001)])
def test_softcap(dtype, rows, d) -> None:
    cases.check_softcap(triton_ops, rows=rows, d=d, dtype=dtype, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 4096), (129, 4096), (64, 1024), (5, 5120)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, num_tokens, hidden, with_residual) -> None:
    cases.check_rms_norm(triton_ops, num_tokens=num_tokens, hidden=hidden, dtype=dtype, device="cuda",
                         with_residual=with_residual)


def test_rms_norm_fp32_weight_promotes() -> None:
    cases.check_rms_norm(triton_ops, num_tokens=33, hidden=2048, dtype=torch.bfloat16, device="cuda",
                         with_residual=True, weight_dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 2560), (129, 3840), (7, 5376), (300, 256)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_offset_rms_norm(dtype, num_tokens, hidden, with_residual) -> None:
    cases.check_rms_norm(triton_ops, num_tokens=num_tokens, hidden=hidden, dtype=dtype, device="cuda",
                         with_residual=with_residual, offset=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 2560), (129, 5376)])
@pytest.mark.parametrize("weighting,scaled", [("offset", False), ("fp32", False), ("fp32", True)])
def test_add_rms_norm(dtype, num_tokens, hidden, weighting, scaled) -> None:
    cases.check_add_rms_norm(triton_ops, num_tokens=num_tokens, hidden=hidden, dtype=dtype, device="cuda",
                             weighting=weighting, scaled=scaled)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 2560), (136, 2560), (129, 5376), (300, 96)])
@pytest.mark.parametrize("weighting", ["offset", "fp32"])
def test_join_and_norm(dtype, num_tokens, hidden, weighting) -> None:
    cases.check_join_and_norm(triton_ops, num_tokens=num_tokens, hidden=hidden, dtype=dtype, device="cuda",
                              weighting=weighting)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2560), (7, 8, 256), (300, 2, 512)])
def test_fp32_weight_rms_norm(dtype, shape) -> None:
    cases.check_fp32_weight_rms_norm(triton_ops, shape=shape, dtype=dtype, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,num_heads,head_dim", [(1, 8, 256), (77, 32, 512)])
def test_rotary_embedding_query(dtype, num_tokens, num_heads, head_dim) -> None:
    cases.check_rotary_query(triton_ops, num_tokens=num_tokens, num_heads=num_heads, head_dim=head_dim, dtype=dtype,
                             device="cuda")


def test_offset_rms_norm_fp32_weight_keeps_the_dtype() -> None:
    cases.check_rms_norm(triton_ops, num_tokens=33, hidden=2560, dtype=torch.bfloat16, device="cuda",
                         with_residual=True, weight_dtype=torch.float32, offset=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,num_q_heads,num_kv_heads,head_dim,block_size",
                         [(1, 32, 8, 128, 16), (300, 32, 8, 128, 16), (40, 16, 2, 64, 16), (77, 14, 2, 80, 32)])
def test_rotary_embedding_and_write_kv(dtype, num_tokens, num_q_heads, num_kv_heads, head_dim, block_size) -> None:
    cases.check_rope_write_kv(triton_ops, num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, block_size=block_size, num_blocks=64, dtype=dtype, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,num_q_heads,num_kv_heads", [(1, 32, 8), (300, 16, 8), (33, 14, 2)])
def test_rotary_embedding_and_write_kv_with_qk_norm(dtype, num_tokens, num_q_heads, num_kv_heads) -> None:
    cases.check_rope_write_kv(triton_ops, num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                              head_dim=128, dtype=dtype, device="cuda", qk_norm=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,num_q_heads,num_kv_heads,head_dim", [(1, 16, 8, 256), (300, 8, 1, 256),
                                                                          (1, 16, 2, 512), (77, 40, 4, 512)])
@pytest.mark.parametrize("qk_norm,v_norm", [(False, False), (True, False), ("offset", False), ("fp32", False),
                                            ("fp32", True)])
def test_rotary_embedding_and_write_kv_gemma_head_dims(dtype, num_tokens, num_q_heads, num_kv_heads, head_dim,
                                                        qk_norm, v_norm) -> None:
    cases.check_rope_write_kv(triton_ops, num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, dtype=dtype, device="cuda", qk_norm=qk_norm, v_norm=v_norm)


QUANTIZED_KV = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


# bf16 (what the engine runs) over the shapes; float32 and a checkpoint's static magnitudes on one each.
QUANTIZED_WRITE_CASES = ([(torch.bfloat16, shape, False) for shape in ((1, 8, 128), (77, 2, 256), (33, 4, 512))]
                         + [(torch.float32, (9, 4, 128), False), (torch.bfloat16, (9, 4, 128), True)])


@pytest.mark.parametrize("cache_dtype", QUANTIZED_KV, ids=str)
@pytest.mark.parametrize("dtype,shape,static", QUANTIZED_WRITE_CASES)
def test_quantized_kv_write(cache_dtype, dtype, shape, static) -> None:
    num_tokens, num_kv_heads, head_dim = shape
    cases.check_quantized_kv_write(triton_ops, num_tokens=num_tokens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                   dtype=dtype, cache_dtype=cache_dtype, device="cuda", static=static)


@pytest.mark.parametrize("cache_dtype", QUANTIZED_KV, ids=str)
@pytest.mark.parametrize("dtype,specs,window,splits", [
    (torch.bfloat16, [(1, 4000)] * 4, None, None), (torch.bfloat16, [(1, 900), (37, 600)], 256, None),
    (torch.bfloat16, [(1, 3000)], None, 7), (torch.float32, [(1, 900), (37, 600)], None, None),
    # Decode with a whole KV range a program: float8 masks only the edge tiles there.
    (torch.bfloat16, [(1, 1000), (1, 257), (1, 128), (1, 5)], None, 1),
    (torch.bfloat16, [(1, 700), (1, 300)], 256, 1)])
def test_quantized_attention(cache_dtype, dtype, specs, window, splits) -> None:
    cases.check_quantized_attention(triton_ops, specs=specs, num_q_heads=32, num_kv_heads=8, head_dim=128,
                                    dtype=dtype, cache_dtype=cache_dtype, device="cuda", sliding_window=window,
                                    num_splits=splits)


@pytest.mark.parametrize("cache_dtype", QUANTIZED_KV, ids=str)
def test_quantized_attention_over_small_values(cache_dtype) -> None:
    """Values of 1e-4 (scales near 1e-7): probabilities weighed by them stay out of float16's subnormals."""
    cases.check_quantized_attention(triton_ops, specs=[(1, 900), (5, 300)], num_q_heads=32, num_kv_heads=8,
                                    head_dim=128, dtype=torch.bfloat16, cache_dtype=cache_dtype, device="cuda",
                                    value_magnitude=1e-4)


@pytest.mark.parametrize("cache_dtype", QUANTIZED_KV, ids=str)
@pytest.mark.parametrize("head_dim,splits", [(128, None), (128, 1), (256, None)])
def test_quantized_attention_with_softcap(cache_dtype, head_dim, splits) -> None:
    """Capped scores over a quantized cache (Gemma's attention softcap): decode and a prompt's tiles."""
    cases.check_quantized_attention(triton_ops, specs=[(1, 900), (37, 600), (1, 130)], num_q_heads=16,
                                    num_kv_heads=8, head_dim=head_dim, dtype=torch.bfloat16, cache_dtype=cache_dtype,
                                    device="cuda", num_splits=splits, softcap=5.0)


@pytest.mark.parametrize("cache_dtype", QUANTIZED_KV, ids=str)
@pytest.mark.parametrize("splits", [None, 1])
def test_quantized_attention_over_spread_values(cache_dtype, splits) -> None:
    """Value scales over six decades, and a first tile of zero values: every tile's values weighed
    in the one unit of a split."""
    cases.check_quantized_attention(triton_ops, specs=[(1, 900), (5, 300), (1, 200)], num_q_heads=32,
                                    num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, cache_dtype=cache_dtype,
                                    device="cuda", num_splits=splits, value_decades=3.0, zero_values=130)


def test_rotary_embedding_and_write_kv_casts_to_the_cache_dtype() -> None:
    cases.check_rope_write_kv(triton_ops, num_tokens=50, num_q_heads=8, num_kv_heads=2, head_dim=128,
                              dtype=torch.float32, cache_dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,d", [(1, 14336), (128, 14336), (33, 3072), (7, 300)])
def test_silu_and_mul(dtype, num_tokens, d) -> None:
    cases.check_act_and_mul(triton_ops, act="silu_and_mul", num_tokens=num_tokens, d=d, dtype=dtype, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,d", [(1, 10240), (128, 15360), (33, 21504), (7, 300)])
def test_gelu_tanh_and_mul(dtype, num_tokens, d) -> None:
    cases.check_act_and_mul(triton_ops, act="gelu_tanh_and_mul", num_tokens=num_tokens, d=d, dtype=dtype,
                            device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 7, 40, 300])
def test_linear_gelu_mul(dtype, rows) -> None:
    cases.check_linear_gelu_mul(triton_ops, rows=rows, n=256, k=2560, dtype=dtype, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", cases.GEMV_KINDS)
@pytest.mark.parametrize("n,k,bias", [(4096, 4096, False), (2560, 10240, False), (1000, 300, True)])
def test_fused_gemv(dtype, kind, n, k, bias) -> None:
    cases.check_gemv(triton_ops, kind=kind, n=n, k=k, dtype=dtype, device="cuda", bias=bias)


@pytest.mark.parametrize("kind", ["residual", "norm", "norm_gated", "offset_norm_geglu"])
@pytest.mark.parametrize("n,k", [(4096, 4096), (2560, 10240), (1000, 320)])
@pytest.mark.parametrize("weight_format", ["q8_0", "fp8", "fp8_block"])
def test_fused_gemv_of_packed_weights(kind, n, k, weight_format) -> None:
    cases.check_gemv(triton_ops, kind=kind, n=n, k=k, dtype=torch.bfloat16, device="cuda", bias=False,
                     weight_format=weight_format)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k,bias", [(2, 4096, 4096, False), (64, 14336, 4096, False), (517, 4096, 14336, False),
                                        (33, 1000, 320, True), (100, 1000, 320, True), (128, 4096, 14336, True)])
@pytest.mark.parametrize("weight_format", cases.WEIGHT_FORMATS)
def test_linear_of_several_rows(dtype, m, n, k, bias, weight_format) -> None:
    """Through ``linear`` as the models call it: the few-row matmul (its K split where 128-row tiles
    leave SMs idle, as at 128 rows of 4096 columns), cuBLAS, or FP8 tensor cores (cuBLAS's scaled
    matmul for bfloat16 rows against a scale a row, the Triton one otherwise)."""
    cases.check_matmul(triton_ops, m=m, n=n, k=k, dtype=dtype, device="cuda", bias=bias, weight_format=weight_format)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", [(65, 4096, 4096), (517, 6144, 4096), (2000, 4096, 14336), (300, 1000, 320)])
@pytest.mark.parametrize("weight_format", ["fp8", "fp8_block", "fp8_static"])
def test_fp8_matmul_of_quantized_rows(dtype, m, n, k, weight_format) -> None:
    """The Triton FP8 matmul with its own tile, whatever cuBLAS would take, and the rows' quantization
    value for value."""
    from tokenmill.kernels.triton_fp8 import MATMUL_TILE
    cases.check_quantize_rows(m=m, k=k, dtype=dtype, device="cuda", weight_format=weight_format)
    cases.check_matmul(triton_ops, m=m, n=n, k=k, dtype=dtype, device="cuda", bias=True, weight_format=weight_format,
                       kernel="fp8", tiles=MATMUL_TILE)


@pytest.mark.parametrize("split_k", [1, 2, 4, 8])
@pytest.mark.parametrize("block_m,m,n,k,bias", [(16, 8, 4096, 4096, False), (16, 5, 1000, 14336, True),
                                                (64, 40, 4096, 4096, True), (128, 200, 4096, 4096, True)])
@pytest.mark.parametrize("weight_format", ["q8_0", "dense", "fp8", "fp8_block"])
def test_skinny_matmul_with_k_split(split_k, block_m, m, n, k, bias, weight_format) -> None:
    from tokenmill.kernels.triton_skinny_matmul import LARGE_TILE
    tile = LARGE_TILE if block_m == LARGE_TILE[0] else (block_m, 64, 128, 4, 4)
    for _ in range(2):  # the second launch finds every tile's counter reset by the first
        cases.check_matmul(triton_ops, m=m, n=n, k=k, dtype=torch.bfloat16, device="cuda", bias=bias,
                           weight_format=weight_format,
                           kernel="skinny", tiles=(*tile, split_k))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("hidden,inter,experts,top_k", [(2048, 768, 128, 8), (4096, 14336 // 8, 8, 2), (96, 40, 6, 2)])
def test_fused_experts(dtype, tokens, hidden, inter, experts, top_k) -> None:
    """Qwen3-30B-A3B's experts, Mixtral's (an eighth of its intermediate size), and dimensions ending
    inside tiles."""
    cases.check_fused_experts(triton_ops, tokens=tokens, hidden=hidden, inter=inter, experts=experts, top_k=top_k,
                              dtype=dtype, device="cuda")


def test_skinny_matmul_in_a_cuda_graph_replayed() -> None:
    """Split parts summed by the last program, counters reset, replay after replay."""
    from tokenmill.kernels.triton_skinny_matmul import skinny_matmul
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    weight = q8_0.quantize(torch.randn(4096, 4096, device="cuda") / 64)
    want = reference.linear(x, weight, None)
    skinny_matmul(x, weight, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = skinny_matmul(x, weight, None)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        want = reference.linear(x, weight, None)
        graph.replay()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_fused_gemv_takes_one_row() -> None:
    x = torch.zeros(2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most 1 row"):
        triton_ops.linear_residual(x, torch.zeros(8, 64, device="cuda", dtype=torch.bfloat16), None,
                                   torch.zeros(2, 8, device="cuda", dtype=torch.bfloat16))


def test_pdl_chain_in_cuda_graph() -> None:
    """Kernels launched with programmatic dependent launch start before their predecessor ends; a
    graph of a dependent chain, replayed on fresh inputs, must still equal the chain run in torch."""
    from tokenmill.kernels.triton_launch import pdl_launch_args

    hidden, inter, eps = 4096, 14336, 1e-5
    assert pdl_launch_args(torch.device("cuda"))["PDL"] == (torch.cuda.get_device_capability()[0] >= 9)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    norm_w, w_up, w_down = rand(hidden), rand(2 * inter, hidden, scale=hidden**-0.5), rand(hidden, inter, scale=inter**-0.5)
    x, res = rand(1, hidden), rand(1, hidden)

    def chain(ops) -> torch.Tensor:
        _, stream = ops.rms_norm(x, norm_w, eps, res)
        act = ops.norm_linear(stream, norm_w, eps, w_up, None, gated=True)
        stream = ops.linear_residual(act, w_down, None, stream)
        return ops.rms_norm(stream, norm_w, eps)

    chain(triton_ops)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(triton_ops)
    for _ in range(5):
        x.copy_(rand(1, hidden))
        res.copy_(rand(1, hidden))
        graph.replay()
        assert cases.rel_err(out, chain(reference)) < 2e-2


@pytest.mark.parametrize("rows,vocab,splits", [(64, 151936, None), (5, 128256, None), (300, 32000, None),
                                               (1, 262144, None), (3, 151936, 1), (3, 151936, 64)])
def test_sample(rows: int, vocab: int, splits: int | None) -> None:
    """``splits`` None: as many programs a row as the batch leaves room for (several below 132 rows)."""
    cases.check_sample(triton_ops, rows=rows, vocab=vocab, device="cuda", splits=splits)


def test_sample_compiles_one_variant_for_every_row_count() -> None:
    """The engine's warm-up samples one row and two: a larger batch, one program a row from 133 rows
    on, or a row count that is not a multiple of 4, must run the variants those compiled (dropped
    from memory first, so that none an earlier test compiled hides a new one)."""
    from tokenmill.kernels import triton_sampling

    kernels = (triton_sampling._sample_kernel, triton_sampling._race_parts_kernel)
    loaded = [dict(fn.device_caches) for fn in kernels]

    def variants() -> int:
        return sum(len(caches[0]) for fn in kernels for caches in fn.device_caches.values())

    def run(rows: int) -> None:
        logits = torch.randn(rows, 32000, device="cuda")
        noise = torch.empty_like(logits).exponential_()
        full = functools.partial(torch.full, (rows,), device="cuda")
        triton_ops.sample(logits, noise, full(1.0), full(50, dtype=torch.int64), largest_logits(logits, 50),
                          full(0.9), full(0.0), logits.argmax(dim=-1))

    for fn in kernels:
        fn.device_caches.clear()
    try:
        for rows in (1, 2):
            run(rows)
        compiled = variants()
        assert compiled == 2
        for rows in (3, 5, 133, 134, 135, 201, 256):
            run(rows)
        assert variants() == compiled
    finally:
        for fn, caches in zip(kernels, loaded):
            fn.device_caches.clear()
            fn.device_caches.update(caches)


@pytest.mark.parametrize("rows,vocab", [(64, 151936), (1, 128256), (257, 32000)])
def test_penalties(rows: int, vocab: int) -> None:
    cases.check_penalties(triton_ops, rows=rows, vocab=vocab, device="cuda")


@pytest.mark.parametrize("rows,vocab", [(1, 128256), (1, 262208), (7, 151936), (64, 1009), (130, 262144), (256, 128256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("spans", [None, 1, 8])
def test_argmax_rows(rows: int, vocab: int, dtype: torch.dtype, spans: int | None) -> None:
    """Each row's greedy token at the vocabularies and batches the decode graphs take."""
    cases.check_argmax_rows(triton_ops, rows=rows, vocab=vocab, dtype=dtype, device="cuda", spans=spans)


def test_argmax_rows_compiles_one_variant_a_dtype() -> None:
    """Every row count (so every span count, one span included) runs the variants the first compiled:
    a sampler meeting a new batch size must not wait on Triton inside its step."""
    from tokenmill.kernels import triton_argmax

    def variants() -> int:
        return sum(len(caches[0]) for fn in (triton_argmax._argmax_spans_kernel, triton_argmax._argmax_pick_kernel)
                   for caches in fn.device_caches.values())

    def run(rows: int) -> None:
        logits = torch.randn(rows, 128256, device="cuda", dtype=torch.float16)
        assert torch.equal(triton_ops.argmax_rows(logits), logits.argmax(dim=-1))

    run(3)
    compiled = variants()
    spans = {triton_argmax.row_spans(rows, 128256, torch.device("cuda")) for rows in (1, 40, 100, 200, 300, 700)}
    assert len(spans) >= 4 and 1 in spans  # the row counts below reach one span a row and several counts
    for rows in (1, 40, 100, 200, 300, 700):
        run(rows)
    assert variants() == compiled
