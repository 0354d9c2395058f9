"""A kernel's sm_90 machine code, counted by instruction, without a GPU.

Calls a kernel wrapper the way the engine does on the CPU, intercepts the launch, compiles it for
Hopper with the divisibility hints the JIT derives on the GPU (16-byte-aligned pointers, integer
arguments divisible by 16 outside ``do_not_specialize``), and prints the SASS instruction mix, the
registers and the stack (spills), how many programs an SM holds at once (by registers, warps and
shared memory), and the instruction mix of each long loop's body (a streaming kernel's
iteration). With the GPU image's Triton first on the path (a Triton of another version compiles
other code), it is what the GPU runs; reading a loop's loads and conversions here comes before
timing a change on the GPU:

    pip install --no-deps --target /tmp/triton-gpu triton==<the GPU's version>
    PYTHONPATH=/tmp/triton-gpu python benchmarks/profile/kernel_sass.py attention --kv int8 [--batch 64] [--query 1] \
        [--head-dim 128] [--sass FILE]
    PYTHONPATH=/tmp/triton-gpu python benchmarks/profile/kernel_sass.py gemv --q8
    PYTHONPATH=/tmp/triton-gpu python benchmarks/profile/kernel_sass.py skinny [--q8] [--rows 8]
    PYTHONPATH=/tmp/triton-gpu python benchmarks/profile/kernel_sass.py rope --kv int8
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "kernels"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies"))  # study_attention_tiles
from study_attention_tiles import force_tile  # noqa: E402
from test_triton_compile import HOPPER, LAUNCH_OPTIONS, Launch  # noqa: E402

from tokenmill.kernels import (  # noqa: E402
    q8_0,
    triton_attention,
    triton_gemv,
    triton_ops,
    triton_rotary,
    triton_skinny_matmul,
)
from tokenmill.loader.kv_layout import kv_scale_dtype  # noqa: E402

KV_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def intercept(kernel: str, call) -> tuple[JITFunction, tuple, dict]:
    """The first launch of ``kernel`` that ``call()`` makes, not run."""
    calls = []
    run = JITFunction.run

    def record(self: JITFunction, *args, grid, warmup, **kwargs):
        calls.append((self, args, kwargs))

    JITFunction.run = record
    try:
        call()
    finally:
        JITFunction.run = run
    return next(c for c in calls if c[0].__name__ == kernel)


def compile_for_hopper(fn: JITFunction, args: tuple, kwargs: dict) -> triton.compiler.CompiledKernel:
    launch = Launch.intercepted(fn, args, kwargs)
    bound = inspect.signature(fn.fn).bind(*args, **{k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    attrs = {}
    for i, param in enumerate(fn.params):
        value = bound.arguments[param.name]
        aligned = (isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0) or (
            type(value) is int and value % 16 == 0 and param.name not in fn.do_not_specialize)
        if not param.is_constexpr and aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    names = list(launch.signature)
    src = triton.compiler.ASTSource(fn=fn, signature=launch.signature, attrs=attrs,
                                    constexprs={(names.index(k),): v for k, v in launch.constexprs.items()})
    print(fn.__name__, launch.constexprs, launch.options)
    return triton.compile(src, target=HOPPER, options=launch.options)


# An sm_90 SM's registers, shared memory (bytes; the driver keeps 1 KB of it a block) and resident warps.
SM_REGISTERS, SM_SHARED, SM_WARPS = 65536, 233472, 64


def occupancy(kernel: triton.compiler.CompiledKernel, regs: int) -> str:
    """How many programs of this kernel an SM holds at once, and what bounds it: a latency-bound loop
    hides its loads only behind the other warps resident beside it."""
    warps, shared = kernel.metadata.num_warps, kernel.metadata.shared
    regs = -(-regs // 8) * 8  # a thread's registers are allocated 8 at a time
    bounds = {"registers": SM_REGISTERS // (regs * 32 * warps), "warps": SM_WARPS // warps,
              "shared memory": SM_SHARED // (shared + 1024)}
    limit = min(bounds, key=bounds.get)
    return (f"shared memory {shared} bytes a program; {bounds[limit]} programs ({bounds[limit] * warps} warps) an SM, "
            f"bound by {limit} (" + ", ".join(f"{k} {v}" for k, v in bounds.items()) + ")")


# Loops shorter than this are waits and scans, not a kernel's streaming loop: not reported.
_LOOP_SHOWN = 64
_INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")


def opcodes(lines: list[str]) -> collections.Counter:
    """Each opcode's count in these lines of ``nvdisasm`` output (a predicate in front is not one)."""
    return collections.Counter(m.group(1) for line in lines if (m := _INSTRUCTION.match(line)))


