"""The engine on CUDA (Triton kernels, CUDA graphs) against transformers on CUDA and
against tokenmill's own CPU path. Run on a machine with a CUDA GPU: ``pytest -m gpu``."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import SPEC, TINY_CONFIGS, assert_equal_up_to_a_near_tie, echo_prompts, make_model_dir
from parity_helpers import MAX_TOKENS, assert_matches_reference, parity_prompts, preempting_pool, reference_generate

from tokenmill import LLM, SamplingParams
from tokenmill.engine.worker.model_runner import ForwardPath
from tokenmill.layers import ops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
# bf16 logits carry ~3 significant digits: a flip between two tokens this close is a tie.
BF16_TIE = 0.05


@pytest.fixture(autouse=True)
def exact_float32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_cuda_parity_with_transformers(arch: str, tmp_path) -> None:
    model = make_model_dir(arch, tmp_path).cuda()
    prompts = parity_prompts()
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=48,
              num_kv_blocks=preempting_pool(tmp_path))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        ref, ref_logits = reference_generate(model, prompt)
        assert_matches_reference(out.outputs[0].token_ids, out.outputs[0].logprobs, ref.copy(), ref_logits.cpu())


@pytest.mark.parametrize("arch", ["llama3", "mistral-window", "qwen3", "gemma3", "gemma4", "gemma4-kv-shared"])
def test_cuda_matches_the_cpu_path(arch: str, tmp_path) -> None:
    make_model_dir(arch, tmp_path)
    prompts = parity_prompts()
    cpu = LLM(str(tmp_path), device="cpu", dtype="float32", max_num_seqs=8)
    gpu = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=8)
    # A flip is allowed only at a tie of the CPU path's logprobs.
    assert_equal_up_to_a_near_tie(cpu.generate(prompts, GREEDY, use_tqdm=False),
                                  gpu.generate(prompts, GREEDY, use_tqdm=False), logprob_tol=1e-3, tie=1e-3)


def test_graphs_match_eager(tmp_path) -> None:
    make_model_dir("llama3", tmp_path)
    prompts = parity_prompts()
    eager = LLM(str(tmp_path), device="cuda", dtype="float32", enforce_eager=True)
    graphs = LLM(str(tmp_path), device="cuda", dtype="float32")
    assert graphs.engine.core.runner.graphs is not None and eager.engine.core.runner.graphs is None
    a = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in graphs.generate(prompts, GREEDY, use_tqdm=False)]
    assert a == b


@pytest.mark.parametrize("batch", [8, 64])
def test_copies_of_one_prompt_give_identical_streams_bf16(batch: int, tmp_path) -> None:
    make_model_dir("llama3", tmp_path)
    prompt = parity_prompts()[7]
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_num_seqs=batch)
    single = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    outs = llm.generate([prompt] * batch, GREEDY, use_tqdm=False)
    streams = [o.outputs[0].token_ids for o in outs]
    assert all(s == streams[0] for s in streams), "identical rows of one batch must decode identically"
    # Against the single stream, bf16 GEMMs of another batch size may round differently:
    # a divergence is allowed only where the single stream's top two tokens are a near-tie.
    for i, (a, b) in enumerate(zip(single.token_ids, streams[0])):
        if a != b:
            lp = single.logprobs[i]
            assert lp[a] - lp.get(b, float("-inf")) < BF16_TIE, f"step {i}: {a} vs {b} is no near-tie"
            break


def test_penalties_and_min_tokens_match_the_cpu_path(tmp_path) -> None:
    make_model_dir("llama3", tmp_path)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=4, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.5, stop_token_ids=[5], logprobs=5)
    prompts = parity_prompts()
    cpu = LLM(str(tmp_path), device="cpu", dtype="float32", max_num_seqs=8)
    gpu = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=8)
    for a, b in zip(cpu.generate(prompts, params, use_tqdm=False), gpu.generate(prompts, params, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_seeded_filtered_sampling_is_the_same_alone_and_in_a_batch(tmp_path) -> None:
    """The race over top-k/top-p/min-p candidates takes each seeded row's noise from its own
    generator: a request draws the same tokens whatever shares its steps."""
    make_model_dir("llama3", tmp_path)
    prompts = parity_prompts()
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=8)
    kinds = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)
             for seed, (t, k, p, m) in enumerate([(1.0, 0, 0.8, 0.0), (0.7, 20, 1.0, 0.0), (1.3, 30, 0.6, 0.05),
                                                  (1.0, 0, 1.0, 0.1)])]
    for params in kinds:
        (alone,) = llm.generate([prompts[0]], params, use_tqdm=False)
        mixed = llm.generate(prompts, [params] + [GREEDY] * (len(prompts) - 1), use_tqdm=False)
        assert alone.outputs[0].token_ids == mixed[0].outputs[0].token_ids, params


def _compiled_kernel_variants() -> int:
    """Triton kernel variants compiled so far in this process, over every kernel module."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import tokenmill.kernels

    total = 0
    for info in pkgutil.iter_modules(tokenmill.kernels.__path__):
        module = importlib.import_module(f"tokenmill.kernels.{info.name}")
        for fn in vars(module).values():
            if isinstance(fn, JITFunction):
                total += sum(len(caches[0]) for caches in fn.device_caches.values())
    return total


