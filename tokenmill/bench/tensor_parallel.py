"""Tensor parallelism on two GPUs: what one all-reduce costs, and what TP=2 does to batch-1 decode.

- ``allreduce``: NCCL (``torch.distributed.all_reduce``, what the engine runs) against torch's
  symmetric-memory one-shot and two-shot all-reduce, for bf16 messages of 8 KB to 1 MB, eager and
  captured in a CUDA graph (a graph of ``GRAPH_REPEATS`` all-reduces, timed per all-reduce). Two
  processes, one per GPU. NVLink multicast is never asked for (multimem all-reduce is not measured,
  and no variable enables it): the machines keep it off.
- ``decode``: Llama-3-8B shape (random weights), batch 1, a 128-token prompt, 64 new tokens: the
  median decode step with one GPU and with two, beside the floor: each GPU's share of the step's
  bytes and FLOPs, plus two all-reduces a layer at the measured 8 KB NCCL time in a graph.
- ``70b``: Llama-3-70B shape (random weights; it does not fit one GPU in bf16) on two GPUs: decode
  steps at batch 1, 8, 32 and 64, and the standard workload (256 requests, prompt and output
  lengths uniform in [100, 1024]), beside the same floors.

``python benchmarks/suite/tp_bench.py allreduce|decode|70b|all [--out FILE]`` on a machine with two GPUs.
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
from dataclasses import replace
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
    assert group is not None  # init_group made it
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed before torch 2.8, a no-op after
    if enable is not None:
        enable(group.group_name)
    rows = []
    for size in SIZES:
        x = symm_mem.empty(size // 2, dtype=torch.bfloat16, device=torch.device("cuda", rank)).normal_()
        symm_mem.rendezvous(x, group.group_name)
        for name, op in _implementations(x, group.group_name).items():
            dist.barrier()
            eager = time_cuda(op, warmup=5, repeat=50)
            dist.barrier()
            graphed = _time_graph(op)
            rows.append(
                {
                    "name": f"allreduce/{name}/{size // 1024}KB",
                    "implementation": name,
                    "bytes": size,
                    "eager_us": eager * 1e6,
                    "graph_us": graphed * 1e6,
                }
            )
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


def _engine_and_cost(shape: str, tensor_parallel_size: int, max_num_seqs: int):
    """A random-weight engine and the cost model of one GPU's share of its steps: every projection
    splits evenly over the ranks, so the whole model's are rank 0's times the ranks."""
    from tokenmill.bench.offline import make_engine
    from tokenmill.bench.shapes import StepCostModel

    engine = make_engine(
        shape, max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, tensor_parallel_size=tensor_parallel_size
    )
    shard = StepCostModel.of(engine.core.runner.model, engine.model_config)
    return engine, replace(shard, body_params=shard.body_params * tensor_parallel_size, split=tensor_parallel_size)


def _allreduce_ms_per_step(shape: str, tensor_parallel_size: int, allreduce_us: float) -> float:
    """Two all-reduces a layer (after attention and after the MLP), each at least ``allreduce_us``."""
    from tokenmill.bench.shapes import SHAPES

    return 2 * SHAPES[shape]["num_hidden_layers"] * allreduce_us / 1e3 if tensor_parallel_size > 1 else 0.0


def bench_decode(
    ceilings: Ceilings,
    allreduce_us: float,
    shape: str = SHAPE,
    sizes: tuple[int, ...] = (1,),
    splits: tuple[int, ...] = (1, 2),
    workload: bool = False,
) -> list[dict]:
    """Decode steps of ``sizes`` sequences (128-token prompts, 64 new tokens) with the model split
    over each of ``splits`` GPUs, then (``workload``) the standard workload on the widest split.
    Floors: each GPU's share of the bytes and FLOPs, plus two all-reduces a layer at ``allreduce_us``."""
    from tokenmill.bench.offline import (
        add_workload,
        random_prompt,
        release,
        run_metered,
        run_workload,
        standard_workload,
    )
    from tokenmill.sampling_params import SamplingParams

    rows, by_split = [], {}
    for tp in splits:
        engine, cost = _engine_and_cost(shape, tp, max(256 if workload else 1, *sizes))
        allreduce_ms = _allreduce_ms_per_step(shape, tp, allreduce_us)
        try:
            rng = random.Random(0)
            for batch in sizes:
                prompts = [random_prompt(rng, 128, engine.model_config.vocab_size) for _ in range(batch)]
                for i, prompt in enumerate(prompts):
                    engine.add_request(
                        f"b{batch}-{i}",
                        prompt,
                        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                        stream=False,
                    )
                records, _, _ = run_metered(engine, ceilings, cost)
                decode = [r for r in records if r.decode and r.batch_size == batch]
                ms = statistics.median(r.seconds for r in decode) * 1e3
                floor = statistics.median(r.floor for r in decode) * 1e3 + allreduce_ms
                by_split[(tp, batch)] = ms
                row = {
                    "name": f"decode/{shape}/tp{tp}/b{batch}",
                    "batch": batch,
                    "context": 128,
                    "tensor_parallel_size": tp,
                    "ms_per_step": ms,
                    "floor_ms": floor,
                    "fraction_of_floor": floor / ms,
                    "allreduce_us_in_floor": allreduce_us if tp > 1 else 0.0,
                }
                if (1, batch) in by_split and tp > 1:
                    row["speedup_over_tp1"] = by_split[(1, batch)] / ms
                rows.append(row)
            if workload and tp == max(splits):
                requests = standard_workload(vocab=engine.model_config.vocab_size)
                add_workload(engine, requests[:16], prefix="warm")
                run_metered(engine, ceilings, cost)
                result = run_workload(engine, ceilings, requests, cost=cost)
                result["floor_seconds"] += result["steps"] * allreduce_ms / 1e3
                result["fraction_of_floor"] = result["floor_seconds"] / result["seconds"]
                rows.append({"name": f"throughput/{shape}/tp{tp}", "tensor_parallel_size": tp, **result})
        finally:
            engine.core.shutdown()
            del engine
            release()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "part",
        choices=("allreduce", "decode", "70b", "all"),
        help="decode: Llama-3-8B at batch 1 on one GPU and two; 70b: Llama-3-70B on two, "
        "a batch sweep and the standard workload; all: the all-reduces, then both",
    )
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument(
        "--allreduce-us",
        type=float,
        default=17.9,
        help="8 KB all-reduce time for the decode floor when the allreduce part is not run",
    )
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
    if args.part in ("70b", "all"):
        rows += bench_decode(ceilings, allreduce_us, "llama3-70b", sizes=(1, 8, 32, 64), splits=(2,), workload=True)
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({"environment": environment(ceilings, " ".join(sys.argv)), "rows": rows}, indent=2)
        )
    return 0
