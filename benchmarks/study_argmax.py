"""The greedy argmax's split of each row into chunks against the row count: many chunks fill the
GPU at batch 1, but at large batches their odd widths (a 128,256-token vocabulary is 2^8 x 501)
may cost more than they bring.

    python benchmarks/study_argmax.py [--out FILE]   (GPU)
"""

from __future__ import annotations

import torch

from tokenmill.bench.hardware import study_setup, time_graph, write_rows
from tokenmill.layers.sampler import greedy_argmax

VOCABS = (128256, 151936, 262208)
BATCHES = (1, 8, 32, 64, 128, 256)
CHUNKS = (1, 4, 16, 64, 256)


def main() -> None:
    args, ceilings = study_setup(__doc__)
    rows = []
    for vocab in VOCABS:
        for batch in BATCHES:
            logits = torch.randn(batch, vocab, device="cuda").to(torch.bfloat16)
            expected = logits.argmax(dim=-1)
            floor = ceilings.floor(logits.numel() * logits.element_size(), 0.0)
            times = {}
            for chunks in CHUNKS:
                if not torch.equal(greedy_argmax(logits, chunks), expected):
                    raise AssertionError(f"argmax differs at vocab {vocab}, batch {batch}, {chunks} chunks")
                times[chunks] = time_graph(lambda: greedy_argmax(logits, chunks)) * 1e6
            best = min(times, key=times.get)
            rows.append({"name": f"argmax/v{vocab}/b{batch}", "vocab": vocab, "batch": batch, "floor_us": floor * 1e6,
                         "us_by_max_chunks": times, "best_max_chunks": best,
                         "fraction_of_floor": floor * 1e6 / times[best]})
            print(f"vocab {vocab:6d} batch {batch:3d}: " + "  ".join(f"{c}:{t:6.1f}" for c, t in times.items())
                  + f"  us (floor {floor * 1e6:.1f})")
    if args.out:
        write_rows(args.out, ceilings, rows)


if __name__ == "__main__":
    main()
