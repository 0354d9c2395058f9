"""The sampling kernel's tile (tokens per pass, warps per program) against the row count: one
program streams each row, so at small batches a program's own bandwidth bounds the step.

    python benchmarks/studies/study_sampling_tiles.py [--out FILE]
"""

from __future__ import annotations

import torch

from tokenmill.bench.hardware import study_setup, time_cuda, write_rows
from tokenmill.kernels import triton_sampling

VOCAB = 151936
TILES = ((2048, 4), (4096, 8), (8192, 16), (16384, 32), (8192, 8))


def main() -> None:
    args, ceilings = study_setup(__doc__)
    rows = []
    for batch in (1, 8, 64, 256):
        logits = torch.randn(batch, VOCAB, device="cuda")
        noise = torch.empty_like(logits).exponential_()
        ones, zeros = torch.ones(batch, device="cuda"), torch.zeros(batch, device="cuda")
        no_top_k, no_values = torch.zeros(batch, dtype=torch.int64, device="cuda"), logits[:, :0]
        greedy = torch.zeros(batch, dtype=torch.int64, device="cuda")
        floor = ceilings.floor(2 * logits.numel() * 4, 0.0)  # logits and noise read once
        for kind, top_p in (("temperature", 1.0), ("top_p", 0.9)):
            p = torch.full((batch,), top_p, device="cuda")
            for block, warps in TILES:
                seconds = time_cuda(lambda: triton_sampling.sample(logits, noise, ones, no_top_k, no_values, p, zeros, greedy,
                                                                   block=block, num_warps=warps), repeat=20)
                rows.append({"name": f"sampling-tile/{kind}/b{batch}/block{block}-w{warps}", "batch": batch,
                             "us": seconds * 1e6, "floor_us": floor * 1e6, "fraction_of_floor": floor / seconds})
                print(f"{rows[-1]['name']:48s} {seconds * 1e6:8.1f} us (floor {floor * 1e6:.1f} us)")
    if args.out:
        write_rows(args.out, ceilings, rows)


if __name__ == "__main__":
    main()
