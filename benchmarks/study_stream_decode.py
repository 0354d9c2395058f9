"""Decode attention through the stream-K kernel (``triton_stream_decode``: every key tile of the step
shared evenly by two programs an SM) against the paged kernel (a program a sequence and KV head), on
the batches a server decodes: ragged batches longest first (as the engine orders them), uniform ones,
and long contexts; over int8, float8 and bf16 caches, Llama-3-8B's heads (head dim 128, 32 query over
8 KV heads) and Gemma-3-4B's (256, 8 over 4). Each point is replayed from a CUDA graph beside its
floor (the cache's bytes, scales included, at the copy bandwidth measured in the same run), with the
output's largest difference from the torch reference.

    python benchmarks/study_stream_decode.py [--out study-stream-decode.jsonl]   (GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch
import triton.testing

from study_attention_tiles import KV_DTYPES, Batch

from tokenmill.bench.hardware import measure_ceilings

LLAMA, GEMMA = (128, 32, 8), (256, 8, 4)


def points() -> list[tuple[str, list[tuple[int, int]]]]:
    """(name, one query token and a context a sequence): the KV-bound workload's mean decode batch
    (85 x 1,280) and spreads like the standard workload's (136 of 130-2,038; 256 of 128-1,024), short
    and long contexts."""
    rng = random.Random(0)

    def ragged(batch: int, lo: int, hi: int) -> list[tuple[int, int]]:
        return sorted(((1, rng.randint(lo, hi)) for _ in range(batch)), key=lambda s: -s[1])

    return [("85x1280", [(1, 1280)] * 85), ("136x130-2038", ragged(136, 130, 2038)),
            ("256x128-1024", ragged(256, 128, 1024)), ("128x192", [(1, 192)] * 128),
            ("32x1024", [(1, 1024)] * 32), ("64x8192", [(1, 8192)] * 64)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "study-stream-decode.jsonl"))
    args = parser.parse_args()
    ceilings = measure_ceilings()
    cases = [(LLAMA, kv) for kv in ("int8", "fp8", "bf16")] + [(GEMMA, "bf16"), (GEMMA, "int8")]
    print(f"{'heads':>12} {'kv':>5} {'batch':>14} {'floor':>8} {'paged':>8} {'stream':>8}  (us)")
    with open(args.out, "a") as f:
        for (head_dim, hq, hkv), kv in cases:
            for name, specs in points():
                batch = Batch(specs, head_dim, hq, hkv, KV_DTYPES[kv])
                floor_us = ceilings.floor(batch.kv_bytes, 0) * 1e6
                times = {}
                for stream in (False, True):
                    batch.run(stream=stream)
                    torch.cuda.synchronize()
                    err = batch.error(None)
                    ms = triton.testing.do_bench_cudagraph(lambda: batch.run(stream=stream), rep=40,
                                                           return_mode="median")
                    kernel = "stream" if stream else "paged"
                    times[kernel] = ms * 1e3
                    f.write(json.dumps({"name": f"stream-decode/d{head_dim}/g{hq // hkv}/{kv}/{name}/{kernel}",
                                        "us": ms * 1e3, "floor_us": floor_us,
                                        "fraction_of_floor": floor_us / (ms * 1e3), "max_err": err}) + "\n")
                    f.flush()
                print(f"{f'd{head_dim} g{hq // hkv}':>12} {kv:>5} {name:>14} {floor_us:8.1f} {times['paged']:8.1f} "
                      f"{times['stream']:8.1f}", flush=True)
                del batch
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