def test_sampled_requests_compile_nothing_after_start_up(tmp_path) -> None:
    """Start-up compiles the sampling kernels (penalties, the race over filtered candidates): a
    request's first sampled step must not wait on Triton."""
    make_model_dir("llama3", tmp_path)
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_num_seqs=8)
    before = _compiled_kernel_variants()
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                            presence_penalty=0.3, max_tokens=8, ignore_eos=True)
    llm.generate(parity_prompts()[:3], params, use_tqdm=False)
    assert _compiled_kernel_variants() == before
    assert llm.engine.core.stats.num_compiles_after_startup == 0


@pytest.mark.parametrize("arch", ["llama3", "gemma3"])
def test_prompts_past_the_prefill_graphs_compile_nothing_after_start_up(arch: str, tmp_path) -> None:
    """A lone prompt longer than the largest prefill graph runs eagerly in one chunk, and several
    prompts share a step: the warm-up compiled their attention variants (the longest chunk alone is
    left to the 128-token one's variant). Gemma 3's two KV groups each take their own slots and
    block tables, from the same copy: an odd token count must not put the second group's slots off
    the 16-byte boundary the warm-up's were on."""
    make_model_dir(arch, tmp_path, max_positions=4096)
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_num_seqs=8, max_model_len=4096,
              max_num_batched_tokens=4096)
    before = _compiled_kernel_variants()
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([torch.randint(0, 256, (3000,), generator=g).tolist()], params, use_tqdm=False)
    llm.generate([torch.randint(0, 256, (n,), generator=g).tolist() for n in (700, 90, 5)], params, use_tqdm=False)
    assert _compiled_kernel_variants() == before
    assert llm.engine.core.stats.num_compiles_after_startup == 0


@pytest.mark.parametrize("arch,kv_cache_dtype", [("llama3", "auto"), ("llama3", "int8"), ("llama3", "fp8"),
                                                 ("gemma3", "auto")])
def test_chunks_beside_decoding_sequences_attend_apart(arch: str, kv_cache_dtype: str, tmp_path, monkeypatch) -> None:
    """Steps past the mixed-step graphs that carry prompt chunks beside sequences that decode run
    eagerly and attend over each kind in a launch of its own: tokens as the CPU path gives them, and
    nothing compiled after start-up (the warm-up ran both launches' variants)."""
    make_model_dir(arch, tmp_path, max_positions=2048)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 40, 1500, 700, 9, 300)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    options = dict(dtype="float32", kv_cache_dtype=kv_cache_dtype, max_num_seqs=8, max_num_batched_tokens=1024,
                   max_model_len=2048)
    cpu = LLM(str(tmp_path), device="cpu", **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tmp_path), device="cuda", **options)
    runner, split = llm.engine.core.runner, []
    forward = runner._forward

    def watched(plan, tensors):
        split.append(plan.num_chunk_seqs > 0 and plan.path is ForwardPath.EAGER)
        return forward(plan, tensors)

    monkeypatch.setattr(runner, "_forward", watched)
    before = _compiled_kernel_variants()
    gpu = llm.generate(prompts, params, use_tqdm=False)
    assert any(split)
    assert _compiled_kernel_variants() == before
    assert llm.engine.core.stats.num_compiles_after_startup == 0
    assert_equal_up_to_a_near_tie(cpu, gpu, logprob_tol=1e-3, tie=0.1,
                                  flip_tol=None if kv_cache_dtype == "auto" else 0.2)


