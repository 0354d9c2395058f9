"""Paged decode attention (Triton) against the memory-bandwidth floor, on one GPU.

Llama-3-8B attention shape (32 q heads, 8 KV heads, head dim 128, bf16, block 16)
for batch {1, 8, 32, 128} × context {128, 1024, 4096}. Decode reads every cached
K and V byte once, so the floor is KV bytes / copy bandwidth, the latter measured
in the same run (a large device-to-device copy, bytes read + written).

Two times per point, both medians:
- ``eager``: ``triton.testing.do_bench`` of the Python call (L2 flushed before each
  call; includes host launch overhead whenever the GPU outruns the host);
- ``graph``: the same call replayed from a CUDA graph, as the engine's decode runs
  it (launch overhead amortised), rotating over enough cache copies to spill the
  L2 where memory allows.
The torch reference is timed at one small point as the peer. A short table is
printed last; everything goes to JSON (``--out``, default ``$OUT/bench_kernels.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tokenmill.kernels import reference, triton_ops  # noqa: E402
from tokenmill.kernels.triton_attention import _choose_num_splits  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
BATCHES = (1, 8, 32, 128)
CONTEXTS = (128, 1024, 4096)
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32, 64)


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second (median)."""
    src = torch.randn(2**29, device="cuda")  # 2 GiB of float32
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


class DecodeBatch:
    """``copies`` independent caches (random bf16, random block order) for one batch shape."""

    def __init__(self, batch: int, context: int, copies: int) -> None:
        blocks_per_seq = context // BLOCK_SIZE
        num_blocks = batch * blocks_per_seq
        self.caches = []
        for _ in range(copies):
            k = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
            v = torch.randn_like(k)
            self.caches.append((k, v))
        self.block_tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
        self.query = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        self.qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        self.seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        self.out = torch.empty_like(self.query)
        self.kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * self.query.element_size()
        self._next = 0

    def run(self, num_splits: int | None = None) -> torch.Tensor:
        k, v = self.caches[self._next]
        self._next = (self._next + 1) % len(self.caches)
        return triton_ops.paged_attention(
            self.query, k, v, self.qsl, self.seq_lens, self.block_tables, HEAD_DIM**-0.5,
            max_query_len=1, num_splits=num_splits, out=self.out,
        )

    def run_reference(self) -> torch.Tensor:
        k, v = self.caches[0]
        return reference.paged_attention(self.query, k, v, self.qsl, self.seq_lens, self.block_tables, HEAD_DIM**-0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_kernels.json"))
    args = parser.parse_args()

    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 * 2**20)
    bw = copy_bandwidth()
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {l2_bytes / 2**20:.0f} MiB, copy {bw / 1e12:.2f} TB/s")

    rows = []
    for batch in BATCHES:
        for context in CONTEXTS:
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2
            copies = max(1, min(8, -(-3 * l2_bytes // kv_bytes)))
            data = DecodeBatch(batch, context, copies)
            ref = data.run_reference()
            err = (data.run().double() - ref.double()).norm().item() / ref.double().norm().item()
            eager = triton.testing.do_bench(lambda: data.run(), warmup=25, rep=100, return_mode="median")
            graph = triton.testing.do_bench_cudagraph(lambda: data.run(), rep=50, return_mode="median")
            splits = _choose_num_splits(batch * NUM_KV_HEADS, context, data.query.device, HEAD_DIM,
                                        block_m=16)  # a decode tile
            row = {
                "batch": batch, "context": context, "num_splits": splits, "kv_bytes": kv_bytes,
                "cache_copies": copies, "rel_err_vs_reference": err,
                "eager_us": eager * 1e3, "graph_us": graph * 1e3,
                "floor_us": kv_bytes / bw * 1e6,
                "graph_bw_TBps": kv_bytes / (graph * 1e-3) / 1e12,
                "graph_frac_of_copy_bw": kv_bytes / (graph * 1e-3) / bw,
                "eager_frac_of_copy_bw": kv_bytes / (eager * 1e-3) / bw,
            }
            if context == 4096 and batch <= 32:
                row["split_sweep_graph_us"] = {
                    s: triton.testing.do_bench_cudagraph(lambda s=s: data.run(s), rep=30, return_mode="median") * 1e3
                    for s in SPLIT_SWEEP
                }
            rows.append(row)

    # Peer: the torch reference (a Python loop over sequences) at one small point.
    peer_data = DecodeBatch(8, 1024, 1)
    peer_ms = triton.testing.do_bench(peer_data.run_reference, warmup=25, rep=200, return_mode="median")
    peer = {
        "impl": "torch reference", "batch": 8, "context": 1024, "eager_us": peer_ms * 1e3,
        "frac_of_copy_bw": peer_data.kv_bytes / (peer_ms * 1e-3) / bw,
    }

    result = {
        "benchmark": "paged decode attention, Llama-3-8B shape",
        "date": time.strftime("%Y-%m-%d"),
        "device": props.name, "sms": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__,
        "shape": {"q_heads": NUM_Q_HEADS, "kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "block_size": BLOCK_SIZE, "dtype": "bfloat16"},
        "copy_bandwidth_TBps": bw / 1e12,
        "rows": rows, "peer": peer,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))

    for row in rows:
        if "split_sweep_graph_us" in row:
            sweep = " ".join(f"{s}:{t:.1f}" for s, t in row["split_sweep_graph_us"].items())
            print(f"split sweep B={row['batch']} ctx={row['context']} (default {row['num_splits']}): {sweep} us")
    print(f"peer torch reference B=8 ctx=1024: {peer['eager_us']:.0f} us = {peer['frac_of_copy_bw']:.1%} of copy bw")
    print(f"copy bandwidth (floor) {bw / 1e12:.2f} TB/s")
    print(f"{'B':>4} {'ctx':>5} {'split':>5} {'KV MB':>7} {'floor us':>8} {'graph us':>8} {'eager us':>8} {'graph TB/s':>10} {'%floor':>6} {'err':>8}")
    for r in rows:
        print(f"{r['batch']:>4} {r['context']:>5} {r['num_splits']:>5} {r['kv_bytes'] / 1e6:>7.1f} {r['floor_us']:>8.1f} "
              f"{r['graph_us']:>8.1f} {r['eager_us']:>8.1f} {r['graph_bw_TBps']:>10.2f} "
              f"{r['graph_frac_of_copy_bw']:>6.1%} {r['rel_err_vs_reference']:>8.1e}")


if __name__ == "__main__":
    main()
