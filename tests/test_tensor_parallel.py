"""Tensor parallelism on the CPU: two ranks (this process and one worker) over gloo give the tokens
of the single-process engine, for every architecture and every engine feature; a rank's weights
are its share of the checkpoint, read alone; bad sizes are clear errors at start-up, and a worker
that dies stops the engine with an error naming it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, Qwen3MoeConfig

from fp8_writer import fp8_model_dir
from gguf_writer import write_gguf
from helpers import SPEC, assert_equal_up_to_a_near_tie, echo_prompts, make_model_dir, make_model_with_tokenizer
from parity_helpers import parity_prompts, preempting_pool
from tokenmill import LLM, SamplingParams
from tokenmill.distributed import TPGroup
from tokenmill.engine.worker.model_runner import build_model
from tokenmill.engine.worker.tp_workers import WorkerError
from tokenmill.layers.fused_moe import FusedExperts
from tokenmill.layers.fp8_linear import FP8ColumnParallelLinear, FP8RowParallelLinear
from tokenmill.layers.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tokenmill.layers.q8_linear import Q8ColumnParallelLinear, Q8Linear, Q8RowParallelLinear
from tokenmill.loader import weights
from tokenmill.models.registry import load_model_config

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)


@pytest.fixture(autouse=True)
def one_thread_a_rank():
    """This process is rank 0, beside a worker with its share of the cores: spinning torch threads of
    one rank on the other's core stall every collective."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    yield
    torch.set_num_threads(threads)


def engine(model_dir: Path | None, tensor_parallel_size: int, **options) -> LLM:
    return LLM(None if model_dir is None else str(model_dir), device="cpu", dtype="float32",
               tensor_parallel_size=tensor_parallel_size, **options)


def shut(llm: LLM) -> None:
    llm.engine.core.shutdown()
    assert not dist.is_initialized()


@pytest.mark.parametrize("arch", ["llama3", "mistral-window", "qwen2", "qwen3", "qwen3-moe", "gemma3", "gemma4",
                                  "gemma4-kv-shared"])
def test_two_ranks_give_the_single_process_tokens(arch: str, tmp_path) -> None:
    """Batched, chunked, preempted and prefix-cached: the same greedy tokens and logprobs (up to a
    float32 near-tie, the ranks summing in another order)."""
    make_model_dir(arch, tmp_path)
    prompts = parity_prompts()
    options = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=preempting_pool(tmp_path))
    expected = engine(tmp_path, 1, **options).generate(prompts, GREEDY, use_tqdm=False)
    llm = engine(tmp_path, 2, **options)
    try:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        core = llm.engine.core
        assert core.tp.size == 2 and len(core.workers.processes) == 1
        assert core.scheduler.num_preemptions > 0 and core.kv.hit_tokens > 0
        assert core.kv.num_blocks_in_use == 0
    finally:
        shut(llm)
    assert_equal_up_to_a_near_tie(expected, got, logprob_tol=1e-4, tie=1e-4)


@pytest.mark.parametrize("arch,gguf", [("llama3", False), ("gemma3", False), ("gemma4", False), ("llama3", True),
                                       ("gemma3-six-layers", True)])
def test_two_ranks_give_the_single_process_tokens_with_q8_0_weights(arch: str, gguf: bool, tmp_path) -> None:
    """``quantization="q8_0"`` (and a GGUF file's Q8_0 matrices): each rank packs its own share, the
    row-parallel layers' shares in whole blocks of 32, and their partial sums are all-reduced as the
    dense layers' are; Gemma 4's unsplit per-layer projections are packed whole on every rank."""
    if gguf:
        model = write_gguf(make_model_with_tokenizer(arch, tmp_path / "hf"), tmp_path / "model.gguf", "Q8_0")
        options = {}
    else:
        model = tmp_path
        make_model_dir(arch, tmp_path)
        options = {"quantization": "q8_0"}
    prompts = parity_prompts()[:6]
    options |= dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=32)
    expected = engine(model, 1, **options).generate(prompts, GREEDY, use_tqdm=False)
    llm = engine(model, 2, **options)
    try:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        kinds = {type(m) for m in llm.engine.core.runner.model.modules()}
        assert {Q8ColumnParallelLinear, Q8RowParallelLinear} <= kinds, kinds
        assert (Q8Linear in kinds) == (arch == "gemma4")
    finally:
        shut(llm)
    assert_equal_up_to_a_near_tie(expected, got, logprob_tol=1e-4, tie=1e-4)