def test_a_variant_compiled_after_start_up_is_counted(tmp_path) -> None:
    """The engine counts (and logs) each kernel variant compiled, or loaded from Triton's disk cache,
    after its start-up: here the norm's, dropped from memory first."""
    from tokenmill.kernels import triton_norm

    make_model_dir("llama3", tmp_path)
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_num_seqs=4)
    stats = llm.engine.core.stats
    assert stats.num_compiles_after_startup == 0
    kernel = triton_norm._rms_norm_kernel
    loaded = dict(kernel.device_caches)
    kernel.device_caches.clear()
    try:
        x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
        ops.rms_norm(x, torch.ones(64, device="cuda", dtype=torch.bfloat16), 1e-6)
    finally:
        kernel.device_caches.clear()
        kernel.device_caches.update(loaded)
    assert stats.num_compiles_after_startup == 1


def test_graphs_match_eager_across_context_buckets_and_decode_shaped_prefill(tmp_path) -> None:
    """Contexts below and above the short-context graphs' bound (256), greedy from the graph's
    own argmax (no logprobs) and through the sampler (logprobs); then one-token prefill chunks,
    which make decode-shaped steps whose rows do not sample or give prompt logprobs."""
    make_model_dir("llama3", tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 240, 300, 450)]
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    eager = LLM(str(tmp_path), device="cuda", dtype="float32", enforce_eager=True)
    graphs = LLM(str(tmp_path), device="cuda", dtype="float32")
    one_token = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_batched_tokens=1, max_num_seqs=4)
    assert {ctx for _, ctx, _ in graphs.engine.core.runner.graphs.graphs} == {256, 512}
    for params in (plain, with_logprobs):
        want = eager.generate(prompts, params, use_tqdm=False)
        for llm in (graphs, one_token):
            got = llm.generate(prompts, params, use_tqdm=False)
            for a, b in zip(want, got):
                assert a.outputs[0].token_ids == b.outputs[0].token_ids
                if params.prompt_logprobs is not None:
                    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                        assert set(x) == set(y) and all(abs(x[t] - y[t]) < 1e-4 for t in x)


@pytest.mark.parametrize("arch", ["llama3", "mistral-window", "gemma3", "gemma4-kv-shared"])
def test_prefill_graphs_match_eager(arch: str, tmp_path) -> None:
    """Lone prompts (each step one sequence) of lengths across the captured token counts: whole, in
    chunks after a context (a 300-token prompt under a 128-token budget), and after a cached prefix
    (the same prompt twice); the graph's tokens and logprobs are the eager engine's. New prompts
    replay graphs that attend over whole contexts, the chunks after 256 tokens the graphs that split
    them."""
    make_model_dir(arch, tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (2, 17, 100, 300)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    eager = LLM(str(tmp_path), device="cuda", dtype="float32", enforce_eager=True, max_num_batched_tokens=128)
    graphs = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_batched_tokens=128)
    assert graphs.engine.core.runner.prefill_graphs.sizes[-1] == 128
    for prompt in [*prompts, prompts[-1]]:
        want, got = (llm.generate([prompt], params, use_tqdm=False)[0].outputs[0] for llm in (eager, graphs))
        assert want.token_ids == got.token_ids
        for x, y in zip(want.logprobs, got.logprobs):
            assert set(x) == set(y) and all(abs(x[t] - y[t]) < 1e-4 for t in x)
    # Every prompt's prefill: 2, 17, 100, 300 in three chunks (128, 128, 44), the cached one's tail;
    # the last two after 256 and 288 tokens.
    prefill = graphs.engine.core.runner.prefill_graphs
    assert prefill.replays >= 6 and prefill.long_prefix_replays >= 2
    assert any(context > size for size, context in prefill.graphs)


