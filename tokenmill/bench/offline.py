"""Engine benchmarks on the GPU, each figure beside its floor and its peer.

``tokenmill bench latency|batch|throughput|features|startup|all`` runs
tokenmill on random weights in real shapes, meters every step's floor (bytes
over measured bandwidth, FLOPs over measured matrix rate, whichever is
larger), and runs transformers on the same GPU in the same call as the peer.
Results go to JSON (one row per figure, each with ``name``, its figures,
``floor`` and ``fraction_of_floor`` = floor / measured) and a table on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.bench import hf_peer
from tokenmill.bench.hardware import Ceilings, environment, measure_ceilings, time_cuda
from tokenmill.bench.shapes import SHAPES, StepCostModel, shape_dir
from tokenmill.engine.config import KV_CACHE_DTYPES, EngineConfig
from tokenmill.engine.frontend.llm_engine import LLMEngine
from tokenmill.loader.kv_layout import QUANTIZED_KV_DTYPES
from tokenmill.models.registry import load_model_config
from tokenmill.sampling_params import SamplingParams


@dataclass
class StepRecord:
    seconds: float
    floor: float
    decode: bool
    batch_size: int
    tokens: int


def make_engine(shape: str, **options: Any) -> LLMEngine:
    defaults = dict(dtype="bfloat16", device="cuda", random_weights=True, max_model_len=8192)
    return LLMEngine(EngineConfig(model=str(shape_dir(shape)), **{**defaults, **options}))


def release() -> None:
    """Free GPU memory between engines and peers, which each take most of it (the caller
    drops its references first)."""
    gc.collect()
    torch.cuda.empty_cache()


def run_metered(
    engine: LLMEngine, ceilings: Ceilings, cost: StepCostModel | None = None
) -> tuple[list[StepRecord], float, int]:
    """Step the engine until idle, recording each step's time and floor (of ``cost``, by default
    the engine's own model's). Returns (steps, wall seconds, peak KV blocks in use)."""
    cost = cost or StepCostModel.of(engine.core.runner.model, engine.model_config)
    schedule = engine.core.scheduler.schedule
    shapes: list[tuple[list[int], list[int], int]] = []

    def metered_schedule():
        batch = schedule()
        contexts = [s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_tokens)]
        sampled = sum(1 for s, c in zip(batch.seqs, contexts) if c == s.num_tokens)
        shapes.append((batch.num_tokens, contexts, sampled))
        return batch

    engine.core.scheduler.schedule = metered_schedule  # type: ignore[method-assign]
    seconds, peak = [], 0
    torch.cuda.synchronize()
    started = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            seconds.append(time.perf_counter() - t0)
            peak = max(peak, engine.get_stats().kv_blocks_in_use)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
    finally:
        engine.core.scheduler.schedule = schedule  # type: ignore[method-assign]
    records = []  # floors are computed after the run, so metering adds no host work to the steps
    for step_seconds, (query_lens, contexts, sampled) in zip(seconds, shapes):
        if query_lens:
            floor = ceilings.floor(*cost.step(query_lens, contexts, sampled, kv_dtype=engine.core.kv_dtype))
            records.append(StepRecord(step_seconds, floor, max(query_lens) == 1, len(query_lens), sum(query_lens)))
    return records, wall, peak


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def decode_steps(
    engine: LLMEngine,
    ceilings: Ceilings,
    prompts: list[list[int]],
    new_tokens: int,
    sampling: dict[str, Any] | None = None,
) -> dict:
    """Median decode step of ``prompts`` generating ``new_tokens`` each (prefill excluded), greedy
    unless ``sampling`` gives other ``SamplingParams`` fields."""
    params = SamplingParams(**{"temperature": 0, **(sampling or {})}, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, stream=False)
    records, _, _ = run_metered(engine, ceilings)
    decode = [r for r in records if r.decode and r.batch_size == len(prompts)]
    if not decode:
        raise ValueError(
            f"no step decoded all {len(prompts)} prompts at once: generate more than the "
            "prefill steps, or give the engine room for every prompt"
        )
    ms = statistics.median(r.seconds for r in decode) * 1e3
    floor_ms = statistics.median(r.floor for r in decode) * 1e3
    result = {
        "ms_per_step": ms,
        "tok_per_s": len(prompts) / ms * 1e3,
        "floor_ms": floor_ms,
        "fraction_of_floor": floor_ms / ms,
        "steps_timed": len(decode),
    }
    graphs = engine.core.runner.graphs
    if graphs is not None and len(prompts) == 1:
        # The step's graph alone on the GPU (decoder, LM head, greedy argmax): what the step
        # costs beyond it is the GPU idling on the host. One prompt only: the graph replays the
        # last step's inputs, and a batch's last step holds only the requests that finished last.
        longest = max(len(p) for p in prompts) + new_tokens
        result["graph_replay_ms"] = time_cuda(graphs.graph_for(len(prompts), longest).replay) * 1e3
    return result


# ------------------------------------------------------------------ benchmarks
def bench_latency(ceilings: Ceilings, shapes: list[str], contexts: list[int], peer: bool) -> list[dict]:
    rows = []
    for shape in shapes:
        engine = make_engine(shape, max_num_seqs=8)
        vocab = engine.model_config.vocab_size
        rng = random.Random(0)
        for ctx in contexts:
            result = decode_steps(engine, ceilings, [random_prompt(rng, ctx, vocab)], 64)
            rows.append({"name": f"latency/{shape}/ctx{ctx}", "batch": 1, "context": ctx, **result})
        del engine
        release()
        if peer:
            ms = hf_peer.decode_ms_per_step(shape, batch=1, context=contexts[0])
            rows[-len(contexts)]["peer_transformers_ms_per_step"] = ms
    return rows


def bench_batch(
    ceilings: Ceilings, shapes: list[str], sizes: list[int], peer_sizes: list[int], peer: bool
) -> list[dict]:
    rows = []
    for shape in shapes:
        engine = make_engine(shape, max_num_seqs=max(sizes))
        prompt = random_prompt(random.Random(1), 128, engine.model_config.vocab_size)
        base = None
        for size in sizes:
            result = decode_steps(engine, ceilings, [prompt] * size, 64)
            base = base or result["tok_per_s"]
            rows.append(
                {
                    "name": f"batch/{shape}/b{size}",
                    "batch": size,
                    "context": 128,
                    **result,
                    "speedup_over_one_stream": result["tok_per_s"] / base,
                }
            )
        del engine
        release()
        if peer:
            for row in rows[-len(sizes) :]:
                if row["batch"] in peer_sizes:
                    ms = hf_peer.decode_ms_per_step(shape, batch=row["batch"], context=128)
                    row["peer_transformers_ms_per_step"] = ms
                    row["peer_transformers_tok_per_s"] = row["batch"] / ms * 1e3
    return rows


def standard_workload(
    num_requests: int = 256, low: int = 100, high: int = 1024, seed: int = 0, vocab: int = 32000
) -> list[tuple[list[int], int]]:
    """nano-vllm's offline workload: prompt and output lengths uniform in [low, high]."""
    rng = random.Random(seed)
    return [(random_prompt(rng, rng.randint(low, high), vocab), rng.randint(low, high)) for _ in range(num_requests)]


