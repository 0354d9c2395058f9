"""Gemma's final-logit softcap over a step's logits, the Triton kernel (one pass, in place) against
the reference's three in-place torch ops, each a pass over all of them; both replayed from a CUDA
graph, as the engine runs them, beside the floor of one pass (the logits read and written once).

    python benchmarks/studies/study_softcap.py [--out FILE]   (GPU)
"""

from __future__ import annotations

import torch

from tokenmill.bench.hardware import study_setup, time_graph, write_rows
from tokenmill.kernels import reference, triton_ops

VOCAB, CAP = 262208, 30.0  # Gemma 3's vocabulary and final cap
BATCHES = (1, 8, 32, 128, 256)


def main() -> None:
    args, ceilings = study_setup(__doc__)
    rows = []
    for batch in BATCHES:
        logits = (torch.randn(batch, VOCAB, device="cuda") * 10).to(torch.bfloat16)
        expected = reference.softcap_(logits.clone(), CAP)
        got = triton_ops.softcap_(logits.clone(), CAP)
        differ = (got != expected).float().mean().item()
        floor = ceilings.floor(2 * logits.numel() * logits.element_size(), 0.0) * 1e6
        kernel = time_graph(lambda: triton_ops.softcap_(logits, CAP)) * 1e6
        torch_ops = time_graph(lambda: reference.softcap_(logits, CAP)) * 1e6
        rows.append({"name": f"softcap/v{VOCAB}/b{batch}", "batch": batch, "floor_us": floor, "us": kernel,
                     "fraction_of_floor": floor / kernel, "torch_ops_us": torch_ops,
                     "torch_ops_fraction_of_floor": floor / torch_ops, "share_differing": differ})
        print(f"batch {batch:3d}: kernel {kernel:7.1f} us, three torch ops {torch_ops:7.1f} us, floor {floor:6.1f} us"
              f" ({differ:.1e} of the values differ)")
    if args.out:
        write_rows(args.out, ceilings, rows)


if __name__ == "__main__":
    main()