@pytest.mark.parametrize("arch", ["llama3", "gemma3", "gemma4-kv-shared"])
def test_mixed_step_graphs_match_eager(arch: str, tmp_path) -> None:
    """Several prompts at once under a 96-token budget: steps of several sequences' chunks, then chunks
    beside sequences that decode, replayed from the mixed-step graphs (greedy and sampled rows, a
    sequence count well under the graphs' own); tokens and logprobs are the eager engine's."""
    make_model_dir(arch, tmp_path)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 40, 150, 70, 9)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True, logprobs=2)
    params = [greedy, seeded, greedy, seeded, greedy]
    options = dict(device="cuda", dtype="float32", max_num_batched_tokens=96, max_num_seqs=16)
    want = LLM(str(tmp_path), enforce_eager=True, **options).generate(prompts, params, use_tqdm=False)
    graphs = LLM(str(tmp_path), **options)
    got = graphs.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(x) == set(y) and all(abs(x[t] - y[t]) < 1e-4 for t in x)
    assert graphs.engine.core.runner.mixed_graphs.replays >= 3


def test_logit_bias_and_full_vocabulary_logprobs_on_cuda(tmp_path) -> None:
    """The bias reaches greedy rows of CUDA-graph steps too (the graph's own argmax must not
    be taken), and matches the CPU path; logprobs=-1 gives the whole vocabulary."""
    make_model_dir("qwen3", tmp_path)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    forced = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={7: 100.0})
    banned = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={7: -100.0}, logprobs=-1)
    cuda = LLM(str(tmp_path), device="cuda", dtype="float32", max_logprobs=-1)
    cpu = LLM(str(tmp_path), device="cpu", dtype="float32", max_logprobs=-1)
    assert all(o.outputs[0].token_ids == [7] * 12 for o in cuda.generate(prompts, forced, use_tqdm=False))
    got = cuda.generate(prompts, banned, use_tqdm=False)
    want = cpu.generate(prompts, banned, use_tqdm=False)
    for a, b in zip(got, want):
        assert 7 not in a.outputs[0].token_ids and a.outputs[0].token_ids == b.outputs[0].token_ids
        assert all(len(entry) == cuda.engine.model_config.vocab_size for entry in a.outputs[0].logprobs)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("arch", ["llama3", "gemma3", "gemma3-attn-softcap", "gemma4", "gemma4-kv-shared"])
def test_quantized_kv_cache_on_cuda_matches_the_cpu_path(arch: str, kv_cache_dtype: str, tmp_path) -> None:
    """The Triton write and attention over a quantized cache (CUDA graphs, chunked prefill, preemption)
    against the torch reference's on the CPU, same bytes and scales: tokens equal up to a near-tie,
    logprobs within float32 noise of each other but where that noise crossed a quantization boundary.
    ``gemma3-attn-softcap``: Gemma 3 with its attention scores capped (the engine's CPU path is the
    reference here; transformers 5 does not cap Gemma 3's scores)."""
    make_model_dir(arch.removesuffix("-attn-softcap"), tmp_path)
    if arch.endswith("-attn-softcap"):
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": 2.0}))
    prompts = parity_prompts()
    options = dict(dtype="float32", kv_cache_dtype=kv_cache_dtype, max_num_seqs=4, max_num_batched_tokens=48,
                   num_kv_blocks=preempting_pool(tmp_path))
    cpu = LLM(str(tmp_path), device="cpu", **options).generate(prompts, GREEDY, use_tqdm=False)
    gpu = LLM(str(tmp_path), device="cuda", **options).generate(prompts, GREEDY, use_tqdm=False)
    assert_equal_up_to_a_near_tie(cpu, gpu, logprob_tol=1e-3, tie=0.1, flip_tol=0.2)


