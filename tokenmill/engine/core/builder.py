"""The engine core's start-up: the model's config and device, the model on every rank, the KV pools
sized to what memory holds, the scheduler and the model runner, warmed up.

Under tensor parallelism the core is rank 0: the other ranks' worker processes
(``engine/worker/tp_workers.py``) load their shards while this rank loads its own, and every rank's
pools take the smallest block count among them.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tokenmill.default_model import DEFAULT_MODEL_DIR
from tokenmill.distributed import SINGLE, TPGroup, destroy_group, init_group
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.kv_cache_manager import KVCacheManager
from tokenmill.engine.core.scheduler import Scheduler, SchedulerConfig, StepCost
from tokenmill.engine.messages import CoreStats
from tokenmill.engine.worker.model_runner import ModelRunner, build_model
from tokenmill.engine.worker.rank import (
    RankSetup,
    apply_quantization,
    check_tensor_parallel,
    context_length,
    kv_cache_blocks,
    make_runner,
    rank_device,
    resolve_device,
    token_budget,
)
from tokenmill.engine.worker.tp_workers import COLLECTIVE_TIMEOUT, WorkerGroup
from tokenmill.layers import ops
from tokenmill.loader.kv_layout import KVLayout, is_quantized, resolve_kv_cache_dtype
from tokenmill.loader.model_config import ModelConfig, resolve_dtype
from tokenmill.models.registry import load_model_config

logger = logging.getLogger(__name__)

# The start-up log's words for ``CoreParts.startup_seconds``.
STARTUP_PHASES = {
    "load": "weights",
    "kv_cache_and_graphs": "KV cache and CUDA graphs",
    "warm_up": "kernel compilation and warm-up",
}


@dataclass
class CoreParts:
    """What start-up builds for the core; ``config`` with the token budget and context length resolved."""

    config: EngineConfig
    model_dir: Path
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    tp: TPGroup
    workers: WorkerGroup | None
    runner: ModelRunner
    kv: KVCacheManager
    scheduler: Scheduler
    max_model_len: int
    quantization: str | None
    startup_seconds: dict[str, float]


def model_dir_of(config: EngineConfig) -> Path:
    return Path(config.model) if config.model is not None else DEFAULT_MODEL_DIR


def stop_tensor_parallel(workers: WorkerGroup, abort: bool = False) -> None:
    """Stop the workers, then leave the process group: also run when an engine nobody shut down is
    collected, so that its workers do not outlive it."""
    workers.close()
    destroy_group(abort)


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (modules, weights' wrappers, tokenizers) out of
    the garbage collector's reach: otherwise each full collection walks millions of objects
    that never die, and the steps that trigger one pay milliseconds for it."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # let them be finalized normally when the process ends


def watch_late_compiles(stats: CoreStats) -> None:
    """Count and name each kernel variant Triton compiles after start-up: the step that needs it waits."""

    def compiled(kernel: str, variant: str) -> None:
        stats.num_compiles_after_startup += 1
        logger.warning(
            "Triton compiled a variant of %s after start-up, inside a step that waits for it: the "
            "warm-up missed this shape: %s",
            kernel,
            variant,
        )

    ops.watch_compiles(compiled)


def build_core(config: EngineConfig) -> CoreParts:
    model_dir = model_dir_of(config)
    model_config = load_model_config(model_dir)
    device = resolve_device(config.device)
    if device.type == "cuda":
        # One engine a process watches Triton's compiles: the newest, once it has started, so that an
        # engine built before this one does not count this one's start-up as its own steps' compiles.
        ops.watch_compiles(None)
    check_tensor_parallel(config, model_config, device, model_dir)
    device = rank_device(device, 0) if config.tensor_parallel_size > 1 else device
    config = replace(
        config,
        max_num_batched_tokens=token_budget(config.max_num_batched_tokens, device),
        max_model_len=context_length(config.max_model_len, model_config),
    )
    dtype = resolve_dtype(config.dtype, model_config, device)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
    if config.tensor_parallel_size == 1:
        return _build_rank0(config, model_dir, model_config, device, dtype, kv_dtype, SINGLE, None)
    workers = WorkerGroup(config, model_dir)  # they load their shards while this rank loads its own
    try:
        workers.receive("start-up message")
        tp = init_group(device, 0, config.tensor_parallel_size, workers.init_method, COLLECTIVE_TIMEOUT)
        parts = _build_rank0(config, model_dir, model_config, device, dtype, kv_dtype, tp, workers)
        workers.receive("ready message")
    except BaseException:
        stop_tensor_parallel(workers, abort=True)
        raise
    return parts


def _build_rank0(
    config: EngineConfig,
    model_dir: Path,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    tp: TPGroup,
    workers: WorkerGroup | None,
) -> CoreParts:
    torch.manual_seed(config.seed)
    max_len, budget = config.max_model_len, config.max_num_batched_tokens
    assert max_len is not None and budget is not None  # build_core resolved both
    started = time.monotonic()
    weights_dir = None if config.random_weights else model_dir
    model = build_model(model_config, weights_dir, dtype, device, max_len, config.seed, tp)
    quantization = apply_quantization(model, config, model_config, model_dir, device)
    load_seconds = time.monotonic() - started
    if any(getattr(m, "kv_amax", None) is not None for m in model.modules()):
        logger.info(
            "the checkpoint's k_scale/v_scale %s",
            "set the KV cache's scales" if is_quantized(kv_dtype) else "are unused: kv_cache_dtype is auto",
        )
    layout = model_config.kv_layout().sharded(config.tensor_parallel_size)
    num_blocks = kv_cache_blocks(config, model_config, device, dtype, kv_dtype, max_len)
    if workers is not None:  # every rank's pools must hold the same blocks: the smallest wins
        num_blocks = [min(counts) for counts in zip(num_blocks, *workers.receive("KV cache size"))]
    windows = [spec.sliding_window for spec in layout.groups]
    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, windows)
    longest = kv.longest_sequence(budget)
    if longest < max_len:
        logger.warning(
            "max_model_len lowered from %d to %d: the KV pools hold %s blocks of %d",
            max_len,
            longest,
            num_blocks,
            config.block_size,
        )
        max_len = int(longest)
    # On the CPU prompt chunks beside decoding sequences are sized from the steps' measured times.
    scheduler = Scheduler(
        SchedulerConfig(config.max_num_seqs, budget, config.static_batching, config.scheduling_policy),
        kv,
        StepCost() if device.type == "cpu" else None,
    )
    started = time.monotonic()
    setup = RankSetup(num_blocks, max_len)
    if workers is not None:
        workers.send(setup)
    runner = make_runner(config, model_config, model, setup, device, dtype, kv_dtype, tp, workers)
    startup_seconds = {"load": load_seconds, "kv_cache_and_graphs": time.monotonic() - started}
    if device.type == "cuda":  # nothing is compiled on the CPU path
        started = time.monotonic()
        runner.warm_up(budget, max_len)
        startup_seconds["warm_up"] = time.monotonic() - started
    parts = CoreParts(
        config,
        model_dir,
        model_config,
        device,
        dtype,
        kv_dtype,
        tp,
        workers,
        runner,
        kv,
        scheduler,
        max_len,
        quantization,
        startup_seconds,
    )
    _log_ready(parts, layout, num_blocks)
    return parts


def _log_ready(parts: CoreParts, layout: KVLayout, num_blocks: list[int]) -> None:
    config, kv_dtype, tp = parts.config, parts.kv_dtype, parts.tp
    groups = "; ".join(
        f"{len(layout.owners(g))} layers of {spec.num_kv_heads}x{spec.head_dim}"
        f"{'' if spec.sliding_window is None else f' (window {spec.sliding_window})'}: {n} blocks"
        for g, (spec, n) in enumerate(zip(layout.groups, num_blocks))
    )
    logger.info(
        "engine ready: %s on %s (%s%s), max_model_len %d, KV cache %s in blocks of %d tokens: %s; %d bytes "
        "per token (%d if every layer kept its own full-length cache)%s; start-up %s",
        parts.model_dir,
        parts.device,
        str(parts.dtype).removeprefix("torch."),
        f", tensor parallel over {tp.size} ranks" if tp.size > 1 else "",
        parts.max_model_len,
        config.kv_cache_dtype,
        config.block_size,
        groups,
        layout.bytes_per_token(kv_dtype),
        layout.full_length_bytes_per_token(kv_dtype),
        " on each rank" if tp.size > 1 else "",
        ", ".join(f"{STARTUP_PHASES[name]} {seconds:.1f} s" for name, seconds in parts.startup_seconds.items()),
    )
