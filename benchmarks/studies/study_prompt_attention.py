"""A new prompt's attention over its own keys, read contiguously, against the engine's paged prompt tile.

A prompt with nothing cached attends only over the keys its own step computes, which the QKV
projection leaves contiguous in memory; the engine's kernel reads them back from the paged cache
through the block table, in tiles of 32 keys (its fastest there: wider tiles of gathered keys cost
more registers than they save), and reaches ~290 TFLOP/s on Llama-3-8B's 4,000-token prompt, a third
of the matrix rate. ``_prompt_kernel`` here is the plain causal flash-attention loop over contiguous
K/V (one query head a program, the unmasked tiles before the diagonal ones, longest tiles first), so
that the study can tell how much the paging costs and whether wider key tiles pay off, before any such
path enters the engine. Both are timed with ``triton.testing.do_bench`` beside torch's
``scaled_dot_product_attention`` (FlashAttention-2 where it applies) and the floor, the prompt's causal
FLOPs at the matrix rate measured in the same call.

    TRITON_INTERPRET=1 python benchmarks/studies/study_prompt_attention.py --check   # the kernel on the CPU
    python benchmarks/studies/study_prompt_attention.py [--out study-prompt-attention.json]   # GPU
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.language as tl

from tokenmill.bench.hardware import measure_ceilings, write_rows

# (BLOCK_M query rows, BLOCK_N keys, warps, stages) tried on the GPU.
TILES = [(128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)]
PROMPTS = [500, 1000, 2000, 4000]
HEADS = (32, 8, 128)  # Llama-3-8B: query heads, KV heads, head dim


@triton.jit
def _prompt_kernel(q_ptr, k_ptr, v_ptr, o_ptr, num_tokens, qk_scale, HQ: tl.constexpr, GROUP: tl.constexpr,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``o[t, h] = softmax(q[t, h] . k[:t+1, h // GROUP]) v[:t+1, h // GROUP]``, rows ``[T, heads, D]``."""
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the most keys first
    head = tl.program_id(1)
    kv_head = head // GROUP
    HKV: tl.constexpr = HQ // GROUP
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    row_ok = rows < num_tokens
    q = tl.load(q_ptr + (rows[:, None] * HQ + head) * D + dims[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # Keys before the tile's first row are seen by every row: no mask.
    full_hi = m_tile * BLOCK_M // BLOCK_N * BLOCK_N
    for start in range(0, full_hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = tl.load(k_ptr + (cols[:, None] * HKV + kv_head) * D + dims[None, :])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (cols[:, None] * HKV + kv_head) * D + dims[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # The diagonal: each row sees the keys up to its own.
    for start in range(full_hi, tl.minimum((m_tile + 1) * BLOCK_M, num_tokens), BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < num_tokens
        k = tl.load(k_ptr + (cols[:, None] * HKV + kv_head) * D + dims[None, :], mask=col_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(cols[None, :] <= rows[:, None], s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (cols[:, None] * HKV + kv_head) * D + dims[None, :], mask=col_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + (rows[:, None] * HQ + head) * D + dims[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     tile: tuple[int, int, int, int]) -> torch.Tensor:
    """Causal attention of a new prompt's ``q`` ``[T, Hq, D]`` over its ``k``, ``v`` ``[T, Hkv, D]``."""
    num_tokens, hq, d = q.shape
    block_m, block_n, warps, stages = tile
    qk_scale = d**-0.5 * math.log2(math.e)
    _prompt_kernel[(triton.cdiv(num_tokens, block_m), hq)](
        q, k, v, out, num_tokens, qk_scale, HQ=hq, GROUP=hq // k.shape[1], D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages)
    return out


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same in float32 with torch, one head at a time."""
    num_tokens, hq, d = q.shape
    group = hq // k.shape[1]
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=q.device).tril()
    out = torch.empty(num_tokens, hq, d, dtype=torch.float32, device=q.device)
    for h in range(hq):
        s = (q[:, h].float() @ k[:, h // group].float().T) * d**-0.5
        out[:, h] = s.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, h // group].float()
    return out


def inputs(num_tokens: int, heads: tuple[int, int, int], device: str, dtype: torch.dtype,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hq, hkv, d = heads
    g = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(num_tokens, h, d, generator=g, device=device).to(dtype) for h in (hq, hkv, hkv))


def check() -> None:
    """Prompts that end inside a tile and on its edge, tiles of several key widths, groups of 1-4."""
    for num_tokens, heads, tile in ((37, (4, 2, 16), (16, 16, 4, 1)), (64, (4, 1, 16), (32, 16, 4, 1)),
                                    (50, (2, 2, 32), (16, 32, 4, 1))):
        q, k, v = inputs(num_tokens, heads, "cpu", torch.float16, seed=num_tokens)
        out = prompt_attention(q, k, v, torch.empty_like(q), tile)
        ref = reference(q, k, v)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        print(f"{num_tokens} tokens, heads {heads}, tile {tile}: rel err {err:.1e}")
        assert err < 2e-3, f"the kernel differs from the reference: {err}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="check the kernel (under TRITON_INTERPRET=1)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.check:
        check()
        return
    from study_attention_tiles import BLOCK_SIZE, Batch

    ceilings = measure_ceilings()
    hq, hkv, d = HEADS
    rows = []
    for num_tokens in PROMPTS:
        flops = 4 * hq * d * num_tokens * (num_tokens + 1) // 2
        floor_us = ceilings.floor(0, flops) * 1e6
        paged = Batch([(num_tokens, num_tokens)], d, hq, hkv)
        blocks = paged.tables[0, :-(-num_tokens // BLOCK_SIZE)].long()
        k, v = (cache[blocks].reshape(-1, hkv, d)[:num_tokens].contiguous() for cache in (paged.k, paged.v))
        q = paged.query
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            enable_gqa=True).transpose(0, 1)
        candidates = {"paged (engine)": lambda: paged.run(),
                      "torch sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                          q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True)}
        out = torch.empty_like(q)
        for tile in TILES:
            candidates[f"contiguous {tile}"] = lambda tile=tile: prompt_attention(q, k, v, out, tile)
        for name, run in candidates.items():
            result = run()
            if name == "torch sdpa":
                result = result.transpose(0, 1)
            err = float((result.float() - expected.float()).abs().max())
            us = triton.testing.do_bench(run, warmup=5, rep=50) * 1e3
            rows.append({"name": f"study-prompt-attention/{num_tokens}/{name}", "tokens": num_tokens,
                         "kernel": name, "us": us, "tflops": flops / us / 1e6, "floor_us": floor_us,
                         "fraction_of_floor": floor_us / us, "max_abs_err": err})
            print(f"{num_tokens:5d} tokens  {name:<30} {us:8.1f} us  {flops / us / 1e6:6.1f} TFLOP/s "
                  f"({floor_us / us:.0%} of the floor {floor_us:.1f} us)  max err {err:.1e}", flush=True)
    if args.out:
        write_rows(args.out, ceilings, rows)


if __name__ == "__main__":
    main()
