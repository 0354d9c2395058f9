"""Every Triton kernel, launched as its wrapper launches it, compiled for Hopper (sm_90) on the CPU.

The interpreter runs a kernel's Python, not its compilation, so a kernel can pass under
``TRITON_INTERPRET=1`` and still fail to compile (a loop-carried variable whose type changes
across iterations is one such case; it reached the H200 once). Here each ``triton_ops`` wrapper
is called on CPU tensors with the launch intercepted, and every launch it makes is compiled to a
cubin for sm_90 with the same constexprs and options, as Hopper launches it: with programmatic
dependent launch on where the kernel takes it (each such kernel also once with it off, as
``TOKENMILL_PDL=0`` runs it). The variants compile in parallel, one process a core.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import inspect
import multiprocessing
import os
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, JitFunctionInfo  # noqa: E402

from tokenmill.engine.worker.model_runner import warm_up_shapes  # noqa: E402
from tokenmill.engine.worker.prefill_graphs import capture_sizes  # noqa: E402
from tokenmill.kernels import fp8, q8_0, triton_attention, triton_gemv, triton_ops, triton_skinny_matmul  # noqa: E402
from tokenmill.kernels.compile_watch import watch_compiles  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
HOPPER_MAX_SHARED = 232448  # bytes of shared memory one block may take on sm_90 (227 KiB)
LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "launch_pdl", "enable_fp_fusion", "maxnreg"}
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
               torch.int64: "i64", torch.int8: "i8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


def _type_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + DTYPE_NAMES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


@dataclass(frozen=True)
class Launch:
    """One intercepted launch: the kernel, its argument types, constexprs and options."""

    fn: JITFunction
    signature: dict[str, str]
    constexprs: dict[str, Any]
    options: dict[str, Any]

    @classmethod
    def intercepted(cls, fn: JITFunction, args: tuple, kwargs: dict) -> Launch:
        bound = inspect.signature(fn.fn).bind(*args, **{k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
        signature, constexprs = {}, {}
        for param in fn.params:
            value = bound.arguments[param.name]
            # An int argument of 1 is a constant to the JIT (unless told not to specialize on it), as a
            # contiguous stride is: compiled as the GPU compiles it.
            if param.is_constexpr or (type(value) is int and value == 1 and not param.do_not_specialize):
                signature[param.name] = "constexpr"
                constexprs[param.name] = value
            else:
                signature[param.name] = _type_of(value)
        return cls(fn, signature, constexprs, {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS})

    def key(self) -> tuple:
        return (self.fn.__name__, tuple(self.signature.items()), tuple(sorted(self.constexprs.items())),
                tuple(sorted(self.options.items())))

    def with_pdl(self) -> Launch | None:
        if "PDL" not in self.constexprs:
            return None
        return replace(self, constexprs={**self.constexprs, "PDL": True}, options={**self.options, "launch_pdl": True})

    def compile(self) -> Any:
        names = list(self.signature)
        src = ASTSource(fn=self.fn, signature=self.signature,
                        constexprs={(names.index(k),): v for k, v in self.constexprs.items()})
        kernel = triton.compile(src, target=HOPPER, options=self.options)
        # What the driver would refuse at launch (OutOfResources), caught here instead.
        if kernel.metadata.shared > HOPPER_MAX_SHARED:
            raise RuntimeError(f"needs {kernel.metadata.shared} bytes of shared memory; sm_90 has {HOPPER_MAX_SHARED}")
        return kernel


def _launches(monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """Call every wrapper the way the engine does, recording launches instead of running them."""
    seen: dict[tuple, Launch] = {}

    def record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launch = Launch.intercepted(self, args, kwargs)
        seen.setdefault(launch.key(), launch)

    monkeypatch.setattr(JITFunction, "run", record)
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype)

        # Attention: decode (split and not, windowed; one program a whole context takes other tiles
        # in a grid of under two programs an SM, here one KV head) and prefills of 64- and 128-row
        # tiles, over a 4-block cache.
        k_cache, v_cache = rand(4, 16, 2, 128), rand(4, 16, 2, 128)
        tables = torch.arange(4, dtype=torch.int32).view(1, 4)
        for splits, window, kv_heads in ((1, None, 2), (1, None, 1), (4, None, 2), (2, 32, 2)):
            triton_ops.paged_attention(rand(1, 4 * kv_heads, 128), k_cache[:, :, :kv_heads], v_cache[:, :, :kv_heads],
                                       torch.tensor([0, 1], dtype=torch.int32),
                                       torch.tensor([40], dtype=torch.int32), tables, 0.1, window,
                                       num_splits=splits)
        for query_len in (12, 20):  # 64 and 128 rows a program (group 4)
            triton_ops.paged_attention(rand(query_len, 8, 128), k_cache, v_cache,
                                       torch.tensor([0, query_len], dtype=torch.int32),
                                       torch.tensor([50], dtype=torch.int32), tables, 0.1, max_query_len=query_len)
        # Gemma: head dims 256 and 512, GQA groups of 2 and 8; decode (split and not, softcapped,
        # sliding) and prefill-sized queries, which take other tiles; over 8 blocks, so that an unsplit
        # program streams enough keys for head dim 256's deeper decode tile. In
        # float32 (tests only, and slow to compile: IEEE dots) just the prefill at 512, whose K/V tiles
        # are cut to fit.
        gemma = ((256, 4), (256, 16), (512, 16), (512, 4)) if dtype == torch.bfloat16 else ()
        if dtype == torch.float32:
            gk, gv = rand(4, 16, 2, 512), rand(4, 16, 2, 512)
            triton_ops.paged_attention(rand(20, 4, 512), gk, gv, torch.tensor([0, 20], dtype=torch.int32),
                                       torch.tensor([50], dtype=torch.int32), tables, 0.1, 32, max_query_len=20,
                                       softcap=50.0)
        gemma_tables = torch.arange(8, dtype=torch.int32).view(1, 8)
        for head_dim, num_q_heads in gemma:
            gk, gv = rand(8, 16, 2, head_dim), rand(8, 16, 2, head_dim)
            decode_variants = ((1, None, 50.0), (4, 32, 50.0)) if num_q_heads == 4 else ((2, None, None),)
            for splits, window, cap in decode_variants:
                triton_ops.paged_attention(rand(1, num_q_heads, head_dim), gk, gv,
                                           torch.tensor([0, 1], dtype=torch.int32),
                                           torch.tensor([100], dtype=torch.int32), gemma_tables, 0.1, window,
                                           softcap=cap, num_splits=splits)
            triton_ops.paged_attention(rand(20, num_q_heads, head_dim), gk, gv, torch.tensor([0, 20], dtype=torch.int32),
                                       torch.tensor([50], dtype=torch.int32), gemma_tables, 0.1,
                                       32 if num_q_heads == 4 else None, max_query_len=20,
                                       softcap=50.0 if num_q_heads == 16 else None)
        x, weight = rand(3, 256), rand(256)
        for norm in (triton_ops.rms_norm, triton_ops.offset_rms_norm):
            norm(x, weight, 1e-6)
            norm(x, weight, 1e-6, rand(3, 256))
        for weighting in ("offset", "fp32"):
            triton_ops.add_rms_norm(x, weight, 1e-6, rand(3, 256), weighting)
        triton_ops.add_rms_norm(x, weight, 1e-6, rand(3, 256), "fp32", rand(1))  # and a layer scalar
        for weighting in ("offset", "fp32"):
            triton_ops.join_and_norm(x, weight, 1e-6, rand(3, 256), rand(256), weighting)
        triton_ops.fp32_weight_rms_norm(rand(3, 2, 256), weight, 1e-6)
        positions = torch.arange(3)
        cos_sin = torch.randn(64, 128, generator=gen)
        for qk_norm in (False, True):
            norms = (rand(128), rand(128)) if qk_norm else (None, None)
            triton_ops.rotary_embedding_and_write_kv(positions, rand(3, 8, 128), rand(3, 2, 128), rand(3, 2, 128),
                                                     cos_sin, k_cache, v_cache, torch.arange(3), *norms)
        # Gemma's head dims; at 512, 40 q heads take several passes.
        for num_q_heads, num_kv_heads, head_dim in ((16, 8, 256), (40, 4, 512)):
            cs = torch.randn(64, head_dim, generator=gen)
            gk = rand(4, 16, num_kv_heads, head_dim)
            triton_ops.rotary_embedding_and_write_kv(positions, rand(3, num_q_heads, head_dim),
                                                     rand(3, num_kv_heads, head_dim), rand(3, num_kv_heads, head_dim),
                                                     cs, gk, gk.clone(), torch.arange(3), rand(head_dim),
                                                     rand(head_dim), v_norm=head_dim == 512,  # Gemma 4's
                                                     norm_weighting="offset" if head_dim == 256 else "fp32")
            triton_ops.rotary_embedding_query(positions, rand(3, num_q_heads, head_dim), cs, rand(head_dim), 1e-6,
                                              "fp32")
        quantized = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2) if dtype == torch.bfloat16 else ()
        for cache_dtype in quantized:  # a quantized cache, under bf16 queries
            qk, qv = (torch.zeros(4, 16, 2, 128, dtype=cache_dtype) for _ in range(2))
            ks, vs = (torch.zeros(4, 16, 2, dtype=torch.bfloat16) for _ in range(2))
            for kv_amax in (None, torch.ones(2)):  # each token's own magnitudes, or a checkpoint's
                triton_ops.rotary_embedding_and_write_kv(positions, rand(3, 8, 128), rand(3, 2, 128), rand(3, 2, 128),
                                                         cos_sin, qk, qv, torch.arange(3), k_scale=ks, v_scale=vs,
                                                         kv_amax=kv_amax)
            # Decode whole (float8: edge tiles alone masked) and split (every tile masked), over a short
            # range and a long one (a deeper pipeline), and a prompt.
            for query_len, kv_heads, splits, bound in ((1, 2, 1, 64), (1, 2, 4, 64), (1, 1, 1, 64), (1, 2, 1, 4096),
                                                       (1, 2, 4, 4096), (20, 2, 1, 64)):
                triton_ops.paged_attention(rand(query_len, 4 * kv_heads, 128), qk[:, :, :kv_heads], qv[:, :, :kv_heads],
                                           torch.tensor([0, query_len], dtype=torch.int32),
                                           torch.tensor([40], dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32),
                                           0.1, max_query_len=query_len, max_seq_len=bound, num_splits=splits,
                                           k_scale=ks[:, :, :kv_heads], v_scale=vs[:, :, :kv_heads])
        # Head dim 16 (under an integer dot's 32), decode and a prompt's tile.
        qk16, qv16 = (torch.zeros(4, 16, 1, 16, dtype=torch.int8) for _ in range(2))
        for query_len in (1, 20):
            triton_ops.paged_attention(rand(query_len, 4, 16), qk16, qv16, torch.tensor([0, query_len], dtype=torch.int32),
                                       torch.tensor([40], dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32), 0.1,
                                       max_query_len=query_len, num_splits=1, k_scale=ks[:, :, :1], v_scale=vs[:, :, :1])
        moe_weights, moe_ids = torch.rand(5, 2), torch.randint(0, 8, (5, 2), generator=gen)
        triton_ops.fused_experts(rand(5, 256), rand(8, 256, 256), rand(8, 256, 128), moe_ids, moe_weights)
        triton_ops.silu_and_mul(rand(3, 512))
        triton_ops.softcap_(rand(3, 262144), 30.0)
        triton_ops.gelu_tanh_and_mul(rand(3, 512))
        for spans in (1, 8):  # one span a row (its token written directly), and several with the pick
            triton_ops.argmax_rows(rand(3, 151936), spans=spans)
        if dtype == torch.float32:  # sampling reads float32 logits whatever the model's dtype
            _sample(gen, rows=3, vocab=151936)
            _penalties(gen, rows=3, vocab=151936)
        row, proj = rand(1, 4096), rand(64, 4096)
        triton_ops.linear_residual(row, proj, None, rand(1, 64))
        triton_ops.linear_residual(rand(1, 14336), rand(64, 14336), rand(64), rand(1, 64))
        triton_ops.norm_linear(row, rand(4096), 1e-6, proj, rand(64))
        triton_ops.norm_linear(row, rand(4096), 1e-6, proj, None, gated=True)
        triton_ops.linear_gelu_mul(row, proj, rand(1, 64))  # Gemma 4's per-layer input gate
        packed = q8_0.quantize(rand(128, 4096))  # Q8_0 weights: plain, gated, with the residual
        triton_ops.norm_linear(row, rand(4096), 1e-6, packed, None)
        triton_ops.norm_linear(row, rand(4096), 1e-6, packed, None, gated=True)
        triton_ops.linear_residual(row, packed, None, rand(1, 128))
        triton_ops.linear(rand(100, 4096), packed, rand(128))  # Q8_0 past 64 rows: the large tile
        # FP8 weights (in the 16-bit dtypes FP8 checkpoints run in), by rows and 128-column blocks: the GEMV,
        # the few-row matmul (K split too), then rows quantized onto FP8 tensor cores (a static scale too).
        for fp8_weight in (fp8.quantize_rows(rand(128, 4096)), _fp8_blocks(rand(128, 4096))) if dtype != torch.float32 else ():
            triton_ops.norm_linear(row, rand(4096), 1e-6, fp8_weight, None)
            triton_ops.norm_linear(row, rand(4096), 1e-6, fp8_weight, None, gated=True)
            triton_ops.linear_residual(row, fp8_weight, None, rand(1, 128))
            for rows in (8, 40, 100):
                triton_ops.linear(rand(rows, 4096), fp8_weight, rand(128))
            triton_skinny_matmul.skinny_matmul(rand(16, 4096), fp8_weight, None, (16, 64, 128, 4, 4, 2))
            static = fp8.FP8Weight(fp8_weight.qweight, torch.ones(128, 1), None, torch.ones(1))
            triton_ops.linear(rand(100, 4096), static, None)
        for rows in (8, 20, 40):  # a few rows: the few-row matmul (dense up to 32)
            triton_ops.linear(rand(rows, 4096), packed, rand(128))
            triton_ops.linear(rand(rows, 4096), rand(128, 4096), None)
        if dtype == torch.bfloat16:  # K split as on the GPU, whose SMs the split follows (one SM here)
            for weight in (packed, rand(128, 4096)):
                for block_m, splits in ((16, (2, 4, 8)), (32, (2,)), (64, (4,))):
                    for split in splits:
                        triton_skinny_matmul.skinny_matmul(rand(block_m, 4096), weight, None,
                                                           (block_m, 64, 128, 4, 4, split))
        triton_ops.linear(row, proj, None)  # one dense row alone (Gemma's o and down): the GEMV
        if dtype == torch.bfloat16:  # each shape's own tiles and several rows' tiles a program, on small weights
            row_tiles = {("plain",): (4, 2048, 4, 4), ("norm",): (8, 1024, 4, 2), ("gated",): (4, 1024, 4, 8)}
            for (kind, *_), tiles in [*triton_gemv.SHAPE_TILES.items(), *row_tiles.items()]:
                if kind == "plain":
                    triton_gemv._gemv(row, proj, None, tiles=tiles)
                    triton_gemv._gemv(row, proj, None, residual=rand(1, 64), tiles=tiles)
                else:
                    triton_gemv._gemv(row, proj, None, norm_weight=rand(4096), eps=1e-6, gated=kind == "gated",
                                      weighting="offset", activation="gelu_tanh" if kind == "gated" else "silu",
                                      tiles=tiles)
        for weighting in ("offset", "fp32"):
            triton_ops.norm_linear(row, rand(4096), 1e-6, proj, None, weighting=weighting)
            triton_ops.norm_linear(row, rand(4096), 1e-6, proj, None, gated=True, weighting=weighting,
                                   activation="gelu_tanh")
    launches = list(seen.values())
    without_pdl = {launch.fn.__name__: launch for launch in launches if launch.constexprs.get("PDL") is False}
    return [launch.with_pdl() or launch for launch in launches] + list(without_pdl.values())


def _fp8_blocks(weight: torch.Tensor) -> fp8.FP8Weight:
    """``weight`` in FP8 with a scale a row and 128-column block (ones: only the launch matters here)."""
    n, k = weight.shape
    return fp8.FP8Weight(weight.to(fp8.FP8_DTYPE), torch.ones(n, k // 128), 128)


def _sample(gen: torch.Generator, rows: int, vocab: int) -> None:
    logits = torch.randn(rows, vocab, generator=gen)
    row, ids = torch.ones(rows), torch.zeros(rows, dtype=torch.int64)
    for top_k, splits in ((0, 1), (1, 3), (16, 64), (50, 5)):  # largest values the rows have; programs a row
        triton_ops.sample(logits, torch.ones(rows, vocab), row, ids, logits[:, :top_k].contiguous(), row, row, ids,
                          splits=splits)


def _penalties(gen: torch.Generator, rows: int, vocab: int) -> None:
    row = torch.ones(rows)
    triton_ops.apply_penalties(torch.randn(rows, vocab, generator=gen), torch.zeros(4, vocab),
                               torch.zeros(4, vocab, dtype=torch.bool), torch.zeros(rows, dtype=torch.int64), row, row, row)


def test_every_kernel_compiles_for_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    launches = _launches(monkeypatch)
    monkeypatch.undo()
    names = {launch.fn.__name__ for launch in launches}
    assert {"_paged_attention_kernel", "_merge_splits_kernel", "_rms_norm_kernel", "_rope_write_kv_kernel",
            "_act_and_mul_kernel", "_gemv_kernel", "_skinny_matmul_kernel", "_sample_kernel",
            "_race_parts_kernel", "_penalties_kernel", "_softcap_kernel", "_argmax_spans_kernel",
            "_argmax_pick_kernel", "_quantize_rows_kernel", "_fp8_matmul_kernel", "_moe_matmul_kernel"} <= names, names
    variants = {(launch.fn.__name__, key, launch.constexprs.get(key)) for launch in launches for key in
                ("SOFTCAP", "WEIGHTING", "GELU_TANH", "BLOCK_D", "BLOCK_M", "ADD_AFTER", "GELU")}
    assert {("_paged_attention_kernel", "SOFTCAP", True), ("_paged_attention_kernel", "BLOCK_D", 512),
            ("_paged_attention_kernel", "BLOCK_M", 64), ("_paged_attention_kernel", "BLOCK_M", 128),
            ("_rms_norm_kernel", "ADD_AFTER", True), ("_act_and_mul_kernel", "GELU_TANH", True),
            ("_rope_write_kv_kernel", "BLOCK_D", 512), ("_gemv_kernel", "GELU", True)} <= variants
    assert {("_paged_attention_kernel", "KV_SCALED", True), ("_paged_attention_kernel", "DOT_F16", True),
            ("_rope_write_kv_kernel", "QUANTIZED", True),
            ("_rope_write_kv_kernel", "STATIC_AMAX", True), ("_rms_norm_kernel", "SCALE_AFTER", True),
            ("_gemv_kernel", "PTX", True), ("_gemv_kernel", "ACT_MUL", True),
            ("_quantize_rows_kernel", "GROUPED", True), ("_quantize_rows_kernel", "STATIC", True),
            ("_quantize_rows_kernel", "STATIC", False), ("_fp8_matmul_kernel", "BLOCKS", True),
            ("_fp8_matmul_kernel", "BLOCKS", False), ("_moe_matmul_kernel", "GATED", True),
            ("_moe_matmul_kernel", "GATED", False),
            ("_paged_attention_kernel", "PTX", True), ("_rope_write_kv_kernel", "PTX", True),
            ("_rope_write_kv_kernel", "V_NORM", True)} <= {
        (launch.fn.__name__, key, launch.constexprs.get(key)) for launch in launches
        for key in ("KV_SCALED", "DOT_F16", "QUANTIZED", "STATIC_AMAX", "SCALE_AFTER", "PTX", "ACT_MUL",
                    "V_NORM", "GROUPED", "STATIC", "BLOCKS", "GATED")}
    formats = {(launch.fn.__name__, launch.constexprs["FORMAT"]) for launch in launches if "FORMAT" in launch.constexprs}
    assert {(kernel, fmt) for kernel in ("_gemv_kernel", "_skinny_matmul_kernel") for fmt in range(4)} <= formats
    decode_masks = {(launch.constexprs["DOT_F16"], launch.constexprs["MASK_EDGES_ONLY"]) for launch in launches
                    if launch.fn.__name__ == "_paged_attention_kernel" and launch.constexprs["BLOCK_M"] < 64}
    assert {(True, True), (True, False), (False, False)} <= decode_masks, decode_masks
    # Decode tiles' pipeline depths: (one-byte cache, head dim, stages).
    decode_depths = {(launch.constexprs["DOT_F16"], launch.constexprs["BLOCK_D"], launch.options["num_stages"])
                     for launch in launches
                     if launch.fn.__name__ == "_paged_attention_kernel" and launch.constexprs["BLOCK_M"] < 64}
    assert {(True, 128, 3), (True, 128, 5), (False, 256, 2), (False, 256, 5), (False, 512, 2)} <= decode_depths, \
        decode_depths
    for kernel, weightings in (("_rms_norm_kernel", {0, 1, 2}), ("_rope_write_kv_kernel", {0, 1, 2}),
                               ("_gemv_kernel", {0, 1, 2})):
        assert {(kernel, "WEIGHTING", w) for w in weightings} <= variants, kernel
    failures = [failure for failure in _compile_all(launches) if failure]
    assert not failures, "\n\n".join(failures)


_TO_COMPILE: list[Launch] = []


def _compile_one(index: int) -> str | None:
    launch = _TO_COMPILE[index]
    try:
        launch.compile()
    except Exception as exc:  # every failing variant is reported, not just the first
        return f"{launch.fn.__name__} {launch.constexprs} {launch.options}: {str(exc)[-600:]}"
    return None


def _compile_all(launches: list[Launch]) -> list[str | None]:
    """Each launch compiled (``None``) or its failure, in forked processes, one a core: Triton's compiler
    runs on one thread, and the variants are hundreds."""
    _TO_COMPILE[:] = launches
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=context) as pool:
        return list(pool.map(_compile_one, range(len(launches)), chunksize=2))


def test_an_attention_tiles_register_cap_reaches_the_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tile's fifth field caps a thread's registers (how many programs an SM holds): the launch
    carries it as ``maxnreg`` and the sm_90 code is built under it; a cap of 0 leaves it out."""
    launches: list[Launch] = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kwargs:
                        launches.append(Launch.intercepted(self, args, kwargs)))
    cache = torch.zeros(4, 16, 2, 128).to(torch.float8_e4m3fn)
    scales = torch.ones(4, 16, 2, dtype=torch.float32)
    for cap in (0, 128):
        monkeypatch.setattr(triton_attention, "_tile_config", lambda *_, cap=cap: (16, 128, 8, 2, cap))
        triton_ops.paged_attention(torch.zeros(1, 8, 128, dtype=torch.bfloat16), cache, cache,
                                   torch.tensor([0, 1], dtype=torch.int32), torch.tensor([40], dtype=torch.int32),
                                   torch.arange(4, dtype=torch.int32).view(1, 4), 0.1, k_scale=scales,
                                   v_scale=scales)
    monkeypatch.undo()
    uncapped, capped = [launch for launch in launches if launch.fn.__name__ == "_paged_attention_kernel"]
    assert "maxnreg" not in uncapped.options and capped.options["maxnreg"] == 128
    assert ".maxnreg 128" in capped.compile().asm["ptx"]