def add_workload(
    engine: LLMEngine, workload: list[tuple[list[int], int]], prefix: str = "w", sampling: dict[str, Any] | None = None
) -> None:
    """Queue (prompt, output length) pairs as ``ignore_eos`` requests, greedy unless ``sampling``
    gives other ``SamplingParams`` fields."""
    for i, (prompt, out_len) in enumerate(workload):
        params = SamplingParams(**{"temperature": 0, **(sampling or {})}, max_tokens=out_len, ignore_eos=True)
        engine.add_request(f"{prefix}{i}", prompt, params, stream=False)


def run_workload(
    engine: LLMEngine,
    ceilings: Ceilings,
    workload: list[tuple[list[int], int]],
    sampling: dict[str, Any] | None = None,
    cost: StepCostModel | None = None,
) -> dict:
    add_workload(engine, workload, sampling=sampling)
    before = engine.get_stats()
    records, wall, peak = run_metered(engine, ceilings, cost)
    after = engine.get_stats()
    out_tokens = sum(n for _, n in workload)
    total_tokens = out_tokens + sum(len(p) for p, _ in workload)
    floor = sum(r.floor for r in records)
    running = [r.batch_size for r in records if r.decode]
    return {
        "requests": len(workload),
        "seconds": wall,
        "output_tok_per_s": out_tokens / wall,
        "total_tok_per_s": total_tokens / wall,
        "floor_seconds": floor,
        "fraction_of_floor": floor / wall,
        "steps": len(records),
        "mean_decode_batch": statistics.mean(running) if running else 0.0,
        # Requests running at once at the busiest step (a cache that holds more runs more together).
        "peak_batch": max((r.batch_size for r in records), default=0),
        "peak_kv_blocks": peak,
        # Kernel variants compiled inside the run's steps (each a wait the warm-up should have taken).
        "compiles_during_run": after.num_compiles_after_startup - before.num_compiles_after_startup,
        # Sequences sent back to the queue for want of KV blocks (each recomputes its tokens later).
        "preemptions": after.num_preemptions - before.num_preemptions,
    }


