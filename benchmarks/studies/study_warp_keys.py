"""Decode attention over an int8 cache with each warp owning its keys, against one tile whose keys the
warps share (the engine's decode tile, ``triton_attention``).

In the engine's decode tile (16 query rows, 128 keys, 4 warps) the scores' dot leaves each warp 32 of
a tile's keys, so every tile takes each row's maximum across the warps and sends the probabilities
through shared memory to every warp for the values' dot: five barriers an iteration in the sm_90
code of this file's ``tile`` kernel. The ``warp_keys`` kernel gives each warp its own 32 keys for
both dots (3-D dots, the warp index the batch dimension): two barriers, no maximum across warps, but
each warp keeps an accumulator for all 128 dims (four times the registers and the rescaling
multiplies), merged across the warps once at the end.

Both kernels here are the engine's loop reduced to what this question needs: int8 query and keys
(integer dots), each key's scale on its scores and each value's scale on its probability, values
converted to float16 (``to_f16``), the online softmax in base 2; the cache contiguous per program (no
block table) and no masks (whole tiles). Timed with ``triton.testing.do_bench`` beside the floor (the
K and V bytes and their scales over the copy bandwidth measured in the same call), at the quantized-KV
benchmark's batch (64 sequences x 8 KV heads over 8k keys) and the KV-bound workload's (85 x 8 over
1,280).

    TRITON_INTERPRET=1 python benchmarks/studies/study_warp_keys.py --check   # both kernels on the CPU
    PYTHONPATH=<the GPU's Triton> python benchmarks/studies/study_warp_keys.py --sass   # their sm_90 loops, no GPU
    python benchmarks/studies/study_warp_keys.py [--out study-warp-keys.json]          # GPU
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from tokenmill.bench.hardware import measure_ceilings, write_rows
from tokenmill.kernels.triton_convert import to_f16

PTX = os.environ.get("TRITON_INTERPRET") != "1"
ROWS, KEYS, DIMS, WARPS = 16, 128, 128, 4  # the engine's one-byte decode tile at head dim 128
# With its addresses known ahead (no block table) a load is pipelined two tiles ahead at 3 stages: the
# shared memory of the engine's 5-stage tile, two programs an SM.
STAGES = 3
POINTS = [(512, 8192), (680, 1280), (1024, 1024)]  # (programs: sequences x KV heads, keys a program)


@triton.jit
def _tile(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, n_keys, PTX: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + pid * BLOCK_M * D + rows[:, None] * D + dims[None, :])
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_cols = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    base = pid.to(tl.int64) * n_keys
    for start in range(0, n_keys, BLOCK_N):
        n = base + start + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + n[None, :] * D + dims[:, None])
        s = tl.dot(q, k, out_dtype=tl.int32).to(tl.float32) * tl.load(ks_ptr + n)[None, :]
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_cols = l_cols * alpha[:, None] + p
        v = to_f16(tl.load(v_ptr + n[:, None] * D + dims[None, :]), PTX, False)
        pw = (p * tl.load(vs_ptr + n)[None, :]).to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(pw, v)
        m = m_new
    out = acc / tl.sum(l_cols, axis=1)[:, None]
    tl.store(o_ptr + pid * BLOCK_M * D + rows[:, None] * D + dims[None, :], out)


@triton.jit
def _warp_keys(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, n_keys, PTX: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, D: tl.constexpr, W: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    ws = tl.arange(0, W)
    KW: tl.constexpr = BLOCK_N // W
    # The query once for each warp: [W, BLOCK_M, D].
    q = tl.load(q_ptr + pid * BLOCK_M * D + ws[:, None, None] * 0 + rows[None, :, None] * D + dims[None, None, :])
    m = tl.full([W, BLOCK_M], -1.0e30, tl.float32)
    l_cols = tl.zeros([W, BLOCK_M, KW], tl.float32)
    acc = tl.zeros([W, BLOCK_M, D], tl.float32)
    base = pid.to(tl.int64) * n_keys
    for start in range(0, n_keys, BLOCK_N):
        n = base + start + ws[:, None] * KW + tl.arange(0, KW)[None, :]  # [W, KW]: each warp's keys
        k = tl.load(k_ptr + n[:, None, :] * D + dims[None, :, None])  # [W, D, KW]
        s = tl.dot(q, k, out_dtype=tl.int32).to(tl.float32) * tl.load(ks_ptr + n)[:, None, :]
        m_new = tl.maximum(m, tl.max(s, axis=2))
        p = tl.exp2(s - m_new[:, :, None])
        alpha = tl.exp2(m - m_new)
        l_cols = l_cols * alpha[:, :, None] + p
        v = to_f16(tl.load(v_ptr + n[:, :, None] * D + dims[None, None, :]), PTX, False)  # [W, KW, D]
        pw = (p * tl.load(vs_ptr + n)[:, None, :]).to(tl.float16)
        acc = acc * alpha[:, :, None] + tl.dot(pw, v)
        m = m_new
    # The warps' partial results, each in its own maximum's units, merged once.
    top = tl.max(m, axis=0)
    weight = tl.exp2(m - top[None, :])
    total = tl.sum(tl.sum(l_cols, axis=2) * weight, axis=0)
    out = tl.sum(acc * weight[:, :, None], axis=0) / total[:, None]
    tl.store(o_ptr + pid * BLOCK_M * D + rows[:, None] * D + dims[None, :], out)


def inputs(programs: int, n_keys: int, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """An int8 query a program, int8 keys and values with positive scales (the scores' scale in base 2
    folded into the keys' scales, as the engine folds it)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randint(-127, 128, (programs, ROWS, DIMS), generator=gen, dtype=torch.int8)
    k = torch.randint(-127, 128, (programs * n_keys, DIMS), generator=gen, dtype=torch.int8)
    v = torch.randint(-127, 128, (programs * n_keys, DIMS), generator=gen, dtype=torch.int8)
    ks = torch.rand(programs * n_keys, generator=gen) * 2e-5 + 1e-5
    vs = torch.rand(programs * n_keys, generator=gen) * 0.9 + 0.1
    return tuple(t.to(device) for t in (q, k, v, ks, vs))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
    """Softmax in base 2 of the scaled scores, each probability times its value's scale, over the values."""
    programs = q.shape[0]
    k, v = k.float().view(programs, -1, DIMS), v.float().view(programs, -1, DIMS)
    s = torch.einsum("prd,pnd->prn", q.float(), k) * ks.view(programs, 1, -1)
    p = torch.exp2(s - s.amax(dim=-1, keepdim=True))
    return torch.einsum("prn,pnd->prd", p * vs.view(programs, 1, -1), v) / p.sum(dim=-1, keepdim=True)


def launch(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
           out: torch.Tensor) -> None:
    programs, n_keys = q.shape[0], k.shape[0] // q.shape[0]
    common = dict(PTX=PTX, BLOCK_M=ROWS, BLOCK_N=KEYS, D=DIMS, num_warps=WARPS, num_stages=STAGES)
    if kernel == "tile":
        _tile[(programs,)](q, k, v, ks, vs, out, n_keys, **common)
    else:
        _warp_keys[(programs,)](q, k, v, ks, vs, out, n_keys, W=WARPS, **common)


def check() -> None:
    for programs, n_keys in ((2, 256), (1, 128)):
        tensors = inputs(programs, n_keys, "cpu", seed=n_keys)
        ref = reference(*tensors)
        for kernel in ("tile", "warp_keys"):
            out = torch.empty(programs, ROWS, DIMS)
            launch(kernel, *tensors, out)
            err = ((out - ref).norm() / ref.norm()).item()
            print(f"{kernel} {programs} x {n_keys}: rel err {err:.1e}")
            assert err < 2e-3, f"{kernel} differs from the reference: {err}"


def sass() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "profile"))
    from kernel_sass import compile_for_hopper, intercept, report

    tensors = inputs(2, 4 * KEYS, "cpu")
    out = torch.empty(2, ROWS, DIMS)
    for kernel, name in (("tile", "_tile"), ("warp_keys", "_warp_keys")):
        fn, args, kwargs = intercept(name, lambda kernel=kernel: launch(kernel, *tensors, out))
        report(compile_for_hopper(fn, args, kwargs), None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="check both kernels (under TRITON_INTERPRET=1)")
    parser.add_argument("--sass", action="store_true", help="their sm_90 code (no GPU)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.check:
        check()
        return
    if args.sass:
        sass()
        return
    ceilings = measure_ceilings()
    rows = []
    for programs, n_keys in POINTS:
        tensors = inputs(programs, n_keys, "cuda")
        q, k, v, ks, vs = tensors
        ref = reference(q[:4], k[:4 * n_keys], v[:4 * n_keys], ks[:4 * n_keys], vs[:4 * n_keys])  # 4 programs
        floor = ceilings.floor(programs * n_keys * (2 * DIMS + 8), 0)
        for kernel in ("tile", "warp_keys"):
            out = torch.empty(programs, ROWS, DIMS, device="cuda")
            launch(kernel, *tensors, out)
            err = ((out[:4] - ref).norm() / ref.norm()).item()
            us = triton.testing.do_bench(lambda: launch(kernel, *tensors, out)) * 1e3
            rows.append({"name": f"study-warp-keys/{kernel}/{programs}x{n_keys}", "kernel": kernel,
                         "programs": programs, "keys": n_keys, "us": us, "floor_us": floor * 1e6,
                         "fraction_of_floor": floor * 1e6 / us, "rel_err": err})
            print(f"{kernel:<9} {programs:5d} x {n_keys:5d}: {us:8.1f} us (floor {floor * 1e6:.1f}, "
                  f"{floor * 1e6 / us:.0%}), rel err {err:.1e}", flush=True)
    if args.out:
        write_rows(args.out, ceilings, rows)


if __name__ == "__main__":
    main()
