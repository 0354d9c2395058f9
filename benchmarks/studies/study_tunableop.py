"""cuBLAS as torch calls it against the GEMM that PyTorch's TunableOp picks by timing every candidate
(cuBLAS and cuBLASLt's algorithms), on Llama-3-8B's projections at the row counts where decode steps
use cuBLAS (32-256 rows), beside each shape's floor (the weight's bytes over the copy bandwidth
measured in the same call, or its FLOPs at the measured matmul rate where that is longer). Each runs
inside a CUDA graph over enough weight copies that nothing is served from L2 (``study_gemv.time_graph``).

    python benchmarks/studies/study_tunableop.py [--rows 32,64,128,256] [--out study-tunableop.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from study_gemv import L2_BYTES, MODELS, time_graph
from tokenmill.bench.hardware import measure_ceilings, write_rows

DT = torch.bfloat16


def time_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Microseconds of one ``x @ w.T``, the weights cycled in one graph."""
    return time_graph(lambda: [F.linear(x, w) for w in weights]) * 1e3 / len(weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,64,128,256")
    parser.add_argument("--model", default="llama3-8b", choices=list(MODELS))
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "study-tunableop.json"))
    args = parser.parse_args()
    ceilings = measure_ceilings()
    tunable = torch.cuda.tunable
    tunable.set_rotating_buffer_size(256)  # MB of copies its timing cycles through: past the L2
    rows_out = []
    for name, n, k, _ in MODELS[args.model][2]:
        weight_bytes = n * k * DT.itemsize
        weights = [torch.randn(n, k, device="cuda", dtype=DT) for _ in range(max(2, -(-L2_BYTES // weight_bytes)))]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=DT)
            tunable.enable(False)
            want = F.linear(x, weights[0])
            default_us = time_linear(x, weights)
            tunable.enable(True)
            tunable.tuning_enable(True)
            got = F.linear(x, weights[0])  # tunes this shape, outside any graph
            tunable.tuning_enable(False)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            tuned_us = time_linear(x, weights)
            tunable.enable(False)
            floor_us = ceilings.floor(weight_bytes + 2 * m * (n + k), 2 * m * n * k) * 1e6
            rows_out.append({"name": f"tunableop/{args.model}/{name}/m{m}", "projection": name, "rows": m,
                             "n": n, "k": k, "cublas_us": default_us, "tuned_us": tuned_us, "floor_us": floor_us,
                             "fraction_of_floor": floor_us / tuned_us, "cublas_fraction_of_floor": floor_us / default_us,
                             "rel_err": err})
            print(f"{name:8s} m={m:4d}: cuBLAS {default_us:7.1f} us, TunableOp {tuned_us:7.1f} us "
                  f"({default_us / tuned_us - 1:+.1%}), floor {floor_us:6.1f} us, rel err {err:.1e}", flush=True)
        del weights
        torch.cuda.empty_cache()
    write_rows(args.out, ceilings, rows_out)
    # The algorithm TunableOp chose for each shape, beside the rows.
    Path(args.out).with_suffix(".choices.json").write_text(json.dumps([list(map(str, r))
                                                                      for r in tunable.get_results()], indent=1))


if __name__ == "__main__":
    main()
