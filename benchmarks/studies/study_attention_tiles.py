"""Paged attention tile study on one GPU: Gemma's head dims (256, 512), and Llama-3-8B's
(128, group 4) over a bf16 or a quantized (``--kv-dtype int8|fp8``) cache (its scales stored as the
engine stores them); with ``--points short``,
the decode batches of the static-decode and workload benchmarks (Llama-3-8B and Qwen3-0.6B shapes,
32-256 sequences over 192- and 1,024-token contexts), each tile at 1, 2 and 4 KV splits, and with
``--points ragged`` batches of 136 and 256 sequences of mixed lengths likewise, in arrival order and
longest first; with
``--points splits``, 1-128 sequences over 192-8,192 tokens at the engine's split count and at 1-64
splits in five tiles of each head dim (prefill: lone prompts and chunks deep in long contexts at 1-64
splits, with ``--chosen-only`` the engine's tile alone).

For decode batches and prefill chunks at head dims 256 and 512 with GQA groups of 2 and 8
(block 16), and at head dim 128 (``--shapes 4``, with a batch of 64 over 8k tokens), times each candidate ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` by
replacing ``triton_attention._tile_config`` (and the rows the grid is sized by), and records the registers and spills of the
kernels it compiled. Decode is timed replayed from a CUDA graph (as the engine runs it),
prefill with ``triton.testing.do_bench`` (L2 flushed). The split count is the wrapper's
own choice. The chosen tiles, then the same with a softcap, are timed last as a check.

    python benchmarks/studies/study_attention_tiles.py decode|prefill [--shapes 0,1] [--kv-dtype bf16|int8|fp8]
        [--points long|short|splits|quantized] [--tiles M,N,W,S[,R];...] [--out FILE] [--jobs N]

``--jobs N`` compiles every variant first in N processes (Triton's disk cache keeps them),
so the timed pass, one process, finds them built. ``--pipelined-scales``: a quantized cache's scales
ride the K/V tiles' copies in prompt tiles too. Each row gives its output's largest difference from
the torch reference's (``max_err``).

One JSON object per line goes to ``--out`` as each point finishes (default
``$OUT/attention-tiles-<part>.jsonl``), so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tokenmill.bench.hardware import measure_ceilings  # noqa: E402
from tokenmill.kernels import reference, triton_attention  # noqa: E402
from tokenmill.loader.kv_layout import kv_scale_dtype  # noqa: E402

BLOCK_SIZE = 16
DTYPE = torch.bfloat16
# (head_dim, q heads, KV heads): groups of 2 and 8, Llama-3-8B's, Qwen3-0.6B's, Gemma-3-4B's.
SHAPES = [(256, 16, 8), (256, 16, 2), (512, 16, 8), (512, 16, 2), (128, 32, 8), (128, 16, 8), (256, 8, 4)]
DECODE_POINTS = [(1, 8192), (16, 4096), (64, 2048), (64, 8192)]  # (batch, context)
SHORT_POINTS = [(32, 192), (128, 192), (128, 1024), (256, 1024)]
SHORT_SPLITS = (1, 2, 4)
# Decode batches of mixed lengths, as a workload's steps hold them: (sequences, shortest and longest
# context), each length drawn uniformly (seeded).
RAGGED_POINTS = [(136, 128, 2048), (256, 128, 1024)]
# The split count against batch and context: from one sequence to 128, short and long contexts, each
# at the engine's count and at 1-64 splits in the current tile and its deeper-pipelined neighbours.
SPLIT_POINTS = [(1, 256), (1, 4096), (8, 192), (8, 1024), (16, 192), (16, 1024), (16, 4096), (32, 192), (32, 1024),
                (32, 4096), (64, 2048), (64, 8192), (128, 192)]
SPLIT_COUNTS = (1, 2, 4, 8, 16, 32, 64)
QUANTIZED_POINTS = [(16, 4096), (64, 8192)]  # the quantized-KV benchmark's batch-64 point, and a split one
SPLIT_TILES = {128: [(16, 64, 4, 2), (16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 2), (16, 64, 8, 2)],
               256: [(16, 64, 4, 2), (16, 32, 4, 2), (16, 32, 4, 4), (16, 64, 8, 2), (16, 32, 8, 3)],
               512: [(16, 32, 4, 2), (16, 16, 4, 2), (16, 16, 4, 4), (16, 32, 8, 2), (16, 16, 8, 3)]}
KV_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
PREFILL_POINTS = [[(2048, 2048)], [(512, 4096)] * 4]  # (query length, context) per sequence
# Lone prompts and chunks whose grid holds fewer programs than SMs, where the KV may still be split
# (``--points splits``): whole prompts of 100-2,000 tokens (a prefill graph of 128-256 tokens splits a
# fresh prompt's keys in 2-4), and short chunks deep in long contexts.
PROMPT_SPLIT_POINTS = [[(100, 100)], [(200, 200)], [(500, 500)], [(1000, 1000)], [(2000, 2000)], [(64, 8192)],
                       [(256, 16384)], [(512, 4096)]]
DECODE_TILES = [(16, n, w, s) for n in (16, 32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
PREFILL_TILES = [(m, n, w, s) for m in (32, 64, 128) for n in (16, 32, 64) for w in (4, 8) for s in (2, 3)]
CHOSEN = (triton_attention._tile_config, triton_attention._block_rows)


def _label(tile: tuple) -> tuple:
    """A tile as rows name it: without a register cap of 0 (none), as before caps existed."""
    return tuple(tile[:4]) if len(tile) == 4 or not tile[4] else tuple(tile)


def force_tile(tile: tuple | None) -> None:
    """Every launch from now takes ``tile`` ``(BLOCK_M, BLOCK_N, num_warps, num_stages[, max_registers])``
    (no register cap where it has four), its grid sized by its rows; None: the wrapper's own choice again."""
    if tile is None:
        triton_attention._tile_config, triton_attention._block_rows = CHOSEN
    else:
        full = (*tile, 0) if len(tile) == 4 else tuple(tile)
        triton_attention._tile_config = lambda *_: full
        triton_attention._block_rows = lambda *_: full[0]


