"""Whether a large decode step's projections and attention can run at once: Llama-3-8B's layer at a
batch where the projections are bound by their FLOPs and attention by its KV reads (the long
KV-bound workload's int8 decode steps: ~490 sequences over ~2,500 tokens), replayed from CUDA graphs.

A step's kernels now run one after the other, so its time is about the sum of the two where its floor
is the larger. Timed per layer:

- ``serial``: the whole batch's projections, then its attention (what the engine runs);
- ``halves``: the batch cut in two, each half on a stream of its own, one half's projections beside
  the other half's attention (half A: projections then attention; half B: attention then
  projections), joined at the end;
- ``bound``: the whole batch's projections on one stream beside its attention on another, with no
  order between them (not a valid step: how far running at once can go at all).

python benchmarks/studies/study_overlap.py [--batch 490] [--context 2500] [--kv-dtype int8|fp8|bf16] [--out FILE]
    (GPU)
"""

from __future__ import annotations

import argparse
import os

import torch

from study_attention_tiles import KV_DTYPES, Batch
from tokenmill.bench.hardware import measure_ceilings, time_graph, write_rows

HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 14336  # Llama-3-8B


class Projections:
    """One layer's four projections (qkv, o, gate|up, down) for ``rows`` rows, in bf16."""

    def __init__(self, rows: int) -> None:
        qkv = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.shapes = [(HIDDEN, qkv), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
        self.weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for k, n in self.shapes]
        self.inputs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k, _ in self.shapes]
        self.outputs = [torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _, n in self.shapes]
        self.flops = sum(2 * rows * k * n for k, n in self.shapes)
        self.bytes = sum(2 * (k * n + rows * (k + n)) for k, n in self.shapes)

    def run(self) -> None:
        for x, w, out in zip(self.inputs, self.weights, self.outputs):
            torch.matmul(x, w.t(), out=out)


def forked(side: torch.cuda.Stream, first, second) -> None:
    """``first()`` on the current stream beside ``second()`` on ``side``, joined after both (under
    capture the side stream joins the graph through the fork, and leaves it at the join)."""
    main_stream = torch.cuda.current_stream()
    side.wait_stream(main_stream)
    first()
    with torch.cuda.stream(side):
        second()
    main_stream.wait_stream(side)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=490)
    parser.add_argument("--context", type=int, default=2500)
    parser.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="int8")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "overlap.json"))
    args = parser.parse_args()
    ceilings = measure_ceilings()
    kv_dtype = KV_DTYPES[args.kv_dtype]
    half, side = args.batch // 2, torch.cuda.Stream()
    proj, attn = Projections(args.batch), Batch([(1, args.context)] * args.batch, HEAD_DIM, Q_HEADS, KV_HEADS, kv_dtype)
    (pa, aa), (pb, ab) = [(Projections(rows), Batch([(1, args.context)] * rows, HEAD_DIM, Q_HEADS, KV_HEADS, kv_dtype))
                          for rows in (half, args.batch - half)]
    variants = {  # each run once before its capture (time_graph), which compiles what it needs
        "projections": proj.run,
        "attention": attn.run,
        "serial": lambda: (proj.run(), attn.run()),
        "halves": lambda: forked(side, lambda: (pa.run(), aa.run()), lambda: (ab.run(), pb.run())),
        "bound": lambda: forked(side, proj.run, attn.run),
    }
    floors = {"projections": ceilings.floor(proj.bytes, proj.flops), "attention": ceilings.floor(attn.kv_bytes, 0)}
    step_floor = ceilings.floor(proj.bytes + attn.kv_bytes, proj.flops)
    floors.update(dict.fromkeys(("serial", "halves", "bound"), step_floor))
    rows = []
    for name, fn in variants.items():
        seconds = time_graph(fn)
        rows.append({"name": f"overlap/llama3-8b/{args.kv_dtype}/b{args.batch}x{args.context}/{name}",
                     "us": seconds * 1e6, "floor_us": floors[name] * 1e6, "fraction_of_floor": floors[name] / seconds})
    rows[1]["max_err"] = attn.error(None)  # the attention kernel's output against its torch reference
    write_rows(args.out, ceilings, rows)
    print(f"{'variant':58s} {'us':>9s} {'floor':>9s} {'of floor':>9s}")
    for row in rows:
        print(f"{row['name']:58s} {row['us']:9.1f} {row['floor_us']:9.1f} {row['fraction_of_floor']:9.0%}")


if __name__ == "__main__":
    main()