@pytest.mark.parametrize("arch,fmt", [("llama3", "ct-tensor-static"), ("llama-wide", "fp8-block")])
def test_two_ranks_give_the_single_process_tokens_with_fp8_weights(arch: str, fmt: str, tmp_path) -> None:
    """An FP8 checkpoint (per-tensor scales of q, k and v on their own rows, static input scales; 128 x 128
    blocks, a rank's k and v rows starting mid-block): each rank reads its rows' or columns' values and
    scales, and the partial sums are all-reduced as the dense layers' are. Up to float noise (the ranks
    sum in another order) that moves an activation across an e4m3 rounding boundary, a step of 1/16 of
    it (llama-wide: the logprobs' median difference 1e-6, the largest 8e-3, one first token 0.05 from a tie)."""
    fp8_model_dir(arch, tmp_path, fmt)
    prompts = parity_prompts()[:6]
    options = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=32)
    expected = engine(tmp_path, 1, **options).generate(prompts, GREEDY, use_tqdm=False)
    llm = engine(tmp_path, 2, **options)
    try:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        kinds = {type(m) for m in llm.engine.core.runner.model.modules()}
        assert {FP8ColumnParallelLinear, FP8RowParallelLinear} <= kinds, kinds
    finally:
        shut(llm)
    assert_equal_up_to_a_near_tie(expected, got, logprob_tol=1e-4, tie=0.1, flip_tol=0.1)


def test_block_fp8_split_inside_a_block_is_refused(tmp_path) -> None:
    """The tiny llama's o and down projections have 128 input columns: two ranks would each hold half a block."""
    fp8_model_dir("llama3", tmp_path, "fp8-block")
    with pytest.raises(ValueError, match="whole blocks of 128, but this rank holds columns 0:64 of 128"):
        engine(tmp_path, 2)
    assert not dist.is_initialized()


def test_sampling_speculation_and_structured_outputs_match_one_process() -> None:
    """On the embedded model: seeded sampling (n > 1, penalties), prompt logprobs, drafts by prompt
    lookup and a JSON schema each give what one process gives; nothing is left behind."""
    prompts = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n"]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7, n=2, max_tokens=12, ignore_eos=True)
    penalized = SamplingParams(temperature=0.7, seed=3, max_tokens=12, presence_penalty=0.5, prompt_logprobs=2)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    structured = SamplingParams(structured_outputs={"json": schema}, max_tokens=40, temperature=0)

    def run(llm: LLM) -> list:
        echoes = echo_prompts(llm, [llm.get_tokenizer().encode(p) for p in prompts])
        return [llm.generate(prompts, seeded, use_tqdm=False), llm.generate(prompts, penalized, use_tqdm=False),
                llm.generate(prompts[:1], structured, use_tqdm=False),
                llm.generate(echoes, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)]

    options = dict(max_num_seqs=8, speculative_config=SPEC)
    expected = run(engine(None, 1, **options))
    llm = engine(None, 2, **options)
    try:
        got = run(llm)
        assert llm.engine.core.stats.spec_decode_num_accepted_tokens > 0
        assert llm.engine.requests == {} and llm.engine.core.kv.num_blocks_in_use == 0
    finally:
        shut(llm)
    for want, have in zip(expected, got):
        assert [[c.token_ids for c in o.outputs] for o in want] == [[c.token_ids for c in o.outputs] for o in have]
    for want, have in zip(expected[1], got[1]):
        for a, b in zip(want.prompt_logprobs[1:], have.prompt_logprobs[1:]):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.mark.parametrize("arch", ["llama3", "gemma4", "mixtral-window"])