class Batch:
    def __init__(self, specs: list[tuple[int, int]], head_dim: int, hq: int, hkv: int,
                 kv_dtype: torch.dtype = DTYPE) -> None:
        blocks = [-(-ctx // BLOCK_SIZE) for _, ctx in specs]
        width = max(blocks)
        values = torch.randn(2, sum(blocks), BLOCK_SIZE, hkv, head_dim, device="cuda", dtype=DTYPE)
        self.scales = None
        if kv_dtype != DTYPE:  # one-byte values (int8 in [-127, 127]) and a scale per token and head
            values = (values * 40).clamp(-127, 127).round() if kv_dtype == torch.int8 else (values * 100).clamp(-448, 448)
            self.scales = (torch.rand(2, sum(blocks), BLOCK_SIZE, hkv, device="cuda") * 0.02).to(kv_scale_dtype(head_dim))
        self.k, self.v = values.to(kv_dtype)
        perm = torch.randperm(sum(blocks), device="cuda").int()
        self.tables = torch.zeros(len(specs), width, dtype=torch.int32, device="cuda")
        used = 0
        for b, nb in enumerate(blocks):
            self.tables[b, :nb] = perm[used:used + nb]
            used += nb
        q_lens = torch.tensor([q for q, _ in specs], dtype=torch.int32, device="cuda")
        self.qsl = torch.zeros(len(specs) + 1, dtype=torch.int32, device="cuda")
        self.qsl[1:] = torch.cumsum(q_lens, 0)
        self.seq_lens = torch.tensor([c for _, c in specs], dtype=torch.int32, device="cuda")
        self.query = torch.randn(int(q_lens.sum()), hq, head_dim, device="cuda", dtype=DTYPE)
        self.out = torch.empty_like(self.query)
        self.max_q = max(q for q, _ in specs)
        self.max_ctx = max(c for _, c in specs)
        self.scale = head_dim**-0.5
        self.kv_bytes = 2 * sum(c for _, c in specs) * hkv * (head_dim * self.k.element_size()
                                                              + (self.scales.element_size() if self.scales is not None
                                                                 else 0))
        self.flops = 4 * hq * head_dim * sum(q * (c - q) + q * (q + 1) // 2 for q, c in specs)
        self._expected: dict[float | None, torch.Tensor] = {}

    def run(self, softcap: float | None = None, splits: int | None = None, op=None) -> torch.Tensor:
        """``splits``: the KV split count (None: the wrapper's choice); ``op``: the torch reference
        instead of the kernel."""
        scales = {} if self.scales is None else {"k_scale": self.scales[0], "v_scale": self.scales[1]}
        if op is not None:
            return op(self.query, self.k, self.v, self.qsl, self.seq_lens, self.tables, self.scale, None,
                      softcap=softcap, **scales)
        return triton_attention.paged_attention(self.query, self.k, self.v, self.qsl, self.seq_lens, self.tables,
                                                self.scale, None, max_query_len=self.max_q, max_seq_len=self.max_ctx,
                                                softcap=softcap, num_splits=splits, out=self.out, **scales)

    def error(self, softcap: float | None) -> float:
        """The largest difference of the last run's output from the torch reference's."""
        if softcap not in self._expected:
            self._expected[softcap] = self.run(softcap, op=reference.paged_attention).float()
        return float((self.out.float() - self._expected[softcap]).abs().max())


def _compiled() -> set:
    found = set()
    for fn in (triton_attention._paged_attention_kernel,):
        for cache in fn.device_caches.values():
            found.update(cache[0].values())
    return found


def measure(batch: Batch, tile: tuple | None, decode: bool, softcap: float | None = None,
            splits: int | None = None) -> dict:
    force_tile(tile)
    before = _compiled()
    row: dict = {"splits": splits}
    try:
        batch.run(softcap, splits)
        torch.cuda.synchronize()
        new = _compiled() - before
        row["kernels"] = [{"regs": k.n_regs, "spills": k.n_spills} for k in new]
        row["max_err"] = batch.error(softcap)
        if decode:
            ms = triton.testing.do_bench_cudagraph(lambda: batch.run(softcap, splits), rep=40, return_mode="median")
        else:
            ms = triton.testing.do_bench(lambda: batch.run(softcap, splits), warmup=5, rep=40, return_mode="median")
        row["us"] = ms * 1e3
        row["TBps"] = batch.kv_bytes / (ms * 1e-3) / 1e12
        row["TFLOPs"] = batch.flops / (ms * 1e-3) / 1e12
    except Exception as exc:  # noqa: BLE001 - a failing tile is a result too
        row["error"] = str(exc)[-300:]
    finally:
        force_tile(None)
    return row


def _points(part: str, points: str) -> list[list[tuple[int, int]]]:
    if part == "prefill":
        return PROMPT_SPLIT_POINTS if points == "splits" else PREFILL_POINTS
    if points == "ragged":
        # Each batch in arrival order, then longest first as the engine orders a step's sequences.
        rng = random.Random(0)
        batches = [[(1, rng.randint(lo, hi)) for _ in range(b)] for b, lo, hi in RAGGED_POINTS]
        return [order for specs in batches for order in (specs, sorted(specs, key=lambda s: -s[1]))]
    chosen = {"short": SHORT_POINTS, "splits": SPLIT_POINTS, "quantized": QUANTIZED_POINTS}.get(points, DECODE_POINTS)
    return [[(1, ctx)] * b for b, ctx in chosen]


def _contexts(specs: list[tuple[int, int]]) -> str:
    """A point's context in its rows' names: the length, or the range of a ragged batch (``-sorted``:
    longest first)."""
    contexts = [c for _, c in specs]
    lo, hi = min(contexts), max(contexts)
    return str(hi) if lo == hi else f"{lo}-{hi}" + ("-sorted" if contexts == sorted(contexts, reverse=True) else "")


def _splits(points: str, forced: str | None = None) -> tuple[int | None, ...]:
    """The split counts each tile is timed at: ``forced`` (comma-separated), the wrapper's choice (None),
    or each of a fixed list (with the wrapper's choice first for ``splits``)."""
    if forced:
        return tuple(int(n) for n in forced.split(","))
    return {"short": SHORT_SPLITS, "ragged": SHORT_SPLITS, "splits": (None, *SPLIT_COUNTS)}.get(points, (None,))


def _tiles(part: str, points: str, head_dim: int, forced: str | None = None) -> list[tuple[int, int, int, int]]:
    if forced:
        return [tuple(int(v) for v in tile.split(",")) for tile in forced.split(";")]
    if part == "prefill":
        return PREFILL_TILES
    return SPLIT_TILES[head_dim] if points == "splits" else DECODE_TILES


def compile_only(part: str, shapes: list, worker: int, jobs: int, kv_dtype: torch.dtype, points: str,
                 forced: str | None, split_counts: str | None) -> None:
    """Run each (shape, tile) of this worker's share once, untimed, so that it is compiled (one split
    and several are two variants)."""
    work = [(shape, specs, tile) for shape in shapes for specs in _points(part, points)
            for tile in [*_tiles(part, points, shape[0], forced), None]]
    for i, ((head_dim, hq, hkv), specs, tile) in enumerate(work):
        if i % jobs != worker:
            continue
        batch = Batch(specs, head_dim, hq, hkv, kv_dtype)
        for softcap in (None, 50.0) if tile is None else (None,):
            force_tile(tile)
            for splits in _splits(points, split_counts)[:3]:  # the choice, one split and two: every kernel variant
                try:
                    batch.run(softcap, splits)
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001, S110 - the timed pass reports it
                    pass
        del batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["decode", "prefill"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", default=None, help="indices into SHAPES, comma-separated")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--chosen-only", action="store_true", help="time the wrapper's own tiles alone")
    parser.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="bf16",
                        help="what the cache stores (int8/fp8: one byte and a bf16 scale per token and head)")
    parser.add_argument("--points", choices=["long", "short", "ragged", "splits", "quantized"], default="long",
                        help="decode points: long contexts (Gemma's study), the static-decode and workload batches, "
                             "batches of mixed lengths, 1-128 sequences at 1-64 KV splits in a few tiles, or two "
                             "long-context batches")
    parser.add_argument("--tiles", default=None,
                        help="these tiles only: BLOCK_M,BLOCK_N,num_warps,num_stages[,max registers a thread] "
                             "separated by ';'")
    parser.add_argument("--splits", default=None,
                        help="time every tile at these KV split counts only (comma-separated; else the points' own)")
    parser.add_argument("--pipelined-scales", action="store_true",
                        help="a quantized cache's four-byte scales ride the K/V copies in every tile, prompt "
                             "tiles too (the engine: decode tiles only)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pipelined_scales:
        triton_attention._pipelined_scales = lambda block_m, scale_dtype: scale_dtype == torch.float32
    shapes = SHAPES[:4] if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    kv_dtype = KV_DTYPES[args.kv_dtype]
    if args.worker is not None:
        compile_only(args.part, shapes, args.worker, args.jobs, kv_dtype, args.points, args.tiles, args.splits)
        return
    t0 = time.time()
    if args.jobs > 1 and not args.chosen_only:
        extra = (["--kv-dtype", args.kv_dtype, "--points", args.points] + ([] if args.shapes is None else
                                                                           ["--shapes", args.shapes])
                 + ([] if args.tiles is None else ["--tiles", args.tiles])
                 + ([] if args.splits is None else ["--splits", args.splits])
                 + (["--pipelined-scales"] if args.pipelined_scales else []))
        procs = [subprocess.Popen([sys.executable, __file__, args.part, "--jobs", str(args.jobs), "--worker", str(w),
                                   *extra]) for w in range(args.jobs)]
        for proc in procs:
            proc.wait()
        print(f"[{time.time() - t0:5.0f}s] compiled in {args.jobs} processes", flush=True)
    out = args.out or os.path.join(os.environ.get("OUT", "."), f"attention-tiles-{args.part}.jsonl")
    decode = args.part == "decode"
    # Each row's floor: its KV bytes at the copy bandwidth, or its FLOPs at the matrix rate.
    ceilings = measure_ceilings()
    with open(out, "a") as f:
        for head_dim, hq, hkv in shapes:
            tiles = [] if args.chosen_only else _tiles(args.part, args.points, head_dim, args.tiles)
            for specs in _points(args.part, args.points):
                batch = Batch(specs, head_dim, hq, hkv, kv_dtype)
                point = {"part": args.part, "head_dim": head_dim, "group": hq // hkv, "seqs": len(specs),
                         "q": specs[0][0], "ctx": batch.max_ctx, "ctx_min": min(c for _, c in specs),
                         "kv_dtype": args.kv_dtype, "pipelined_scales": args.pipelined_scales}
                plan, _, _ = triton_attention.launch_plan(triton.next_power_of_2(head_dim), hq // hkv, hkv,
                                                          len(specs), batch.query.shape[0], batch.max_q,
                                                          batch.max_ctx, batch.k.element_size(), batch.query.device)
                chosen = _label(plan)
                results = []
                candidates = [(tile, splits) for tile in [*tiles, None] for splits in _splits(args.points, args.splits)]
                for tile, splits in [*candidates, ("cap", None)]:
                    if tile == "cap":
                        row = measure(batch, None, decode, softcap=50.0)
                        label = ("chosen+cap", *chosen)
                    else:
                        row = measure(batch, tile, decode, splits=splits)
                        label = ("chosen", *chosen) if tile is None else _label(tile)
                    floor_us = ceilings.floor(batch.kv_bytes, batch.flops) * 1e6
                    row = {"name": f"attention-tiles/{args.part}/d{head_dim}/g{hq // hkv}/{args.kv_dtype}/"
                                   f"{len(specs)}x{specs[0][0]}x{_contexts(specs)}/{'-'.join(map(str, label))}"
                                   + (f"/s{splits}" if splits else "")
                                   + ("/pipelined-scales" if args.pipelined_scales else ""),
                           **point, "tile": label, **row, "floor_us": floor_us,
                           "fraction_of_floor": floor_us / row["us"] if "us" in row else None}
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    results.append(row)
                best = min((r for r in results if "us" in r), key=lambda r: r["us"])
                mine = [r for r in results if r["tile"][0] == "chosen"]  # at each split count
                capped = next(r for r in results if r["tile"][0] == "chosen+cap")
                print(f"[{time.time() - t0:5.0f}s] D={head_dim} G={hq // hkv} seqs={len(specs)} q={specs[0][0]} "
                      f"ctx={_contexts(specs)}: best {best['tile']} splits {best['splits']} {best['us']:.1f}us "
                      f"{best.get('TBps', 0):.2f} TB/s ({best.get('kernels')}); "
                      f"chosen {mine[0]['tile'][1:]} "
                      + ", ".join(f"splits {r['splits']} {r.get('us', float('nan')):.1f}us" for r in mine)
                      + f" ({mine[0].get('kernels')}); +cap {capped.get('us', float('nan')):.1f}us", flush=True)
                del batch
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