@pytest.mark.parametrize("arch", ["llama3", "gemma3"])
def test_speculative_decoding_on_cuda_gives_plain_decodings_tokens(arch: str, tmp_path) -> None:
    """Prompt lookup on the GPU, verify steps replayed from CUDA graphs (padded to the draft length),
    against plain decoding on the GPU: the same greedy tokens up to a near-tie."""
    make_model_dir(arch, tmp_path)
    plain = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=8)
    prompts = echo_prompts(plain, parity_prompts()[:6])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    expected = plain.generate(prompts, params, use_tqdm=False)
    spec = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=8,
               speculative_config={**SPEC, "disable_by_batch_size": 9})
    got = spec.generate(prompts, params, use_tqdm=False)
    assert spec.engine.core.runner.graphs.verify_replays > 0
    assert_equal_up_to_a_near_tie(expected, got, logprob_tol=1e-3, tie=0.05)


@pytest.mark.parametrize("arch", ["llama3", "gemma3"])
def test_q8_0_weights_on_cuda_match_the_cpu_path(arch: str, tmp_path) -> None:
    """Packed Q8_0 projections through the Triton GEMV (decode) and the few-row matmul (prefill),
    CUDA graphs included, against the torch reference on the CPU over the same packed values."""
    make_model_dir(arch, tmp_path)
    prompts = parity_prompts()[:6]
    options = dict(dtype="float32", quantization="q8_0", max_num_seqs=8)
    cpu = LLM(str(tmp_path), device="cpu", **options).generate(prompts, GREEDY, use_tqdm=False)
    gpu = LLM(str(tmp_path), device="cuda", **options).generate(prompts, GREEDY, use_tqdm=False)
    assert_equal_up_to_a_near_tie(cpu, gpu, logprob_tol=1e-3, tie=0.05)


@pytest.mark.parametrize("fmt", ["ct-channel-dynamic", "fp8-block", "ct-tensor-static"])
def test_fp8_weights_on_cuda_match_the_cpu_path(fmt: str, tmp_path, monkeypatch) -> None:
    """An FP8 checkpoint (compressed-tensors per channel and static per tensor; transformers' 128x128
    blocks) on the GPU, CUDA graphs included, against the CPU computing each projection as the GPU does
    for its rows: a few rows against the FP8 weight as they are, more quantized for FP8 tensor cores
    (the prompts' step: 178 tokens; decoding: 6 rows). The values and scales are the checkpoint's on both."""
    from fp8_writer import fp8_model_dir

    from tokenmill.kernels import reference
    from tokenmill.kernels.triton_skinny_matmul import MAX_FP8_ROWS

    fp8_model_dir("llama3", tmp_path, fmt)
    prompts = parity_prompts()[:6]
    options = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=2048)
    weight_only = reference.fp8_weight_linear

    def as_the_gpu(x, weight, bias):
        rows = x.numel() // x.shape[-1]
        return (reference.fp8_linear if rows > MAX_FP8_ROWS else weight_only)(x, weight, bias)

    monkeypatch.setattr(reference, "fp8_weight_linear", as_the_gpu)
    cpu = LLM(str(tmp_path), device="cpu", **options).generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    gpu = LLM(str(tmp_path), device="cuda", **options).generate(prompts, GREEDY, use_tqdm=False)
    assert_equal_up_to_a_near_tie(cpu, gpu, logprob_tol=1e-3, tie=0.05, flip_tol=0.1)


