"""One decode attention launch for Nsight Compute, and a summary of its per-instruction stall samples.

A kernel's timings say how far it is from its floor, not why; ``ncu`` reads the hardware counters
(which warps were stalled, on what, at which sm_90 instruction). The script builds a batch as
``study_attention_tiles.py`` does, runs the kernel once to compile and warm it, then once more, the
launch to profile:

    ncu --clock-control none --set full --import-source yes -k regex:_paged_attention -s 1 -c 1 \\
        -o attn-fp8 python benchmarks/profile/profile_attention_ncu.py --kv-dtype fp8
    ncu -i attn-fp8.ncu-rep --page details --csv > attn-fp8-details.csv
    ncu -i attn-fp8.ncu-rep --page source --csv --print-source sass > attn-fp8-sass.csv
    python benchmarks/profile/profile_attention_ncu.py --stalls attn-fp8-sass.csv

``bash benchmarks/gpu_suite.sh study-attention-ncu`` runs these over fp8, int8 and bf16 caches.
``--tile`` forces ``BLOCK_M,BLOCK_N,num_warps,num_stages[,max registers]`` as the study's ``--tiles``;
``--stalls`` needs no GPU: it prints the warps' stall samples by reason and the instructions that
hold the most of them.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies"))
from study_attention_tiles import KV_DTYPES, SHAPES, Batch, force_tile  # noqa: E402


def stall_summary(path: str, top: int = 30) -> str:
    """The stall reasons of an ``ncu --page source --csv --print-source sass`` export, and its ``top``
    instructions by samples (address, share, main reason, times executed, the instruction)."""
    with open(path) as f:
        lines = f.read().splitlines()
    rows = list(csv.DictReader(lines[1:]))  # the first line names the kernel
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    samples = "Warp Stall Sampling (All Samples)"
    total = sum(int(r[samples] or 0) for r in rows)
    by_reason = collections.Counter({k: sum(int(r[k] or 0) for r in rows) for k in reasons})
    out = [f"{path}: {total} samples"]
    out += [f"  {k[6:]:20s} {v:8d} {100 * v / total:5.1f}%" for k, v in by_reason.most_common(10)]
    for r in sorted(rows, key=lambda r: -int(r[samples] or 0))[:top]:
        n = int(r[samples] or 0)
        main = max(reasons, key=lambda k: int(r[k] or 0))[6:]
        out.append(f"{r['Address'][-5:]} {n:6d} {100 * n / total:4.1f}% {main:16s} "
                   f"x{r['Instructions Executed']:>8s} {r['Source'].strip()[:70]}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="fp8")
    parser.add_argument("--shape", type=int, default=4, help="index into the study's SHAPES (4: Llama-3-8B's heads)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--tile", default=None)
    parser.add_argument("--stalls", default=None, help="summarise this SASS export instead (no GPU)")
    args = parser.parse_args()
    if args.stalls:
        print(stall_summary(args.stalls))
        return
    head_dim, hq, hkv = SHAPES[args.shape]
    batch = Batch([(1, args.context)] * args.batch, head_dim, hq, hkv, KV_DTYPES[args.kv_dtype])
    force_tile(None if args.tile is None else tuple(int(v) for v in args.tile.split(",")))
    for _ in range(2):
        batch.run()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