def bench_throughput(
    ceilings: Ceilings, shapes: list[str], peer: bool, peer_requests: int, checkpoint: Callable[[list[dict]], None]
) -> list[dict]:
    """tokenmill on every shape first (results saved), then the peers: transformers'
    continuous batching keeps its cache after it returns, so nothing may follow it."""
    rows, workloads = [], []
    for shape in shapes:
        engine = make_engine(shape, max_num_seqs=256, max_num_batched_tokens=8192)
        workloads.append(standard_workload(vocab=engine.model_config.vocab_size))
        rows.append({"name": f"throughput/{shape}", **run_workload(engine, ceilings, workloads[-1])})
        del engine
        release()
        checkpoint(rows)
    if peer:
        for row, shape, workload in zip(rows, shapes, workloads):
            peer_result = hf_peer.generate_batch(shape, workload[:peer_requests])
            row["peer_transformers_generate_batch"] = peer_result
            if peer_result["output_tok_per_s"] > 0:
                row["speedup_over_peer"] = row["output_tok_per_s"] / peer_result["output_tok_per_s"]
            checkpoint(rows)
    return rows


def bench_features(ceilings: Ceilings) -> list[dict]:
    # CUDA graphs on and off: decode steps of a small model, where launch gaps dominate.
    rows = _decode_on_off(ceilings, "cuda_graphs", lambda on: {"enforce_eager": not on}, (1, 64))
    # Host/GPU overlap on and off: one stream and a full batch, where the host's share of a
    # step is largest.
    rows += _decode_on_off(ceilings, "async_scheduling", lambda on: {"async_scheduling": on}, (1, 256))
    # Programmatic dependent launch of the Triton kernels, where the step is a chain of kernels.
    pdl_was_on = os.environ.get("TOKENMILL_PDL", "1") != "0"
    rows += _decode_on_off(ceilings, "pdl", _switch_pdl, (1, 32), shape="llama3-8b")
    _switch_pdl(pdl_was_on)
    # Continuous batching against static waves on the standard workload.
    for static in (False, True):
        engine = make_engine("qwen3-0.6b", max_num_seqs=64, max_num_batched_tokens=8192, static_batching=static)
        result = run_workload(engine, ceilings, standard_workload(128, vocab=engine.model_config.vocab_size))
        result["utilisation"] = result["mean_decode_batch"] / 64
        mode = "static" if static else "continuous"
        if not static:
            per_token = engine.model_config.kv_layout().bytes_per_token(engine.core.dtype)
            paged = result["peak_kv_blocks"] * engine.config.block_size * per_token
            contiguous = 64 * engine.max_model_len * per_token
            rows.append(
                {
                    "name": "features/paged_kv_memory",
                    "paged_peak_bytes": paged,
                    "contiguous_max_len_bytes": contiguous,
                    "ratio": contiguous / paged,
                }
            )
        rows.append({"name": f"features/batching/{mode}", **result})
        del engine
        release()
    # Prefix caching on a workload whose prompts share a long system prefix.
    for caching in (True, False):
        engine = make_engine("qwen3-0.6b", max_num_seqs=128, enable_prefix_caching=caching)
        rng = random.Random(3)
        vocab = engine.model_config.vocab_size
        prefix = random_prompt(rng, 1024, vocab)
        workload = [(prefix + random_prompt(rng, 32, vocab), 64) for _ in range(128)]
        result = run_workload(engine, ceilings, workload)
        stats = engine.get_stats()
        result["prefix_hit_rate"] = stats.prefix_cache_hits / max(1, stats.prefix_cache_queries)
        rows.append({"name": f"features/prefix_caching/{'on' if caching else 'off'}", **result})
        del engine
        release()
    rows.extend(_sampling_and_pruning_costs())
    return rows


def _decode_on_off(
    ceilings: Ceilings,
    feature: str,
    options: Callable[[bool], dict],
    sizes: tuple[int, ...],
    shape: str = "llama3.2-1b",
) -> list[dict]:
    """Decode steps of ``shape`` at each batch size, with ``feature`` on, then off."""
    rows = []
    for on in (True, False):
        engine = make_engine(shape, max_num_seqs=max(sizes), **options(on))
        prompt = random_prompt(random.Random(2), 128, engine.model_config.vocab_size)
        for size in sizes:
            result = decode_steps(engine, ceilings, [prompt] * size, 32)
            rows.append({"name": f"features/{feature}/{'on' if on else 'off'}/b{size}", **result})
        del engine
        release()
    return rows


def _switch_pdl(on: bool) -> dict:
    """PDL is a launch option of the Triton kernels, set by the environment (see triton_launch);
    no engine option."""
    from tokenmill.kernels.triton_launch import pdl_supported

    os.environ["TOKENMILL_PDL"] = "1" if on else "0"
    pdl_supported.cache_clear()
    return {}


