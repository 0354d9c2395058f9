"""Tensor parallelism on two GPUs: what one all-reduce costs, and what TP=2 does to batch-1 decode.

- ``allreduce``: NCCL (``torch.distributed.all_reduce``, what the engine runs) against torch's
  symmetric-memory one-shot and two-shot all-reduce, for bf16 messages of 8 KB to 1 MB, eager and
  captured in a CUDA graph (a graph of ``GRAPH_REPEATS`` all-reduces, timed per all-reduce). Two
  processes, one per GPU. NVLink multicast is never asked for (multimem all-reduce is not measured,
  and no variable enables it): the machines keep it off.
- ``decode``: Llama-3-8B shape (random weights), batch 1, a 128-token prompt, 64 new tokens: the
  median decode step with one GPU and with two, beside the two-GPU floor, half the one-GPU floor
  plus two all-reduces a layer at the measured 8 KB NCCL time in a graph.

``python benchmarks/tp_bench.py allreduce|decode|all [--out FILE]`` on a machine with two GPUs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tokenmill.bench.hardware import Ceilings, environment, measure_ceilings, time_cuda

SIZES = (8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20)  # bytes of bf16
GRAPH_REPEATS = 20
SHAPE = "llama3-8b"


def _implementations(x: torch.Tensor, group_name: str) -> dict[str, Callable[[], object]]:
    """Each all-reduce of the bf16 tensor ``x`` (held in symmetric memory) over the group, in place."""
    ops = torch.ops.symm_mem
    out = torch.empty_like(x)
    return {
        "nccl": lambda: dist.all_reduce(x),
        "symm_mem_one_shot": lambda: ops.one_shot_all_reduce_out(x, "sum", group_name, out),
        "symm_mem_two_shot": lambda: ops.two_shot_all_reduce_(x, "sum", group_name),
    }


def _time_graph(op: Callable[[], object]) -> float:
    """Seconds per call of ``op`` replayed from a CUDA graph of ``GRAPH_REPEATS`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op()  # outside the capture: lazy set-up (NCCL's communicator, symmetric-memory handles)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_REPEATS):
            op()
    return time_cuda(graph.replay) / GRAPH_REPEATS


def _allreduce_rank(rank: int, init_method: str, results: multiprocessing.Queue) -> None:
    """One rank of the microbenchmark; both ranks run the same calls in the same order."""
    import torch.distributed._symmetric_memory as symm_mem

    from tokenmill.distributed import init_group

    init_group(torch.device("cuda", rank), rank, 2, init_method, timedelta(minutes=5))
    group = dist.group.WORLD
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed before torch 2.8, a no-op after
    if enable is not None:
        enable(group.group_name)
    rows = []
    for size in SIZES:
        x = symm_mem.empty(size // 2, dtype=torch.bfloat16, device=f"cuda:{rank}").normal_()
        symm_mem.rendezvous(x, group.group_name)
        for name, op in _implementations(x, group.group_name).items():
            dist.barrier()
            eager = time_cuda(op, warmup=5, repeat=50)
            dist.barrier()
            graphed = _time_graph(op)
            rows.append({"name": f"allreduce/{name}/{size // 1024}KB", "implementation": name, "bytes": size,
                         "eager_us": eager * 1e6, "graph_us": graphed * 1e6})
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def bench_allreduce() -> list[dict]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as store:
        init_method = f"file://{store}/store"
        ranks = [context.Process(target=_allreduce_rank, args=(rank, init_method, results)) for rank in range(2)]
        for process in ranks:
            process.start()
        rows = results.get(timeout=600)
        for process in ranks:
            process.join(60)
    return rows


def _median_decode_ms(tensor_parallel_size: int, ceilings: Ceilings) -> tuple[float, float]:
    """(median decode step, its one-GPU floor) in ms at batch 1."""
    from tokenmill.bench.offline import make_engine, random_prompt, release, run_metered
    from tokenmill.sampling_params import SamplingParams

    engine = make_engine(SHAPE, max_num_seqs=8, tensor_parallel_size=tensor_parallel_size)
    try:
        prompt = random_prompt(random.Random(0), 128, engine.model_config.vocab_size)
        engine.add_request("r0", prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), stream=False)
        records, _, _ = run_metered(engine, ceilings)
        decode = [r for r in records if r.decode]
        return statistics.median(r.seconds for r in decode) * 1e3, statistics.median(r.floor for r in decode) * 1e3
    finally:
        engine.core.shutdown()
        del engine
        release()


def bench_decode(ceilings: Ceilings, allreduce_us: float) -> list[dict]:
    """TP=1 then TP=2; the TP=2 floor is half the TP=1 floor (each GPU reads half the weights and half the
    KV) plus two all-reduces a layer of ``allreduce_us``."""
    from tokenmill.bench.shapes import SHAPES

    one_ms, one_floor = _median_decode_ms(1, ceilings)
    two_ms, _ = _median_decode_ms(2, ceilings)
    layers = SHAPES[SHAPE]["num_hidden_layers"]
    two_floor = one_floor / 2 + 2 * layers * allreduce_us / 1e3
    return [{"name": f"decode/{SHAPE}/tp1", "batch": 1, "context": 128, "ms_per_step": one_ms,
             "floor_ms": one_floor, "fraction_of_floor": one_floor / one_ms},
            {"name": f"decode/{SHAPE}/tp2", "batch": 1, "context": 128, "ms_per_step": two_ms,
             "floor_ms": two_floor, "fraction_of_floor": two_floor / two_ms, "allreduce_us_in_floor": allreduce_us,
             "speedup_over_tp1": one_ms / two_ms}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("allreduce", "decode", "all"))
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--allreduce-us", type=float, default=17.9,
                        help="8 KB all-reduce time for the decode floor when the allreduce part is not run")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("the tensor-parallel benchmark needs two CUDA devices", file=sys.stderr)
        return 2
    ceilings = measure_ceilings()
    rows: list[dict] = []
    allreduce_us = args.allreduce_us
    if args.part in ("allreduce", "all"):
        rows += bench_allreduce()
        allreduce_us = next(r["graph_us"] for r in rows if r["implementation"] == "nccl" and r["bytes"] == SIZES[0])
    if args.part in ("decode", "all"):
        rows += bench_decode(ceilings, allreduce_us)
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"environment": environment(ceilings, " ".join(sys.argv)),
                                              "rows": rows}, indent=2))
    return 0