@pytest.mark.parametrize("block_d,block_m", [(128, 16), (256, 16), (512, 16), (256, 64)])
def test_a_split_decode_grid_stops_at_two_programs_an_sm(monkeypatch: pytest.MonkeyPatch, block_d: int,
                                                         block_m: int) -> None:
    """The KV split count: one split once the grid fills the SMs (one program each at head dims up to
    128 and for prompt tiles, two otherwise); below that as many splits as bring the grid to two
    programs an SM (a prompt's to four), never past it, never under 64 keys a split, never past the cap."""
    sms = 132
    most = sms * (4 if block_m >= 64 else 2)
    monkeypatch.setattr(triton_attention, "num_sms", lambda device: sms)
    one_a_sm_enough = block_d <= 128 or block_m >= 64
    for units in (1, 4, 8, 32, 64, 100, 131, 132, 200, 263, 264, 512):
        for context in (64, 192, 1024, 4096, 131072):
            splits = triton_attention._choose_num_splits(units, context, torch.device("cpu"), block_d, block_m)
            if one_a_sm_enough and units >= sms:
                assert splits == 1
                continue
            assert 1 <= splits <= triton_attention._MAX_SPLITS
            assert splits == 1 or (units * splits <= most and splits * 64 <= context)
            more = splits + 1
            assert units * more > most or more * 64 > context or more > triton_attention._MAX_SPLITS