def _sampling_and_pruning_costs() -> list[dict]:
    """What sampling on the device and logits pruning save, timed on the Qwen3-8B head."""
    hidden, vocab, batch, prefill = 4096, 151936, 256, 8192
    head = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    logits = torch.randn(batch, vocab, device="cuda", dtype=torch.float32)
    ids = logits.argmax(dim=-1)
    pinned_logits = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True)
    host = time_cuda(lambda: pinned_logits.copy_(logits, non_blocking=True))
    device = time_cuda(lambda: ids.cpu())
    rows_all = torch.randn(prefill, hidden, device="cuda", dtype=torch.bfloat16)
    all_rows = time_cuda(lambda: rows_all @ head.T)
    pruned = time_cuda(lambda: rows_all[-batch:] @ head.T)
    return [
        {
            "name": "features/sampling_on_device",
            "batch": batch,
            "bytes_to_host_on_device_sampling": batch * 8,
            "bytes_to_host_copying_logits": batch * vocab * 4,
            "ms_copy_ids": device * 1e3,
            "ms_copy_logits": host * 1e3,
        },
        {
            "name": "features/logits_pruning",
            "prefill_tokens": prefill,
            "sampled_rows": batch,
            "ms_lm_head_all_rows": all_rows * 1e3,
            "ms_lm_head_sampled_rows": pruned * 1e3,
            "flops_saved": 2.0 * (prefill - batch) * vocab * hidden,
        },
    ]


def bench_models(
    ceilings: Ceilings,
    shapes: list[str],
    sizes: list[int],
    peer: bool,
    peer_requests: int,
    checkpoint: Callable[[list[dict]], None],
) -> list[dict]:
    """Per model: batch-1 decode at a short and a long context, a batch sweep and the standard
    workload, each beside its floor (sliding layers read at most their window); the KV bytes per
    token against a cache giving every layer its own full-length cache. Then the peers:
    transformers' decode step, and its continuous batching on ``peer_requests`` of the workload
    (none when 0; last, as in ``bench_throughput``: it keeps its cache after it returns)."""
    rows: list[dict] = []
    workloads = []
    for shape in shapes:
        engine = make_engine(shape, max_num_seqs=256, max_num_batched_tokens=8192)
        cfg, dtype = engine.model_config, engine.core.dtype
        layout = cfg.kv_layout()
        rng = random.Random(0)
        full = layout.full_length_bytes_per_token(dtype)
        rows.append(
            {
                "name": f"models/{shape}/kv_bytes",
                "kv_blocks_per_group": [p.num_blocks for p in engine.core.kv.pools],
                **{
                    f"ctx{n}": {
                        "held": layout.bytes_held(n, dtype),
                        "every_layer_full_length": full * n,
                        "saving": 1 - layout.bytes_held(n, dtype) / (full * n),
                    }
                    for n in (4096, 32768, 131072)
                },
            }
        )
        for ctx in (128, 4096):
            result = decode_steps(engine, ceilings, [random_prompt(rng, ctx, cfg.vocab_size)], 64)
            rows.append({"name": f"models/{shape}/latency/ctx{ctx}", "batch": 1, "context": ctx, **result})
        prompt = random_prompt(rng, 128, cfg.vocab_size)
        for size in sizes:
            result = decode_steps(engine, ceilings, [prompt] * size, 64)
            rows.append({"name": f"models/{shape}/batch/b{size}", "batch": size, "context": 128, **result})
        workloads.append(standard_workload(vocab=cfg.vocab_size))
        rows.append({"name": f"models/{shape}/throughput", **run_workload(engine, ceilings, workloads[-1])})
        checkpoint(rows)
        del engine
        release()
    if peer:
        by_name = {row["name"]: row for row in rows}
        for shape in shapes:
            ms = hf_peer.decode_ms_per_step(shape, batch=1, context=128)
            by_name[f"models/{shape}/latency/ctx128"]["peer_transformers_ms_per_step"] = ms
            checkpoint(rows)
        for shape, workload in zip(shapes, workloads):
            if peer_requests < 1:
                break
            subset = hf_peer.generate_batch(shape, workload[:peer_requests])
            by_name[f"models/{shape}/throughput"]["peer_transformers_generate_batch"] = subset
            checkpoint(rows)
    return rows


def bench_kv_cache_dtypes(
    ceilings: Ceilings,
    shape: str = "llama3-8b",
    dtypes: tuple[str, ...] = ("auto", "fp8", "int8"),
    kv_budget_gib: float = 8.0,
) -> list[dict]:
    """Each ``kv_cache_dtype`` on ``shape``: decode at batch 64 over 8k-token contexts (bound by
    reading the KV cache) and at batch 1 over 128 tokens, each beside its floor; then a KV-bound
    workload (256 requests of 1024 prompt + 512 output tokens) in the same KV memory for every
    dtype (``kv_budget_gib``), where a smaller cache holds more requests at once."""
    rows: list[dict] = []
    for name in dtypes:
        engine = make_engine(
            shape, max_num_seqs=64, max_model_len=8192 + 128, max_num_batched_tokens=8192, kv_cache_dtype=name
        )
        vocab, rng = engine.model_config.vocab_size, random.Random(4)
        # Chunked prefill takes one step per 8192 prompt tokens; the first requests keep decoding
        # through it, so each generates past it and 32 steps run with all 64 decoding.
        long = decode_steps(engine, ceilings, [random_prompt(rng, 8192, vocab) for _ in range(64)], 64 + 32)
        rows.append({"name": f"kv_cache/{shape}/{name}/b64_ctx8192", "kv_cache_dtype": name, **long})
        short = decode_steps(engine, ceilings, [random_prompt(rng, 128, vocab)], 64)
        rows.append({"name": f"kv_cache/{shape}/{name}/b1_ctx128", "kv_cache_dtype": name, **short})
        del engine
        release()
    for name in dtypes:
        engine, workload = kv_bound_workload(shape, name, kv_budget_gib)
        result = run_workload(engine, ceilings, workload)
        rows.append(
            {
                "name": f"kv_cache/{shape}/{name}/kv_bound_workload",
                "kv_cache_dtype": name,
                "kv_budget_gib": kv_budget_gib,
                "kv_blocks": engine.config.num_kv_blocks,
                **result,
            }
        )
        del engine
        release()
    return rows