def test_a_rank_holds_and_reads_only_its_share(arch: str, tmp_path, monkeypatch) -> None:
    """Each rank's parameters are its slices of the whole model's (q/k/v heads, MLP rows, o/down
    columns, vocabulary rows, each expert's gate/up rows and down columns; a KV head replicated where
    there are fewer than ranks), and loading them reads about half of the checkpoint."""
    make_model_dir(arch, tmp_path)
    cfg = load_model_config(tmp_path)
    full = build_model(cfg, tmp_path, torch.float32, torch.device("cpu"), 64)
    read = {"elements": 0}
    real_safe_open = weights.safe_open

    class CountingSlice:
        def __init__(self, inner) -> None:
            self.inner = inner

        def get_shape(self) -> list[int]:
            return self.inner.get_shape()

        def get_dtype(self) -> str:
            return self.inner.get_dtype()

        def __getitem__(self, index) -> torch.Tensor:
            tensor = self.inner[index]
            read["elements"] += tensor.numel()
            return tensor

    class CountingFile:
        def __init__(self, *args, **kwargs) -> None:
            self.file = real_safe_open(*args, **kwargs)

        def __enter__(self) -> CountingFile:
            self.file.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.file.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.file.keys()

        def get_slice(self, name: str) -> CountingSlice:
            return CountingSlice(self.file.get_slice(name))

    monkeypatch.setattr(weights, "safe_open", CountingFile)
    total = sum(p.numel() for p in full.state_dict().values())
    whole = dict(full.named_modules())
    for rank in range(2):
        read["elements"] = 0
        shard = build_model(cfg, tmp_path, torch.float32, torch.device("cpu"), 64, tp=TPGroup(rank, 2))
        assert read["elements"] < 0.7 * total
        for name, module in shard.named_modules():
            if isinstance(module, ColumnParallelLinear):
                full_parts = whole[name].weight.split([p.size for p in module.parts])
                want = torch.cat([w[p.local_slice(module.tp)] for w, p in zip(full_parts, module.parts)])
                assert torch.equal(module.weight, want), name
            elif isinstance(module, RowParallelLinear):
                assert torch.equal(module.weight, whole[name].weight[:, module.split.local_slice(module.tp)]), name
            elif isinstance(module, VocabParallelEmbedding):
                rows = slice(module.vocab_start, module.vocab_start + module.num_valid)
                assert torch.equal(module.weight[:module.num_valid], whole[name].weight[rows]), name
            elif isinstance(module, FusedExperts):
                local, gate_up = module.rows.local_slice(module.tp), whole[name].w13.chunk(2, dim=1)
                assert torch.equal(module.w13, torch.cat([part[:, local] for part in gate_up], dim=1)), name
                assert torch.equal(module.w2, whole[name].w2[:, :, local]), name
                assert module.w13.shape[1] == gate_up[0].shape[1], name  # half of 2 * I
    if arch == "gemma4":  # a global layer's one KV head lives on both ranks
        layer = next(i for i in range(cfg.num_layers) if cfg.is_global(i) and not cfg.is_kv_shared(i))
        assert cfg.layer_kv_heads[layer] == 1 and shard.model.layers[layer].self_attn.attn.num_kv_heads == 1


def _config_only(path: Path, **overrides) -> Path:
    """A model directory with just its config.json: enough for the start-up checks."""
    LlamaConfig(architectures=["LlamaForCausalLM"],
                **{"vocab_size": 64, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 1,
                   "num_attention_heads": 4, "num_key_value_heads": 2, **overrides}).save_pretrained(path)
    return path