def test_kv_splits_is_the_split_count_a_launch_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kv_splits`` (from which the prefill graphs learn which sizes split a long context's ranges)
    gives the split count ``paged_attention`` launches with, for decode rows, new prompts and chunks
    deep into a context."""
    launched: list[tuple] = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **k: launched.append((self.__name__, grid)))
    monkeypatch.setattr(triton_attention, "num_sms", lambda device: 132)
    kv_heads, heads = 8, 32
    k_cache = torch.empty(2, 16, kv_heads, 128, dtype=torch.bfloat16)
    counts = set()
    for tokens, context in ((1, 4096), (16, 16), (128, 128), (128, 8192), (512, 4096), (2048, 8192)):
        launched.clear()
        triton_ops.paged_attention(torch.empty(tokens, heads, 128, dtype=torch.bfloat16), k_cache, k_cache,
                                   torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([context], dtype=torch.int32),
                                   torch.zeros(1, context // 16, dtype=torch.int32), 0.1, max_query_len=tokens,
                                   max_seq_len=context)
        grid = next(grid for name, grid in launched if name == "_paged_attention_kernel")
        splits = triton_ops.kv_splits(k_cache, heads, tokens, tokens, context)
        assert grid[1] == kv_heads * splits
        assert any(name == "_merge_splits_kernel" for name, _ in launched) == (splits > 1)
        counts.add(splits)
    assert 1 in counts and max(counts) > 1


def test_decode_masks_only_the_edge_tiles_of_a_whole_float8_range() -> None:
    """Prompt tiles always take the loop that masks only their edge tiles; decode tiles only over a
    float8 cache with no KV split (the one place it measured faster)."""
    rule = triton_attention._mask_edges_only
    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert rule(16, kv_dtype, 1) and rule(32, kv_dtype, 1)
        assert not rule(16, kv_dtype, 4)
    for kv_dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int8):
        assert not rule(16, kv_dtype, 1) and not rule(32, kv_dtype, 2)
    for kv_dtype in (torch.bfloat16, torch.int8, torch.float8_e4m3fn):
        assert rule(64, kv_dtype, 1) and rule(128, kv_dtype, 3)


def _specialization(fn: JITFunction, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles a variant for: the constexprs, the options, each tensor's dtype, and each
    integer's class (1, a multiple of 16, or other) unless the kernel says not to specialise on it."""
    bound = inspect.signature(fn.fn).bind(*args, **{k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    key = [fn.__name__, tuple(sorted((k, v) for k, v in kwargs.items() if k in LAUNCH_OPTIONS))]
    for param in fn.params:
        value = bound.arguments[param.name]
        if param.is_constexpr:
            key.append((param.name, value))
        elif isinstance(value, torch.Tensor):
            key.append((param.name, value.dtype))
        elif isinstance(value, int) and not isinstance(value, bool) and not param.do_not_specialize:
            key.append((param.name, value == 1, value % 16 == 0))
    return tuple(key)


@pytest.mark.parametrize("group,kv_heads,head_dim,kv_dtype", [
    (1, 32, 128, torch.bfloat16), (2, 8, 128, torch.bfloat16), (4, 8, 128, torch.bfloat16),
    (8, 8, 128, torch.bfloat16), (4, 1, 128, torch.bfloat16), (2, 2, 16, torch.bfloat16),
    (2, 8, 256, torch.bfloat16), (2, 4, 256, torch.bfloat16), (2, 8, 512, torch.bfloat16), (8, 2, 512, torch.bfloat16),
    (4, 8, 128, torch.float8_e4m3fn)])
def test_the_warm_up_compiles_every_attention_variant_a_prefill_step_takes(
        monkeypatch: pytest.MonkeyPatch, group: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> None:
    """Any step that carries a chunk (eager past the prefill graphs, or for prompt logprobs) must find
    its attention variant compiled at start-up, by the warm-up or the prefill graphs' captures: chunks
    of any length at any depth, alone, beside other chunks or beside decode rows, on an H200's 132 SMs."""
    seen: set[tuple] = set()

    def record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        seen.add(_specialization(self, args, kwargs))

    monkeypatch.setattr(JITFunction, "run", record)
    monkeypatch.setattr(triton_attention, "num_sms", lambda device: 132)
    block_size = 16
    k_cache = torch.empty(2, block_size, kv_heads, head_dim, dtype=kv_dtype)
    scales = (torch.ones(2, block_size, kv_heads), torch.ones(2, block_size, kv_heads)) \
        if kv_dtype.itemsize == 1 else (None, None)

    def step(seqs: list[tuple[int, int]], width: int | None = None, max_seq_len: int | None = None,
             num_splits: int | None = None) -> None:  # (query tokens, context) a sequence
        lens = torch.tensor([q for q, _ in seqs])
        start = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        start[1:] = torch.cumsum(lens, 0)
        tables = torch.zeros(len(seqs), width or -(-max(c for _, c in seqs) // block_size), dtype=torch.int32)
        triton_ops.paged_attention(torch.empty(int(start[-1]), group * kv_heads, head_dim, dtype=torch.bfloat16),
                                   k_cache, k_cache, start, torch.tensor([c for _, c in seqs], dtype=torch.int32),
                                   tables, 0.1, max_query_len=int(lens.max()),
                                   max_seq_len=max_seq_len or max(c for _, c in seqs),
                                   k_scale=scales[0], v_scale=scales[1], num_splits=num_splits)

    rng = random.Random(group * kv_heads * head_dim)
    for budget, max_len, max_seqs in ((4096, 8192, 256), (512, 2048, 8)):
        seen.clear()
        for q, context, rows in warm_up_shapes(budget, max_len, max_seqs):
            step([(q, context)] + [(1, 1)] * rows)
        # As captured: the first sequence holds the query, the others are empty; a lone sequence's
        # graphs over a whole context, and where ranges of the longest context split, split for it.
        for size in capture_sizes(budget, 1):
            step([(size, size)], width=max_len // block_size, num_splits=1)
            if triton_ops.kv_splits(k_cache, group * kv_heads, size, size, max_len) > 1:
                step([(size, size)], width=max_len // block_size, max_seq_len=max_len)
        for size in capture_sizes(budget, max_seqs):
            step([(size, size)] + [(0, 0)] * (max_seqs - 1), width=max_len // block_size)
        warm = set(seen)
        for _ in range(300):
            chunks = [rng.choice((rng.randint(2, 40), rng.randint(2, budget))) for _ in range(rng.choice((1, 1, 2, 3)))]
            room = min(budget - sum(chunks), max_seqs - len(chunks))
            if room < 0:
                continue
            decode = rng.choice((0, rng.randint(0, min(room, 8)), rng.randint(0, room)))
            seqs = [(q, rng.randint(q, max_len)) for q in chunks] + [(1, rng.randint(1, max_len)) for _ in range(decode)]
            step(seqs)
            new = seen - warm
            nearest = {key: max(warm, key=lambda w: len(set(w) & set(key))) for key in new}
            assert not new, (f"a step of {[q for q, _ in seqs[:3]]} … ({len(seqs)} sequences) compiles anew, "
                             "differing from the nearest warm variant in: "
                             f"{[sorted(map(str, set(key) - set(near))) for key, near in nearest.items()]}")


def test_the_batch_shape_makes_no_new_kernel_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's step must not compile: block tables of any width and any split count (both change
    with every batch) and any row count of a Q8_0 projection reuse one variant per kernel, within a
    query-length class, whether KV ranges are split at all, the merge's split class (up to 8 splits, or
    more) and the few-row matmul's row-tile class (up to 16 rows, or past 64)."""
    seen: dict[str, set[tuple]] = {}

    def record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        seen.setdefault(self.__name__, set()).add(_specialization(self, args, kwargs))

    monkeypatch.setattr(JITFunction, "run", record)
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(40, 16, 2, 128, generator=gen).bfloat16() for _ in range(2))
    for width in (1, 3, 16, 32):
        tables = torch.arange(2 * width, dtype=torch.int32).view(2, width)
        for splits in (2, 3, 16, 64):
            triton_ops.paged_attention(torch.randn(3, 8, 128, generator=gen).bfloat16(), k_cache, v_cache,
                                       torch.tensor([0, 2, 3], dtype=torch.int32),
                                       torch.tensor([width * 16, 5], dtype=torch.int32), tables, 0.1,
                                       max_query_len=2, num_splits=splits)
    packed = q8_0.quantize(torch.randn(128, 256, generator=gen).bfloat16())
    for rows in (2, 9, 16, 65, 100, 128, 300):  # the few-row matmul's first row tile, then its large one
        triton_ops.linear(torch.randn(rows, 256, generator=gen).bfloat16(), packed, None)
    for rows in (1, 7, 64):
        _sample(gen, rows, 5000)
        _penalties(gen, rows, 1000)
    assert {name: len(keys) for name, keys in seen.items()} == {
        "_paged_attention_kernel": 1, "_merge_splits_kernel": 2, "_skinny_matmul_kernel": 2,
        "_sample_kernel": 1,
        "_race_parts_kernel": 1, "_penalties_kernel": 1}


def test_linear_leaves_layouts_the_few_row_matmul_cannot_read_to_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows or a dense weight whose elements are not contiguous along K go to cuBLAS, whose answer
    is right for any layout; contiguous ones to the few-row matmul."""
    launched: list[str] = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **k: launched.append(self.__name__))
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(8, 64, generator=gen), torch.randn(64, 96, generator=gen)
    want = x @ weight
    got = triton_ops.linear(x, weight.t(), None)  # a transposed view: K is its rows' stride
    assert not launched and torch.allclose(got, want, atol=1e-5)
    got = triton_ops.linear(x.t().contiguous().t(), weight.t().contiguous(), None)  # K strided in x
    assert not launched and torch.allclose(got, want, atol=1e-5)
    triton_ops.linear(x, weight.t().contiguous(), None)
    assert launched == ["_skinny_matmul_kernel"]


def test_the_few_row_matmul_keeps_every_counter_array_a_graph_may_hold() -> None:
    """A launch with more split tiles than the counters hold gets a longer array; the shorter one
    stays alive (a CUDA graph captured with it still reads it), and both start zeroed."""
    from tokenmill.kernels import triton_skinny_matmul as skinny

    device = torch.device("cpu")
    skinny._counters.pop(device, None)
    first = skinny._tile_counters(device, 10)
    assert skinny._tile_counters(device, first.numel()) is first
    longer = skinny._tile_counters(device, first.numel() + 1)
    assert longer.numel() > first.numel() and not longer.any()
    assert [id(c) for c in skinny._counters[device]] == [id(first), id(longer)]
    skinny._counters.pop(device)


def test_the_few_row_matmul_makes_no_counters_inside_a_graph_capture(monkeypatch) -> None:
    """Counters made inside a capture would be zeroed only when that graph replays, and eager launches
    would read them first: the launch refuses, and the capture is done again after an eager run
    (``cuda_graphs.capture_each``). Counters made before it serve the capture."""
    from tokenmill.kernels import triton_skinny_matmul as skinny

    device = torch.device("cuda", 0)  # nothing is allocated on it: the counters are given or refused
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setitem(skinny._counters, device, [])
    with pytest.raises(RuntimeError, match="outside a CUDA graph capture"):
        skinny._tile_counters(device, 10)
    made = torch.zeros(1 << 12, dtype=torch.int32)
    skinny._counters[device].append(made)
    assert skinny._tile_counters(device, 10) is made
    with pytest.raises(RuntimeError, match="outside a CUDA graph capture"):
        skinny._tile_counters(device, made.numel() + 1)


def _compile_merge_kernel() -> Any:
    """Triton's cache hook called, as Triton calls it before it compiles a variant (or loads one from
    disk), for the split merge; its answer (a true one would skip the compile)."""
    kernel = triton_attention._merge_splits_kernel
    return triton.knobs.runtime.jit_cache_hook(
        key="key", repr="repr", fn=JitFunctionInfo(kernel.fn.__module__, kernel.fn.__qualname__, kernel), compile={},
        is_manual_warmup=False, already_compiled=False)


def test_the_compile_watcher_hears_each_compile_and_lets_it_go_ahead() -> None:
    heard: list[tuple[str, str]] = []
    watch_compiles(lambda kernel, variant: heard.append((kernel, variant)))
    try:
        assert not _compile_merge_kernel()
        assert heard == [("_merge_splits_kernel", "repr")]
    finally:
        watch_compiles(None)
    assert triton.knobs.runtime.jit_cache_hook is None


def test_the_compile_watcher_keeps_no_engine_alive() -> None:
    """The process-wide hook holds a bound method weakly: an engine dropped by its user frees its KV
    cache, and the hook then does nothing."""
    import gc
    import weakref

    class Engine:
        compiles = 0

        def count(self, kernel: str, variant: str) -> None:
            self.compiles += 1

    engine = Engine()
    watch_compiles(engine.count)
    try:
        _compile_merge_kernel()
        assert engine.compiles == 1
        gone = weakref.ref(engine)
        del engine
        gc.collect()
        assert gone() is None
        assert not _compile_merge_kernel()
    finally:
        watch_compiles(None)


def _study_with_launches_recorded(name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[Launch]]:
    """``benchmarks/studies/<name>.py`` loaded as a module, and the list its kernels' launches go to from now on
    (recorded, not run)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "studies" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    launches: list[Launch] = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kwargs:
                        launches.append(Launch.intercepted(self, args, kwargs)))
    return study, launches


def test_the_l2_prefetch_studys_kernel_asks_for_whole_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/studies/study_l2_prefetch.py``'s prefetch is inline PTX (no interpreter runs it): it must
    assemble for sm_90 and ask the L2 for the bytes with bulk prefetches, not load them."""
    study, launches = _study_with_launches_recorded("study_l2_prefetch", monkeypatch)
    study.prefetch_l2(torch.zeros(4096, 4096, dtype=torch.bfloat16), 16 << 20)
    ptx = launches[0].compile().asm["ptx"]
    assert "cp.async.bulk.prefetch.L2.global" in ptx and "ld.global" not in ptx


def test_the_prompt_attention_studys_tiles_compile_for_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tile ``benchmarks/studies/study_prompt_attention.py`` times, at Llama-3-8B's heads in bf16, compiles
    for sm_90 within its shared memory: a tile too large fails here, not on the GPU."""
    study, launches = _study_with_launches_recorded("study_prompt_attention", monkeypatch)
    q, k, v = study.inputs(300, study.HEADS, "cpu", torch.bfloat16)
    for tile in study.TILES:
        study.prompt_attention(q, k, v, torch.empty_like(q), tile)
    assert len(launches) == len(study.TILES)
    for launch in launches:
        launch.compile()