def bench_kv_cache_long(
    ceilings: Ceilings,
    shape: str = "llama3-8b",
    dtypes: tuple[str, ...] = ("auto", "fp8", "int8"),
    checkpoint: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Each ``kv_cache_dtype`` on ``long_workload``, in the whole GPU's memory: the KV cache alone
    bounds how many requests run together, so a cache of half the bytes a token runs about twice as
    many. Each row gives its output rate against ``auto``'s (where auto ran first)."""
    rows: list[dict] = []
    for name in dtypes:
        engine, workload = long_workload(shape, name)
        result = run_workload(engine, ceilings, workload)
        rows.append(
            {
                "name": f"kv_cache/{shape}/{name}/long_workload",
                "kv_cache_dtype": name,
                "prompt_len": len(workload[0][0]),
                "output_len": workload[0][1],
                "kv_tokens": min(pool.num_blocks for pool in engine.core.kv.pools) * engine.core.kv.block_size,
                **result,
            }
        )
        if rows[0]["kv_cache_dtype"] == "auto":
            rows[-1]["output_speedup_vs_auto"] = result["output_tok_per_s"] / rows[0]["output_tok_per_s"]
            rows[-1]["peak_batch_vs_auto"] = result["peak_batch"] / rows[0]["peak_batch"]
        if checkpoint:
            checkpoint(rows)
        del engine
        release()
    return rows


def long_workload(
    shape: str, kv_cache_dtype: str, num_requests: int = 1024, prompt_len: int = 2048, output_len: int = 1024
) -> tuple[LLMEngine, list[tuple[list[int], int]]]:
    """An engine with the engine's default memory budget and room for ``num_requests`` sequences in a
    step, and that many requests of ``prompt_len`` prompt and ``output_len`` output tokens (all queued
    at once: more than the KV cache holds in any dtype)."""
    engine = make_engine(
        shape,
        max_num_seqs=num_requests,
        max_model_len=prompt_len + output_len,
        max_num_batched_tokens=8192,
        kv_cache_dtype=kv_cache_dtype,
    )
    rng = random.Random(6)
    return engine, [
        (random_prompt(rng, prompt_len, engine.model_config.vocab_size), output_len) for _ in range(num_requests)
    ]


def kv_bound_workload(
    shape: str, kv_cache_dtype: str, kv_budget_gib: float = 8.0
) -> tuple[LLMEngine, list[tuple[list[int], int]]]:
    """An engine whose KV cache holds ``kv_budget_gib`` of ``kv_cache_dtype`` blocks, and 256 requests
    of 1024 prompt + 512 output tokens: more than that cache holds at once in the model's dtype."""
    kv_dtype = QUANTIZED_KV_DTYPES.get(EngineConfig(kv_cache_dtype=kv_cache_dtype).kv_cache_dtype, torch.bfloat16)
    per_block = load_model_config(shape_dir(shape)).kv_layout().bytes_per_token(kv_dtype) * 16
    engine = make_engine(
        shape,
        max_num_seqs=256,
        max_model_len=2048,
        max_num_batched_tokens=8192,
        kv_cache_dtype=kv_cache_dtype,
        num_kv_blocks=int(kv_budget_gib * (1 << 30) // per_block),
        block_size=16,
    )
    rng = random.Random(5)
    return engine, [(random_prompt(rng, 1024, engine.model_config.vocab_size), 512) for _ in range(256)]


# The start-up benchmark's sampled prompt: every filter the sampler has but min-p, and a penalty.
SAMPLED = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1}


def time_to_first_token(engine: LLMEngine, prompt: list[int], sampling: dict[str, Any] | None = None) -> float:
    """Seconds from adding a request (alone) to its first token."""
    params = SamplingParams(**{"temperature": 0, **(sampling or {})}, max_tokens=1)
    started = time.perf_counter()
    engine.add_request(f"ttft-{started}", prompt, params, stream=False)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - started


def bench_startup(ceilings: Ceilings, shape: str = "llama3-8b") -> list[dict]:
    """Start-up, then the first requests' time to first token, each beside its floor (the prefill
    step's weights and FLOPs): the first 517-token prompt and a second one (a kernel compiled on
    the request path shows as their difference), a sampled one, and 100- and 4,000-token prompts
    (each timed after one of its length). Every prompt is new: no prefix is cached."""
    started = time.perf_counter()
    engine = make_engine(shape, max_num_seqs=256)
    total = time.perf_counter() - started
    runner = engine.core.runner
    graphs, prefill, mixed = runner.graphs, runner.prefill_graphs, runner.mixed_graphs
    phases = engine.startup_seconds
    rows: list[dict[str, Any]] = [
        {
            "name": f"startup/{shape}",
            "seconds_total": total,
            **phases,
            "max_num_batched_tokens": engine.core.config.max_num_batched_tokens,
            "unaccounted_seconds": total - sum(phases.values()),
            "graph_capture_seconds": graphs.capture_seconds if graphs else None,
            "graph_batch_sizes": graphs.sizes if graphs else None,
            "prefill_graph_capture_seconds": prefill.capture_seconds if prefill else None,
            "prefill_graph_tokens": prefill.sizes if prefill else None,
            "prefill_long_prefix_graph_tokens": sorted(n for n, c in prefill.graphs if c != n) if prefill else None,
            "mixed_graph_capture_seconds": mixed.capture_seconds if mixed else None,
            "mixed_graph_tokens": mixed.sizes if mixed else None,
        }
    ]
    rng, vocab = random.Random(0), engine.model_config.vocab_size
    cost = StepCostModel.of(engine.core.runner.model, engine.model_config)

    def ttft_row(name: str, length: int, sampling: dict[str, Any] | None = None) -> dict:
        seconds = time_to_first_token(engine, random_prompt(rng, length, vocab), sampling)  # noqa: F821 (del below)
        floor = ceilings.floor(*cost.step([length], [length], 1))
        return {
            "name": f"ttft/{shape}/{name}",
            "prompt_tokens": length,
            "ms": seconds * 1e3,
            "floor_ms": floor * 1e3,
            "fraction_of_floor": floor / seconds,
        }

    rows += [ttft_row("first_517", 517), ttft_row("second_517", 517), ttft_row("first_sampled_517", 517, SAMPLED)]
    rows[1]["first_over_second"] = rows[1]["ms"] / rows[2]["ms"]
    for length in (100, 4000):
        time_to_first_token(engine, random_prompt(rng, length, vocab))
        rows.append(ttft_row(str(length), length))
    del engine
    release()
    return rows


# ----------------------------------------------------------------------- output
def bench_spec_decode(
    ceilings: Ceilings,
    shape: str = "llama3-8b",
    k: int = 4,
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    context: int = 1024,
    tokens_per_forward: float | None = None,
) -> list[dict]:
    """Speculative decoding's costs: the verify step's graph (``k + 1`` query tokens a sequence)
    against the one-token decode graph at each batch size, every sequence over ``context`` tokens of
    its own blocks, beside their floors; with ``tokens_per_forward`` (measured on a workload) the
    speedup it gives at each size, derived as tokens per forward × decode time / verify time. Then
    the standard workload with speculation on (its defaults) and off."""
    rows: list[dict] = []
    spec = {"method": "ngram", "num_speculative_tokens": k, "disable_by_batch_size": max(batches) + 1}
    engine = make_engine(shape, max_num_seqs=max(batches), max_model_len=context + 2 * (k + 1), speculative_config=spec)
    graphs, block_size = engine.core.runner.graphs, engine.core.kv.block_size
    assert graphs is not None, "the verify step is timed by replaying its CUDA graph"
    cost = StepCostModel.of(engine.core.runner.model, engine.model_config)
    per_seq = -(-(context + k + 1) // block_size)
    for batch in batches:
        # Distinct blocks for every sequence (block 0 and up: the KV values do not matter to the time).
        graphs.block_tables[:, :batch, :per_seq] = torch.arange(
            batch * per_seq, dtype=torch.int32, device=graphs.block_tables.device
        ).view(batch, per_seq)
        graphs.slot_mapping.fill_(-1)
        timed = {}
        for q in (1, k + 1):
            graphs.positions[: batch * q] = (context + torch.arange(q, device=graphs.positions.device)).repeat(batch)
            graphs.seq_lens[:batch] = context + q
            seconds = time_cuda(graphs.graph_for(batch, context + q, q).replay, warmup=5, repeat=30)
            timed[q] = (seconds, ceilings.floor(*cost.step([q] * batch, [context + q] * batch, batch * q)))
        (decode_s, decode_floor), (verify_s, verify_floor) = timed[1], timed[k + 1]
        row = {
            "name": f"spec_decode/{shape}/verify_b{batch}",
            "batch": batch,
            "context": context,
            "num_speculative_tokens": k,
            "decode_ms": decode_s * 1e3,
            "decode_floor_ms": decode_floor * 1e3,
            "ms_per_step": verify_s * 1e3,
            "floor_ms": verify_floor * 1e3,
            "fraction_of_floor": verify_floor / verify_s,
            "verify_over_decode": verify_s / decode_s,
        }
        if tokens_per_forward is not None:
            row["tokens_per_forward"] = tokens_per_forward
            row["derived_speedup"] = tokens_per_forward * decode_s / verify_s
        rows.append(row)
    del engine, graphs
    release()
    for on in (False, True):
        engine = make_engine(
            shape,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            speculative_config={"method": "ngram", "num_speculative_tokens": k} if on else None,
        )
        result = run_workload(engine, ceilings, standard_workload(vocab=engine.model_config.vocab_size))
        stats = engine.get_stats()
        result.update(
            spec_decode_num_drafts=stats.spec_decode_num_drafts,
            spec_decode_num_accepted_tokens=stats.spec_decode_num_accepted_tokens,
        )
        rows.append({"name": f"spec_decode/{shape}/standard_workload_{'on' if on else 'off'}", **result})
        del engine
        release()
    rows[-1]["throughput_over_off"] = rows[-1]["output_tok_per_s"] / rows[-2]["output_tok_per_s"]
    return rows


def bench_weights(
    ceilings: Ceilings,
    shapes: list[str],
    quantizations: tuple[str | None, ...] = (None, "fp8", "q8_0"),
    batches: tuple[int, ...] = (1, 8, 32, 128),
) -> list[dict]:
    """Each shape's projections in bf16, FP8 (quantized at load: a scale a row, rows quantized per
    token on FP8 tensor cores) and Q8_0, in one run: decode steps at each batch size over 128-token
    prompts, a lone 4,000-token prompt's time to first token, then the standard workload; floors count
    the packed bytes and the FP8 products at the FP8 rate. Each row but bf16's says its speed-up over bf16."""
    rows: list[dict] = []
    for shape in shapes:
        base: dict[str, float] = {}
        for quantization in quantizations:
            label = quantization or "bf16"
            engine = make_engine(
                shape, max_num_seqs=max(batches), max_num_batched_tokens=8192, quantization=quantization
            )
            vocab, rng = engine.model_config.vocab_size, random.Random(6)
            measured = []
            for batch in batches:
                result = decode_steps(engine, ceilings, [random_prompt(rng, 128, vocab) for _ in range(batch)], 64)
                measured.append({"name": f"weights/{shape}/{label}/b{batch}", "batch": batch, **result})
            time_to_first_token(engine, random_prompt(rng, 4000, vocab))  # its shapes compiled and captured
            seconds = time_to_first_token(engine, random_prompt(rng, 4000, vocab))
            floor = ceilings.floor(
                *StepCostModel.of(engine.core.runner.model, engine.model_config).step([4000], [4000], 1)
            )
            measured.append(
                {
                    "name": f"weights/{shape}/{label}/ttft_4000",
                    "prompt_tokens": 4000,
                    "ms": seconds * 1e3,
                    "floor_ms": floor * 1e3,
                    "fraction_of_floor": floor / seconds,
                }
            )
            del engine
            release()
            engine = make_engine(shape, max_num_seqs=256, max_num_batched_tokens=8192, quantization=quantization)
            result = run_workload(engine, ceilings, standard_workload(vocab=engine.model_config.vocab_size))
            measured.append({"name": f"weights/{shape}/{label}/throughput", **result})
            del engine
            release()
            for row in measured:
                key = row["name"].rsplit("/", 1)[1]
                speed = row["output_tok_per_s"] if "output_tok_per_s" in row else 1 / row.get("ms_per_step", row["ms"])
                if quantization is None:
                    base[key] = speed
                elif key in base:
                    row["speedup_over_bf16"] = speed / base[key]
                rows.append({**row, "weights": label})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'name':44s} {'measured':>14s} {'floor':>10s} {'of floor':>8s} {'peer':>14s}")
    for row in rows:
        if "ms_per_step" in row:
            measured = f"{row['ms_per_step']:.2f} ms"
            floor = f"{row['floor_ms']:.2f} ms"
        elif "prompt_tokens" in row:  # time to first token
            measured = f"{row['ms']:.1f} ms"
            floor = f"{row['floor_ms']:.1f} ms"
        elif "seconds_total" in row:
            measured, floor = f"{row['seconds_total']:.1f} s", ""
        elif "output_tok_per_s" in row:
            measured = f"{row['output_tok_per_s']:.0f} tok/s"
            floor = f"{row['floor_seconds']:.1f} s"
        else:
            measured = floor = ""
        frac = f"{row['fraction_of_floor']:.0%}" if "fraction_of_floor" in row else ""
        peer = ""
        if "peer_transformers_ms_per_step" in row:
            peer = f"{row['peer_transformers_ms_per_step']:.1f} ms"
        elif "peer_transformers_generate_batch" in row:
            peer = f"{row['peer_transformers_generate_batch']['output_tok_per_s']:.0f} tok/s"
        print(f"{row['name']:44s} {measured:>14s} {floor:>10s} {frac:>8s} {peer:>14s}")


BENCHMARKS = (
    "latency",
    "batch",
    "throughput",
    "features",
    "startup",
    "models",
    "kvcache",
    "kvcache-long",
    "spec",
    "weights",
    "all",
)
MODEL_SHAPES = ["gemma3-4b", "gemma3-27b", "gemma4-e4b", "gemma4-31b"]
LATENCY_SHAPES = ["llama3-8b", "qwen3-8b"]
WEIGHT_SHAPES = ["llama3-8b", "qwen3-0.6b"]


def shape_list(text: str) -> list[str]:
    """A comma-separated list of known shapes (an argparse type: a bad name fails at parsing, before
    anything is measured)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SHAPES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown shape(s) {', '.join(unknown) or repr(text)}; known: {', '.join(SHAPES)}"
        )
    return names


def kv_dtype_list(text: str) -> tuple[str, ...]:
    """A comma-separated list of KV cache dtypes (an argparse type, as ``shape_list``)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in KV_CACHE_DTYPES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown KV cache dtype(s) {', '.join(unknown) or repr(text)}; known: {', '.join(KV_CACHE_DTYPES)}"
        )
    return names


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument(
        "--peer-requests",
        type=int,
        default=32,
        help="requests of the standard workload given to transformers' generate_batch",
    )
    parser.add_argument(
        "--tokens-per-forward",
        type=float,
        default=None,
        help="spec: tokens per forward measured on a workload (benchmarks/suite/spec_decode_rewrite.py), "
        "to derive the speedup at each batch size",
    )
    parser.add_argument(
        "--throughput-shapes",
        type=shape_list,
        default=["qwen3-0.6b", "llama3-8b"],
        help="comma-separated shapes for the throughput benchmark",
    )
    parser.add_argument(
        "--kv-cache-dtypes",
        type=kv_dtype_list,
        default=("auto", "fp8", "int8"),
        help="comma-separated KV cache dtypes for the kvcache benchmarks (rows against auto's need auto first)",
    )
    parser.add_argument(
        "--shapes",
        type=shape_list,
        default=None,
        help="comma-separated shapes for the models benchmark (default: "
        f"{', '.join(MODEL_SHAPES)}), the latency one (default: "
        f"{', '.join(LATENCY_SHAPES)}) and the weights one (default: "
        f"{', '.join(WEIGHT_SHAPES)}); known: {', '.join(SHAPES)}",
    )


