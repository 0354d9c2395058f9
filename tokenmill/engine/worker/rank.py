"""What every rank of an engine sets up alike: its device, the KV blocks its memory holds, its
model runner; and the start-up checks of a tensor-parallel engine.

With one rank all of it happens in the engine core. Under tensor parallelism rank 0 does it in the
core and each other rank in its worker process (``engine/worker/tp_workers.py``), from the same config,
so the ranks agree by construction on everything but what rank 0 settles for them (``RankSetup``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.distributed import SINGLE, TPGroup, check_divides
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.worker.model_runner import ModelRunner, Peers
from tokenmill.layers.fp8_linear import quantize_linears_fp8
from tokenmill.layers.q8_linear import quantize_linears
from tokenmill.loader.gguf_checkpoint import is_gguf_file, packs_q8_0
from tokenmill.loader.kv_layout import KVLayout
from tokenmill.loader.model_config import ModelConfig
from tokenmill.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSetup:
    """What rank 0 settles for every rank before the runners are built: each KV group's block count
    (the smallest any rank can hold, so a block id means the same tokens everywhere) and the longest
    sequence those pools allow."""

    num_blocks: list[int]
    max_model_len: int


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but no CUDA device is available")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    return torch.device(name)


LARGE_GPU_BYTES = 70 * (1 << 30)  # H100, H200 and larger


def token_budget(requested: int | None, device: torch.device) -> int:
    """A step's token budget: ``requested``, else 8,192 on a GPU of 70 GiB or more and 2,048 elsewhere.
    On a large GPU a step of 2,048 prompt tokens is already bound by its FLOPs, and a longer chunk saves
    the attention's passes over the prompt's earlier chunks and a step's fixed costs (a 4,000-token
    prompt then runs in one step); its activations (~1.4 GiB at Llama-3-8B's width) are a small share
    there. Smaller GPUs keep the shorter chunk, which holds up the sequences decoding beside it less."""
    if requested is not None:
        return requested
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_BYTES:
        return 8192
    return 2048


def context_length(requested: int | None, model_config: ModelConfig) -> int:
    """The engine's ``max_model_len`` before the KV pools are sized (which may lower it): ``requested``,
    else the model's context length (``max_position_embeddings``). More than the model supports is a
    ValueError, as in vLLM, raised before anything is built: positions past it were never trained,
    and the rotary tables (``max_model_len`` rows each) would be built for it first, 128 GB for 10**9
    positions of a 32-wide head."""
    supported = model_config.max_position_embeddings
    if requested is None:
        return supported
    if requested > supported:
        raise ValueError(
            f"max_model_len {requested} is more than this model supports: its "
            f"max_position_embeddings {supported} is the longest sequence it knows; "
            f"set max_model_len to at most {supported}"
        )
    return requested


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device under tensor parallelism: GPU ``rank``, or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def check_tensor_parallel(
    engine_config: EngineConfig, model_config: ModelConfig, device: torch.device, model_dir: Path
) -> None:
    """ValueErrors, at start-up, for a ``tensor_parallel_size`` the model or the machine cannot take."""
    size = engine_config.tensor_parallel_size
    if size == 1:
        return
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(
                f"device {engine_config.device!r} names one GPU, but tensor_parallel_size {size} runs on GPUs "
                f"0 to {size - 1}: use device 'cuda' (CUDA_VISIBLE_DEVICES picks which GPUs)"
            )
        visible = torch.cuda.device_count()
        if size > visible:
            raise ValueError(
                f"tensor_parallel_size {size} needs {size} GPUs, but {visible} "
                f"{'is' if visible == 1 else 'are'} visible"
            )
    check_divides("attention heads", model_config.num_heads, size)
    for kv_heads in sorted({spec.num_kv_heads for spec in model_config.kv_layout().groups}, reverse=True):
        check_divides("KV heads", kv_heads, size)
    moe = model_config.moe
    if moe is None or not all(moe.sparse_layers):
        check_divides("MLP rows (intermediate_size)", model_config.intermediate_size, size)
    if moe is not None:  # each expert is split as a dense MLP is
        check_divides("expert MLP rows (moe_intermediate_size)", moe.intermediate_size, size)


def apply_quantization(
    model: torch.nn.Module,
    engine_config: EngineConfig,
    model_config: ModelConfig,
    model_dir: Path,
    device: torch.device,
) -> str | None:
    """Keep the model's projections (this rank's share of them) quantized where ``quantization`` asks for
    it (``q8_0``, ``fp8``: one float8 scale per output row, activations per token) or a GGUF file's
    layer matrices are Q8_0; returns the scheme (None: dense). An FP8 checkpoint is FP8 already
    (``build_model``): ``fp8`` asks nothing more of it, and another scheme is a ValueError. A mixture of
    experts' experts and routers stay dense under either scheme (no expert kernel reads Q8_0 or FP8 yet):
    only its attention and dense MLP projections are quantized, and the log says so."""
    if model_config.quantization is not None and not engine_config.random_weights:
        if engine_config.quantization not in (None, "fp8"):
            raise ValueError(
                f"quantization {engine_config.quantization!r} quantizes a dense checkpoint, but this one is FP8 "
                f"already ({model_config.quantization.scheme.name}): leave quantization unset, or set it to fp8"
            )
        return "fp8"
    scheme = engine_config.quantization or ("q8_0" if is_gguf_file(model_dir) and packs_q8_0(model_dir) else None)
    if scheme == "q8_0":
        count = quantize_linears(model)
        logger.info("%d projections kept in Q8_0 (int8, a float16 scale per 32 values)", count)
    elif scheme == "fp8":
        count = quantize_linears_fp8(model)
        logger.info("%d projections kept in FP8 (float8 e4m3, a scale per output row; activations per token)", count)
    if scheme is not None and model_config.moe is not None:
        logger.warning(
            "quantization %s leaves the experts and routers of this mixture of experts' %d sparse layers dense: "
            "only the attention and dense MLP projections are quantized",
            scheme,
            sum(model_config.moe.sparse_layers),
        )
    if scheme is not None and device.type == "cuda":
        torch.cuda.empty_cache()  # the dense weights they replaced
    return scheme


def kv_cache_blocks(
    engine_config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    max_len: int,
) -> list[int]:
    """Each KV group's block count on this rank: ``num_kv_blocks`` if set, else what its memory left allows
    for its share of the KV heads."""
    layout = model_config.kv_layout().sharded(engine_config.tensor_parallel_size)
    budget = None
    if engine_config.num_kv_blocks is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_elsewhere = total - free
        elem = torch.tensor([], dtype=dtype).element_size()
        tokens = engine_config.max_num_batched_tokens
        assert tokens is not None  # build_core resolved it
        activations = (
            tokens
            * elem
            * (
                6 * model_config.hidden_size
                + 4 * model_config.intermediate_size
                + 3 * model_config.num_heads * model_config.head_dim
            )
        )
        logits = engine_config.max_num_seqs * model_config.vocab_size * 4 * 4
        budget = total * engine_config.gpu_memory_utilization - used_elsewhere - activations - logits - (1 << 30)
    elif engine_config.num_kv_blocks is None:
        budget = engine_config.cpu_kv_cache_gib * (1 << 30)
    assert engine_config.max_num_batched_tokens is not None  # build_core resolved it
    counts = kv_block_counts(
        layout,
        kv_dtype,
        engine_config.block_size,
        budget,
        engine_config.num_kv_blocks,
        engine_config.max_num_seqs,
        engine_config.max_num_batched_tokens,
        max_len,
    )
    for spec, count in zip(layout.groups, counts):
        if count < 1 + (spec.sliding_window is not None):
            where = "gpu_memory_utilization" if device.type == "cuda" else "cpu_kv_cache_gib"
            raise ValueError(
                f"no memory is left for the KV cache (one block of {engine_config.block_size} tokens takes "
                f"{layout.bytes_per_token(kv_dtype) * engine_config.block_size} bytes): raise {where}, "
                "or lower max_num_batched_tokens"
            )
    return counts


def verify_graph_shape(engine_config: EngineConfig) -> dict[str, int]:
    """The speculative verify steps worth a CUDA graph: every batch that speculates, each sequence
    with its known token and every draft."""
    spec = engine_config.speculative_config
    if spec is None:
        return {}
    return {
        "verify_len": spec.num_speculative_tokens + 1,
        "max_verify_seqs": min(engine_config.max_num_seqs, spec.disable_by_batch_size - 1),
    }


def make_runner(
    engine_config: EngineConfig,
    model_config: ModelConfig,
    model: LlamaForCausalLM,
    setup: RankSetup,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    tp: TPGroup = SINGLE,
    peers: Peers | None = None,
) -> ModelRunner:
    """The rank's runner: its KV cache shard and, on the GPU, its captured graphs (every rank captures
    the same graphs in the same order, since their collectives must meet)."""
    assert engine_config.max_num_batched_tokens is not None  # build_core resolved it
    return ModelRunner(
        model_config,
        model,
        setup.num_blocks,
        engine_config.block_size,
        device,
        dtype,
        max_num_seqs=engine_config.max_num_seqs,
        max_model_len=setup.max_model_len,
        cuda_graphs=not engine_config.enforce_eager,
        kv_cache_dtype=kv_dtype,
        **verify_graph_shape(engine_config),
        max_num_batched_tokens=engine_config.max_num_batched_tokens,
        tp=tp,
        peers=peers,
    )


def kv_block_counts(
    layout: KVLayout,
    dtype: torch.dtype,
    block_size: int,
    budget_bytes: float | None,
    num_blocks: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_len: int,
) -> list[int]:
    """Each KV group's block count, from a memory budget or a fixed count (``num_blocks``, the full
    groups' count). A full group never needs more than every sequence at full length; a sliding
    group never more than every sequence's window plus a step's chunk, and one null block. Memory is
    split so every group holds the same tokens, except that a sliding group gets no more than it can
    use and what it leaves goes to the full groups."""
    groups = layout.groups
    per_block = [layout.group_bytes_per_token(g, dtype) * block_size for g in range(len(groups))]
    full_cap = max_num_seqs * -(-max_len // block_size)
    caps = [
        full_cap
        if spec.sliding_window is None
        else min(
            full_cap,
            max_num_seqs * (-(-(spec.sliding_window - 1) // block_size) + 2) + -(-max_num_batched_tokens // block_size),
        )
        + 1
        for spec in groups
    ]
    if num_blocks is not None:
        return [min(num_blocks + (spec.sliding_window is not None), cap) for spec, cap in zip(groups, caps)]
    assert budget_bytes is not None
    equal = int(budget_bytes // sum(per_block))
    counts = [min(equal, cap) if spec.sliding_window is not None else 0 for spec, cap in zip(groups, caps)]
    full = [g for g, spec in enumerate(groups) if spec.sliding_window is None]
    if full:
        left = budget_bytes - sum(n * b for n, b in zip(counts, per_block))
        per_full = min(int(left // sum(per_block[g] for g in full)), full_cap)
        for g in full:
            counts[g] = per_full
    return counts