def loops(sass: str) -> list[collections.Counter]:
    """The opcodes of each loop's body, longest first: the lines from a label to the last branch back to
    it. A streaming kernel's time is its main loop's, so its instructions an iteration are what a change
    to the loop moves, where the whole kernel's count also holds the prologue and epilogue. A kernel
    may have several (the attention's masked edge tiles and unmasked middle ones): which one runs the
    most iterations is not in the code."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    ends: dict[str, int] = {}
    for i, line in enumerate(lines):
        m = re.search(r"BRA\b.*`\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            ends[m.group(1)] = i
    bodies = [opcodes(lines[labels[label]:end + 1]) for label, end in ends.items()]
    return sorted(bodies, key=lambda body: -sum(body.values()))


def report(kernel: triton.compiler.CompiledKernel, sass_out: str | None) -> None:
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        sass = subprocess.run([tools / "nvdisasm", "-c", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tools / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout.strip().splitlines()[-1]
    finally:
        os.unlink(f.name)
    ops = opcodes(sass.splitlines())
    print(f"Triton {triton.__version__}: {sum(ops.values())} instructions; {usage.strip()[:60]}")
    print(occupancy(kernel, int(re.search(r"REG:(\d+)", usage).group(1))))
    for op, count in ops.most_common(30):
        print(f"  {count:5d} {op}")
    for loop in [body for body in loops(sass) if sum(body.values()) >= _LOOP_SHOWN][:3]:
        print(f"loop: {sum(loop.values())} instructions an iteration")
        for op, count in loop.most_common(20):
            print(f"  {count:5d} {op}")
    if sass_out:
        Path(sass_out).write_text(sass)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=["attention", "gemv", "skinny", "rope"])
    parser.add_argument("--kv", choices=list(KV_DTYPES), default="bf16", help="attention, rope: the cache's dtype")
    parser.add_argument("--batch", type=int, default=64, help="attention: decode sequences (the tile follows)")
    parser.add_argument("--query", type=int, default=1, help="attention: query tokens a sequence (a prefill chunk)")
    parser.add_argument("--head-dim", type=int, default=128, help="attention: the heads' size (8 KV heads, group 4)")
    parser.add_argument("--tile", help="attention: force BLOCK_M,BLOCK_N,num_warps,num_stages[,max registers a thread] (else the engine's)")
    parser.add_argument("--q8", action="store_true", help="gemv, skinny: a Q8_0 weight (Llama-3-8B's gate|up shape)")
    parser.add_argument("--rows", type=int, default=None,
                        help="skinny: activation rows (the tile follows; default 8)")
    parser.add_argument("--sms", type=int, default=132, help="attention, skinny: the GPU's SMs, which the tile and split follow")
    parser.add_argument("--sass", help="write the whole disassembly here")
    args = parser.parse_args()
    if args.kernel == "attention":  # Llama-3-8B's heads over 8k-token contexts, one decode token each
        heads, dim, dtype = 8, args.head_dim, KV_DTYPES[args.kv]
        cache = torch.zeros(40, 16, heads, dim, dtype=dtype)
        scales = {} if dtype == torch.bfloat16 else {
            "k_scale": torch.zeros(40, 16, heads, dtype=kv_scale_dtype(dim)),
            "v_scale": torch.zeros(40, 16, heads, dtype=kv_scale_dtype(dim))}
        batch = args.batch
        triton_attention.num_sms = lambda device: args.sms  # choose as on the GPU, not as on the CPU (one SM)
        if args.tile:
            tile = tuple(int(v) for v in args.tile.split(","))
            force_tile(tile)

        q = args.query

        def call() -> None:
            triton_ops.paged_attention(torch.zeros(batch * q, 4 * heads, dim, dtype=torch.bfloat16), cache, cache,
                                       torch.arange(0, batch * q + 1, q, dtype=torch.int32),
                                       torch.full((batch,), 300, dtype=torch.int32),
                                       torch.zeros(batch, 20, dtype=torch.int32), 0.1, max_query_len=q,
                                       max_seq_len=8192, **scales)
        launch = intercept("_paged_attention_kernel", call)
    elif args.kernel == "rope":  # Llama-3-8B's RoPE and KV write for one decode token
        dtype = KV_DTYPES[args.kv]
        cache = torch.zeros(40, 16, 8, 128, dtype=dtype)
        scales = {} if dtype == torch.bfloat16 else {"k_scale": torch.zeros(40, 16, 8, dtype=kv_scale_dtype(128)),
                                                     "v_scale": torch.zeros(40, 16, 8, dtype=kv_scale_dtype(128))}
        launch = intercept("_rope_write_kv_kernel", lambda: triton_rotary.rotary_embedding_and_write_kv(
            torch.zeros(1, dtype=torch.int64), torch.zeros(1, 32, 128).bfloat16(), torch.zeros(1, 8, 128).bfloat16(),
            torch.zeros(1, 8, 128).bfloat16(), torch.zeros(64, 128).bfloat16(), cache, cache,
            torch.zeros(1, dtype=torch.int64), **scales))
    elif args.kernel == "skinny":  # Llama-3-8B's o (dense or Q8_0): the split the GPU's SMs give it
        weight = torch.randn(4096, 4096).bfloat16()
        weight = q8_0.quantize(weight) if args.q8 else weight
        triton_skinny_matmul.num_sms = lambda device: args.sms
        launch = intercept("_skinny_matmul_kernel", lambda: triton_skinny_matmul.skinny_matmul(
            torch.randn(args.rows or 8, 4096).bfloat16(), weight, None))
    else:
        n, k = 28672, 4096
        weight = torch.randn(n, k).bfloat16()
        launch = intercept("_gemv_kernel", lambda: triton_gemv._gemv(torch.randn(1, k).bfloat16(),
                                                                     q8_0.quantize(weight) if args.q8 else weight, None))
    report(compile_for_hopper(*launch), args.sass)


if __name__ == "__main__":
    main()
