"""Prompt attention on one GPU: the engine's paged Triton kernel against the attention kernels torch
ships (FlashAttention-2's variable-length forward, cuDNN's), on Llama-3-8B's and Gemma-3-4B's heads.

torch's kernels read keys and values contiguous, so each is timed twice: alone, and after
gathering the batch's keys and values out of the paged cache (what the engine would have to do
first). Points: a lone fresh prompt, a chunk deep in a long context (its queries at the end of the
keys: causal from the bottom right), and batches of several. Every output is checked against the
torch reference's (``max_err``); a backend that fails or differs says so in its row.

    python benchmarks/studies/study_prefill_backends.py [--out FILE]

Rows go to ``--out`` (default ``$OUT/prefill-backends.jsonl``) as each finishes, and all of them with
the run's environment to the same name ending in ``.json`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from study_attention_tiles import BLOCK_SIZE, Batch  # noqa: E402

from tokenmill.bench.hardware import measure_ceilings, write_rows  # noqa: E402
from tokenmill.kernels import reference  # noqa: E402

SHAPES = {"llama3-8b": (128, 32, 8), "gemma3-4b": (256, 8, 4)}  # head dim, q heads, KV heads
# (query tokens, context with them) per sequence of a batch.
POINTS = {
    "prompt-2048": [(2048, 2048)],
    "prompt-4000": [(4000, 4000)],
    "chunk-1952-over-4000": [(1952, 4000)],
    "4x512-fresh": [(512, 512)] * 4,
    "4x512-over-4096": [(512, 4096)] * 4,
    "16-mixed-fresh": [(n, n) for n in (100, 180, 260, 340, 420, 500, 580, 660, 740, 820, 900, 980, 1024, 700, 300,
                                        150)],
}


def gather_kv(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The cache slots of the batch's keys in order, their sequences' offsets, and the keys and values
    gathered from them (``[total, Hkv, D]`` each)."""
    lens = batch.seq_lens.tolist()
    index = torch.cat([batch.tables[b, :-(-n // BLOCK_SIZE)].long().repeat_interleave(BLOCK_SIZE)[:n] * BLOCK_SIZE
                       + torch.arange(n, device="cuda") % BLOCK_SIZE for b, n in enumerate(lens)])
    k = batch.k.flatten(0, 1).index_select(0, index)
    v = batch.v.flatten(0, 1).index_select(0, index)
    cu_k = torch.zeros(len(lens) + 1, dtype=torch.int32, device="cuda")
    cu_k[1:] = torch.cumsum(batch.seq_lens, 0)
    return index, cu_k, (k, v)


def backends(batch: Batch) -> dict:
    """Each backend as a function of no arguments returning the output ``[T, Hq, D]``."""
    index, cu_k, (k, v) = gather_kv(batch)
    max_k = int(batch.seq_lens.max())
    flat_k, flat_v = batch.k.flatten(0, 1), batch.v.flatten(0, 1)

    def flash(gather: bool):
        def run():
            kk, vv = (flat_k.index_select(0, index), flat_v.index_select(0, index)) if gather else (k, v)
            return torch.ops.aten._flash_attention_forward(batch.query, kk, vv, batch.qsl, cu_k, batch.max_q, max_k,
                                                            0.0, True, False, scale=batch.scale)[0]
        return run

    # cuDNN's variable-length path is given as many KV heads as query heads (alone: expanded beforehand).
    group = batch.query.shape[1] // k.shape[1]
    wide_k, wide_v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def cudnn(gather: bool):
        def run():
            kk, vv = wide_k, wide_v
            if gather:
                kk = flat_k.index_select(0, index).repeat_interleave(group, 1)
                vv = flat_v.index_select(0, index).repeat_interleave(group, 1)
            return torch.ops.aten._cudnn_attention_forward(batch.query, kk, vv, None, batch.qsl, cu_k, batch.max_q,
                                                           max_k, False, 0.0, True, False, scale=batch.scale)[0]
        return run

    return {"triton_paged": lambda: batch.run(), "flash_varlen": flash(False), "flash_varlen+gather": flash(True),
            "cudnn_varlen": cudnn(False), "cudnn_varlen+gather": cudnn(True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "prefill-backends.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings()
    print(f"torch {torch.__version__}; flash forward: {torch.ops.aten._flash_attention_forward.default._schema}")
    print(f"{'shape':10s} {'point':22s} {'backend':22s} {'us':>9s} {'TFLOP/s':>8s} {'max_err':>8s}")
    rows = []
    with out.open("w") as f:
        for shape, (head_dim, hq, hkv) in SHAPES.items():
            for point, specs in POINTS.items():
                batch = Batch(specs, head_dim, hq, hkv)
                expected = batch.run(op=reference.paged_attention).float()
                for name, run in backends(batch).items():
                    row = {"name": f"prefill_backends/{shape}/{point}/{name}", "shape": shape, "point": point,
                           "backend": name, "specs": specs,
                           "floor_us": batch.flops / ceilings.matmul_rate * 1e6}
                    try:
                        row["max_err"] = float((run().float() - expected).abs().max())
                        ms = triton.testing.do_bench(run, warmup=5, rep=40, return_mode="median")
                        row.update(us=ms * 1e3, tflops=batch.flops / (ms * 1e-3) / 1e12,
                                   fraction_of_floor=row["floor_us"] / (ms * 1e3))
                    except Exception as exc:  # noqa: BLE001 - a backend that cannot run is a result too
                        row["error"] = f"{type(exc).__name__}: {str(exc)[-200:]}"
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    shown = (f"{row['us']:9.1f} {row['tflops']:8.0f} {row['max_err']:8.4f}" if "us" in row
                             else row["error"][:80])
                    print(f"{shape:10s} {point:22s} {name:22s} {shown}")
                del batch
                torch.cuda.empty_cache()
    write_rows(str(out.with_suffix(".json")), ceilings, rows)


if __name__ == "__main__":
    main()