@pytest.mark.parametrize(("overrides", "size", "message"), [
    ({}, 3, "tensor_parallel_size 3 does not divide the model's 4 attention heads"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48}, 2,
     "tensor_parallel_size 2 does not divide the model's 3 KV heads"),
    ({"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 100}, 8,
     "tensor_parallel_size 8 does not divide the model's 100 MLP rows"),
    ({"num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 48}, 6,
     "the model's 4 KV heads cannot be replicated evenly over tensor_parallel_size 6"),
])
def test_sizes_the_model_cannot_split_are_refused_at_start_up(overrides, size, message, tmp_path) -> None:
    with pytest.raises(ValueError, match=message):
        engine(_config_only(tmp_path, **overrides), size)
    assert not dist.is_initialized()


def test_expert_rows_the_model_cannot_split_are_refused_at_start_up(tmp_path) -> None:
    Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=48, intermediate_size=96,
                   moe_intermediate_size=30, num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's 30 expert MLP rows"):
        engine(tmp_path, 4)
    assert not dist.is_initialized()


def test_more_gpus_than_visible_are_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 GPUs, but 1 is visible"):
        LLM(str(_config_only(tmp_path)), device="cuda", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="names one GPU"):
        LLM(str(tmp_path), device="cuda:1", tensor_parallel_size=2)


@pytest.mark.parametrize("option", [{"tensor_parallel_size": 0}, {"tensor_parallel_size": "2"}])
def test_bad_options_are_clear_errors(option: dict, tmp_path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size|tensor parallelism"):
        LLM(str(_config_only(tmp_path)), device="cpu", **option)


@pytest.mark.parametrize("when", ["between calls", "mid-generation"])
def test_a_killed_worker_stops_the_engine_with_an_error_naming_it(when: str, tmp_path) -> None:
    """Killed while idle (the next step's plan finds its pipe broken) or inside a generation (rank 0's
    next collective fails): either way the engine stops and says which rank died and how."""
    make_model_dir("llama3", tmp_path)
    llm = engine(tmp_path, 2)
    core = llm.engine.core
    worker = core.workers.processes[0]
    prompts = parity_prompts()[:3]
    assert len(llm.generate(prompts, GREEDY, use_tqdm=False)) == 3
    if when == "between calls":
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
    else:
        launch, launches = core.runner.launch, []

        def launch_then_kill(*args, **kwargs):
            launches.append(1)
            if len(launches) == 4:
                os.kill(worker.pid, signal.SIGKILL)
            return launch(*args, **kwargs)

        core.runner.launch = launch_then_kill
    with pytest.raises(WorkerError, match=r"worker rank 1 died \(killed by signal 9\)"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert core.workers is None and not dist.is_initialized()
    assert not worker.is_alive()


def test_the_command_line_takes_the_size() -> None:
    from tokenmill.engine.config import engine_config_from_args
    from tokenmill.entrypoints.cli import parse_args

    assert engine_config_from_args(parse_args(["serve", "--tensor-parallel-size", "2"])).tensor_parallel_size == 2
    assert engine_config_from_args(parse_args(["generate", "x"])).tensor_parallel_size == 1


def test_the_benchmark_compiles_and_refuses_without_two_gpus(capsys) -> None:
    from tokenmill.bench import tensor_parallel

    entry = Path(__file__).parents[1] / "benchmarks" / "suite" / "tp_bench.py"
    compile(entry.read_text(), str(entry), "exec")
    if torch.cuda.device_count() < 2:
        assert tensor_parallel.main(["all"]) == 2
        assert "two CUDA devices" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("arch", ["llama3", "mistral-window", "qwen2", "qwen3", "gemma3", "gemma4", "gemma4-kv-shared"])
def test_two_gpus_give_the_one_gpu_tokens_in_bf16(arch: str, tmp_path) -> None:
    """NCCL, CUDA graphs (with their all-reduces captured), Triton kernels and overlapped steps: the
    tokens of one GPU, up to a bf16 near-tie (each rank rounds its partial sums before they are added)."""
    make_model_dir(arch, tmp_path)
    prompts = parity_prompts()
    options = dict(device="cuda", dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=48,
                   num_kv_blocks=preempting_pool(tmp_path))
    expected = LLM(str(tmp_path), **options).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **options)
    try:
        assert llm.engine.core.runner.graphs is not None
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
        assert len(llm.generate(prompts, seeded, use_tqdm=False)) == len(prompts)
    finally:
        shut(llm)
    assert_equal_up_to_a_near_tie(expected, got, logprob_tol=0.1, tie=0.1)
