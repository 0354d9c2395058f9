"""Gemma's final-logit softcap over a step's logits, the Triton kernel (one pass, in place) against
the reference's three in-place torch ops, each a pass over all of them; both replayed from a CUDA
graph, as the engine runs them, beside the floor of one pass (the logits read and written once).

    python benchmarks/study_softcap.py [--out FILE]   (GPU)
"""

from __future__ import annotations

import argparse

import torch

from tokenmill.bench.hardware import measure_ceilings, time_cuda, write_rows
from tokenmill.kernels import reference, triton_ops

VOCAB, CAP = 262208, 30.0  # Gemma 3's vocabulary and final cap
BATCHES = (1, 8, 32, 128, 256)


def graph_us(fn, logits: torch.Tensor) -> float:
    fn(logits)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(logits)
    return time_cuda(graph.replay, repeat=50) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ceilings = measure_ceilings()
    rows = []
    for batch in BATCHES:
        logits = (torch.randn(batch, VOCAB, device="cuda") * 10).to(torch.bfloat16)
        expected = reference.softcap_(logits.clone(), CAP)
        got = triton_ops.softcap_(logits.clone(), CAP)
        differ = (got != expected).float().mean().item()
        floor = ceilings.floor(2 * logits.numel() * logits.element_size(), 0.0) * 1e6
        kernel = graph_us(lambda x: triton_ops.softcap_(x, CAP), logits)
        torch_ops = graph_us(lambda x: reference.softcap_(x, CAP), logits)
        rows.append({"name": f"softcap/v{VOCAB}/b{batch}", "batch": batch, "floor_us": floor, "us": kernel,
                     "fraction_of_floor": floor / kernel, "torch_ops_us": torch_ops,
                     "torch_ops_fraction_of_floor": floor / torch_ops, "share_differing": differ})
        print(f"batch {batch:3d}: kernel {kernel:7.1f} us, three torch ops {torch_ops:7.1f} us, floor {floor:6.1f} us"
              f" ({differ:.1e} of the values differ)")
    if args.out:
        write_rows(args.out, ceilings, rows)


if __name__ == "__main__":
    main()
