"""Whether asking the L2 for the next projection's first megabytes hides the gaps between a decode
step's matmuls: Llama-3-8B's qkv, o, gate|up and down projections of several layers in a row, as a
step runs them (``triton_ops.linear``: the few-row matmul up to 32 rows, cuBLAS past them), replayed
from a CUDA graph, against the same with a second stream that, while one projection runs, prefetches
the next one's first ``--mb`` megabytes into the L2 (``cp.async.bulk.prefetch.L2``: one instruction
a 64 KiB chunk, no registers or SM bandwidth spent on the bytes).

Static decode at 64-128 rows sits at 69-73% of its floor, and each projection measured alone stays
4.5-7.5 µs over its weight's bytes at the copy bandwidth whatever its size (o and qkv at 64 rows:
12.6 / 16.7 µs against 8.1 / 12.1): a fixed cost of filling and draining the memory pipeline at
each kernel, where the DRAM is idle. Prefetching the next weight's head during the current one's
tail is meant to fill it. Each row: µs a layer (four projections) beside the floor (the layer's
weight bytes at the copy bandwidth measured in the same run); outputs are checked equal with and
without prefetching.

    python benchmarks/studies/study_l2_prefetch.py [--rows 8,64,128] [--mb 0,8,16,32] [--out FILE]   (GPU)
    bash benchmarks/gpu_suite.sh study-l2-prefetch
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl

from tokenmill.bench.hardware import measure_ceilings, time_graph, write_rows
from tokenmill.kernels import triton_ops

# Llama-3-8B's projections of one layer: (name, output features, input features).
PROJECTIONS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
LAYERS = 8  # 3.5 GB of weights: nothing stays in the L2 from one replay to the next
CHUNK = 64 * 1024  # bytes one lane asks for (a multiple of 16, as the instruction needs)
LANES = 128


@triton.jit(do_not_specialize=["base", "nbytes"])
def _prefetch_l2_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Lane ``i`` of program ``p`` asks the L2 for bytes ``[(p * LANES + i) * CHUNK, …)`` of the
    ``nbytes`` at address ``base`` (16-byte aligned), or nothing past them."""
    start = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base + start, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(weight: torch.Tensor, nbytes: int) -> None:
    """Ask the L2 for the first ``nbytes`` of ``weight`` (all of it if smaller)."""
    nbytes = min(nbytes, weight.numel() * weight.element_size()) // 16 * 16
    _prefetch_l2_kernel[(triton.cdiv(nbytes, CHUNK * LANES),)](weight.data_ptr(), nbytes, CHUNK=CHUNK,
                                                                LANES=LANES, num_warps=LANES // 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="8,64,128")
    parser.add_argument("--mb", default="0,8,16,32", help="megabytes of the next weight prefetched (0: none)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "study-l2-prefetch.json"))
    args = parser.parse_args()
    ceilings = measure_ceilings()
    weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _, n, k in PROJECTIONS]
               for _ in range(LAYERS)]
    flat = [w for layer in weights for w in layer]
    layer_bytes = sum(w.numel() * w.element_size() for w in weights[0])
    side = torch.cuda.Stream()
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, _, k in PROJECTIONS}

        def chain(mb: int) -> list[torch.Tensor]:
            """Every projection of every layer in order; with ``mb``, each one's run also starts the
            prefetch of the next one's head on the side stream (forked once the one before has run)."""
            main_stream = torch.cuda.current_stream()
            outs = []
            for i, w in enumerate(flat):
                if mb and i + 1 < len(flat):
                    side.wait_stream(main_stream)
                    with torch.cuda.stream(side):
                        prefetch_l2(flat[i + 1], mb << 20)
                outs.append(triton_ops.linear(inputs[w.shape[1]], w, None))
            if mb:
                main_stream.wait_stream(side)
            return outs

        plain = chain(0)
        for mb in (int(v) for v in args.mb.split(",")):
            same = all(torch.equal(a, b) for a, b in zip(plain, chain(mb)))
            seconds = time_graph(lambda mb=mb: chain(mb))
            us = seconds / LAYERS * 1e6
            floor = ceilings.floor(layer_bytes, 2 * m * layer_bytes / weights[0][0].element_size()) * 1e6
            rows.append({"name": f"l2-prefetch/llama3-8b/m{m}/{mb}mb", "rows": m, "prefetch_mb": mb,
                         "us_per_layer": us, "floor_us": floor, "fraction_of_floor": floor / us,
                         "outputs_equal": same})
            print(f"rows {m:4d} prefetch {mb:3d} MB: {us:7.1f} µs a layer (floor {floor:.1f}, "
                  f"{floor / us:.0%}){'' if same else '  OUTPUTS DIFFER'}", flush=True)
    write_rows(args.out, ceilings, rows)


if __name__ == "__main__":
    main()