def run_bench(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("tokenmill bench needs a CUDA device", file=sys.stderr)
        return 2
    ceilings = measure_ceilings()
    fp8_rate = f", {ceilings.fp8_matmul_rate / 1e12:.0f} FP8" if ceilings.fp8_matmul_rate else ""
    matmul = f"{ceilings.matmul_rate / 1e12:.0f} TFLOP/s bf16{fp8_rate}"
    print(f"ceilings: {ceilings.bandwidth / 1e12:.2f} TB/s copy, {matmul}")
    peer = not args.no_peer
    which = args.bench_command
    env = environment(ceilings, " ".join(sys.argv))
    rows: list[dict] = []

    def checkpoint(section: list[dict]) -> None:
        """Write what is measured so far, so a later failure loses nothing."""
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"environment": env, "rows": rows + section}, indent=2))

    sections = {
        "startup": lambda: bench_startup(ceilings),
        "latency": lambda: bench_latency(ceilings, args.shapes or LATENCY_SHAPES, [128, 1024, 4096], peer),
        "batch": lambda: bench_batch(
            ceilings, ["llama3.2-1b", "llama3-8b"], [1, 8, 32, 64, 128, 256], [1, 32, 128], peer
        ),
        "throughput": lambda: bench_throughput(ceilings, args.throughput_shapes, peer, args.peer_requests, checkpoint),
        "features": lambda: bench_features(ceilings),
        "kvcache": lambda: bench_kv_cache_dtypes(ceilings, dtypes=args.kv_cache_dtypes),
        "kvcache-long": lambda: bench_kv_cache_long(ceilings, dtypes=args.kv_cache_dtypes, checkpoint=checkpoint),
        "spec": lambda: bench_spec_decode(ceilings, tokens_per_forward=args.tokens_per_forward),
        "weights": lambda: bench_weights(ceilings, args.shapes or WEIGHT_SHAPES),
        "models": lambda: bench_models(
            ceilings, args.shapes or MODEL_SHAPES, [1, 8, 32, 128], peer, args.peer_requests, checkpoint
        ),
    }
    for name, run in sections.items():
        if which in (name, "all"):
            rows += run()
            checkpoint([])
    print_table(rows)
    return 0