def test_structured_outputs_on_cuda() -> None:
    """The embedded model on the GPU (CUDA graphs, sampling held back for the grammars while the
    next forward runs): 30 random schemas in one batch all validate, and a greedy unconstrained
    request in that batch gives its solo tokens."""
    import json
    import random

    import jsonschema
    from structured_helpers import PROMPT, random_object

    llm = LLM(device="cuda", dtype="float32", max_num_seqs=32)
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    alone = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
    rng = random.Random(7)
    schemas = [random_object(rng) for _ in range(30)]
    params = [SamplingParams(structured_outputs={"json": s}, max_tokens=400, temperature=0.8, seed=i)
              for i, s in enumerate(schemas)]
    outputs = llm.generate([PROMPT] * 31, [greedy, *params], use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == alone
    for schema, out in zip(schemas, outputs[1:]):
        assert out.outputs[0].finish_reason == "stop", (schema, out.outputs[0].text)
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_speculation_grammars_penalties_quantized_kv_and_preemption_on_cuda(tmp_path) -> None:
    """The CPU test's seeded mix on the GPU, where sampling waits for the grammars while the next
    forward runs and decode steps replay graphs: no step fails, the tokens are the same with and
    without speculation, and every constrained output follows its grammar."""
    import collections

    from server.tiny_model import build_tiny_model
    from structured_helpers import mix_compiler, mix_round

    model = build_tiny_model(tmp_path)
    compiler, seen = mix_compiler(model), collections.Counter()
    for seed in range(6):
        mix_round(model, seed, compiler, seen, device="cuda")
    assert seen["drafts"] and seen["past a stop token"], seen


def test_penalised_banned_and_biased_sampling_leaves_the_host_ahead() -> None:
    """A penalised sequence's first step (its prompt ids into the token table), banned tokens and
    logit biases reach the device without the host waiting for the kernels queued before them (the
    step in flight): CUDA's sync check raises on any copy or call that would wait. And each takes
    effect: the prompt's tokens are marked, a banned token is never drawn, a large bias always is."""
    from tokenmill.engine.sequence import Sequence, SequenceStatus
    from tokenmill.engine.worker.host_staging import to_device
    from tokenmill.engine.worker.penalty_counts import PenaltyCounts
    from tokenmill.layers.sampler import Sampler, SamplingBatch

    cuda, vocab, rows = torch.device("cuda"), 1000, 3
    seqs = [Sequence(i, "", 0, list(range(i, 600, 3)), SamplingParams(repetition_penalty=1.3), 0.0) for i in range(rows)]
    for seq in seqs:
        seq.status = SequenceStatus.RUNNING
    seqs[2].token_ids += [5, 5]  # outputs before a preemption: counted when the sequence is refilled

    def full(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device=cuda)

    logits = torch.randn(rows, vocab, device=cuda)
    logits[:, 7] = 30.0  # every row's favourite, banned below for rows 0 and 1

    def step(penalties: PenaltyCounts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        read, add = penalties.rows(seqs)
        out = Sampler()(logits, SamplingBatch(
            temperature=full(1.0), inv_temperature=full(1.0), top_k=full(0, torch.int64), top_p=full(1.0),
            min_p=full(0.0), repetition_penalty=full(1.3), presence_penalty=full(0.0), frequency_penalty=full(0.0),
            generators=[None] * rows, num_logprobs=-1, penalties=(penalties.counts, penalties.prompt, read),
            banned=(to_device([0, 1], torch.int64, cuda), to_device([7, 7], torch.int64, cuda)),
            logit_bias=(to_device([1], torch.int64, cuda), to_device([900], torch.int64, cuda),
                        to_device([100.0], torch.float32, cuda))))
        penalties.add(add, out.token_ids)
        return read, add, out.token_ids

    step(PenaltyCounts(vocab, cuda, max_seqs=rows))  # compiles the kernels, which takes longer than the sleep
    penalties = PenaltyCounts(vocab, cuda, max_seqs=rows)
    torch.cuda.synchronize()
    queued = torch.cuda.Event()
    torch.cuda._sleep(500_000_000)  # a quarter of a second or more of the GPU's clock
    queued.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        read, add, token_ids = step(penalties)
        assert not queued.query()  # the host got here while the GPU still slept
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = token_ids.tolist()
    assert tokens[0] != 7 and tokens[1] == 900 and tokens[2] == 7
    marked = penalties.prompt[read].cpu()
    for seq, row in zip(seqs, marked):
        assert row.nonzero().flatten().tolist() == list(seq.prompt_token_ids)
    assert penalties.counts[add].sum(dim=-1).tolist() == [1.0, 1.0, 3.0] and penalties.counts[add[2], 5] >= 2


def test_steps_of_every_sampling_feature_never_wait_for_the_gpu(tmp_path) -> None:
    """Requests of every token-level feature in one batch (greedy, filtered and seeded sampling,
    penalties, logit biases, min_tokens, logprobs, n=2, prompt logprobs) beside a prompt too long for
    the prefill graphs (eager steps, chunks beside decoding rows), run under CUDA's sync check set to
    raise: no step's host work waits for queued kernels (a blocking copy, ``.item()``, an item
    assignment on a device tensor), so the host stays a step ahead. The step's read of its sampled
    ids and prompt logprobs waits on events, which the check leaves alone."""
    make_model_dir("llama3", tmp_path, max_positions=4096)
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=4096,
              max_num_batched_tokens=4096)
    base = dict(max_tokens=10, ignore_eos=True)
    params = [SamplingParams(temperature=0, **base), SamplingParams(temperature=0, logprobs=3, **base),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, **base),
              SamplingParams(temperature=1.0, seed=3, **base),
              SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, **base),
              SamplingParams(temperature=1.0, logit_bias={5: 3.0, 6: -2.0}, **base),
              SamplingParams(temperature=1.0, min_tokens=6, stop_token_ids=[1, 2], max_tokens=10),
              SamplingParams(temperature=1.0, n=2, **base), SamplingParams(temperature=0, prompt_logprobs=2, **base),
              SamplingParams(temperature=0, **base)]
    # The last prompt is past the largest prefill graph: its step runs eagerly.
    prompts = parity_prompts()[:len(params) - 1] + [torch.randint(0, 256, (3000,)).tolist()]
    llm.generate(prompts, params, use_tqdm=False)  # a first run launches each kernel once
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [len(out.outputs) for out in outputs] == [1] * 7 + [2, 1, 1]
    assert all(len(choice.token_ids) >= 6 for out in outputs for choice in out.outputs)
    assert len(outputs[1].outputs[0].logprobs) == len(outputs[1].outputs[0].token_ids)
    prompt_logprobs = outputs[8].prompt_logprobs
    assert len(prompt_logprobs) == len(prompts[8]) and prompt_logprobs[0] is None
    assert all(token in entry and len(entry) <= 3 for token, entry in zip(prompts[8][1:], prompt_logprobs[1:]))


