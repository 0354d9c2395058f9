"""The greedy argmax (``tokenmill/kernels/triton_argmax.py``) against torch, by row count and
vocabulary: the kernel at its own span count and at forced ones, in other tiles (tokens a loop
iteration, warps), torch's one-kernel argmax, and the
torch path the engine took before the kernel (each row cut into equal chunks, their maxima, then the
best chunk: 256 chunks under 64 rows, 4 from there). Each is replayed in a CUDA graph beside the
floor (the logits read once at the copy bandwidth measured in the same run), after a check against
torch's argmax.

    python benchmarks/studies/study_argmax.py [--out FILE]   (GPU)
"""

from __future__ import annotations

import torch

from tokenmill.bench.hardware import study_setup, time_graph, write_rows
from tokenmill.kernels import triton_argmax
from tokenmill.kernels.triton_argmax import argmax_rows, row_spans

VOCABS = (128256, 151936, 262208)
BATCHES = (1, 8, 32, 64, 128, 256)
SPANS = (1, 4, 16, 64, 256)
# The kernel's (tokens a loop iteration, warps) tried besides its own, at its own span count.
TILES = ((4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16))


def with_tile(tile: tuple[int, int]):
    """``argmax_rows`` over ``tile`` (tokens an iteration, warps) instead of the kernel's own."""
    def run(x: torch.Tensor) -> torch.Tensor:
        saved = triton_argmax._BLOCK, triton_argmax._NUM_WARPS
        triton_argmax._BLOCK, triton_argmax._NUM_WARPS = tile
        try:
            return argmax_rows(x)
        finally:
            triton_argmax._BLOCK, triton_argmax._NUM_WARPS = saved
    return run


def torch_chunked(logits: torch.Tensor) -> torch.Tensor:
    """The engine's argmax before the kernel: each row in the most equal chunks (at most 256 under 64
    rows, 4 from there) that divide it, then the first chunk holding the row's maximum."""
    rows, vocab = logits.shape
    chunks = next(c for c in range(min(256 if rows < 64 else 4, vocab), 0, -1) if vocab % c == 0)
    values, within = logits.view(rows, chunks, vocab // chunks).max(dim=-1)
    best = values.argmax(dim=-1, keepdim=True)
    return (best * (vocab // chunks) + within.gather(-1, best)).squeeze(-1)


def main() -> None:
    args, ceilings = study_setup(__doc__)
    rows = []
    for vocab in VOCABS:
        for batch in BATCHES:
            logits = torch.randn(batch, vocab, device="cuda").to(torch.bfloat16)
            expected = logits.argmax(dim=-1)
            floor = ceilings.floor(logits.numel() * logits.element_size(), 0.0)
            candidates = {"kernel": argmax_rows, "torch": lambda x: x.argmax(dim=-1), "torch-chunked": torch_chunked,
                          **{f"kernel-{s}-spans": (lambda x, s=s: argmax_rows(x, spans=s)) for s in SPANS},
                          **{f"kernel-{b}x{w}": with_tile((b, w)) for b, w in TILES}}
            times = {}
            for name, fn in candidates.items():
                if not torch.equal(fn(logits), expected):
                    raise AssertionError(f"{name} differs from torch's argmax at vocab {vocab}, batch {batch}")
                times[name] = time_graph(lambda fn=fn: fn(logits)) * 1e6
            rows.append({"name": f"argmax/v{vocab}/b{batch}", "vocab": vocab, "batch": batch, "floor_us": floor * 1e6,
                         "us": times, "kernel_spans": row_spans(batch, vocab, logits.device),
                         "fraction_of_floor": floor * 1e6 / times["kernel"]})
            print(f"vocab {vocab:6d} batch {batch:3d} (floor {floor * 1e6:5.1f} us): kernel {times['kernel']:6.1f} "
                  f"({rows[-1]['kernel_spans']} spans), torch {times['torch']:6.1f}, before {times['torch-chunked']:6.1f}; "
                  + " ".join(f"{s}:{times[f'kernel-{s}-spans']:.1f}" for s in SPANS) + "; tiles "
                  + " ".join(f"{b}x{w}:{times[f'kernel-{b}x{w}']:.1f}" for b, w in TILES), flush=True)
    if args.out:
        write_rows(args.out, ceilings, rows)


if __name__ == "__main__":
    main()