def test_host_staging_sends_every_array_whole() -> None:
    """One pinned copy carries arrays of several dtypes and shapes, empty ones included, each back
    under its name and on a 16-byte boundary (as Triton's kernels are compiled for), and so is each
    group's slice of a table whatever its size; the next send reuses the buffer only after the copy
    before has left it."""
    import numpy as np

    from tokenmill.engine.worker.host_staging import HostStaging

    rng = np.random.default_rng(0)
    staging = HostStaging(torch.device("cuda"), capacity=64)  # small: the second send must grow it
    for step in range(3):
        arrays = {"ids": rng.integers(0, 1 << 40, 7 + step), "lens": rng.integers(0, 99, 3).astype(np.int32),
                  "tables": rng.integers(0, 99, (2, 3, 5 + step)).astype(np.int32),
                  "slots": rng.integers(-1, 99, (2, 7 + step)), "no_groups": np.zeros((0, 3), dtype=np.int32),
                  "empty": np.zeros(0, dtype=np.int64), "no_rows": np.zeros((1, 0, 1), dtype=np.int32),
                  "temperature": rng.random(5).astype(np.float32), "top_k": rng.integers(0, 50, 5),
                  "flags": rng.random(4) > 0.5}
        sent = staging.send(arrays)
        assert list(sent) == list(arrays)
        for name, a in arrays.items():
            assert sent[name].device.type == "cuda" and tuple(sent[name].shape) == a.shape
            assert sent[name].data_ptr() % 16 == 0
            if a.ndim > 1:
                assert all(part.data_ptr() % 16 == 0 and part.is_contiguous() for part in sent[name])
            np.testing.assert_array_equal(sent[name].cpu().numpy(), a)
