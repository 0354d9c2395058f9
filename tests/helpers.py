"""Tiny models and tokenizers built inside the tests (nothing is downloaded)."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
from transformers import (
    Gemma3Config,
    Gemma3TextConfig,
    Gemma4AudioConfig,
    Gemma4Config,
    Gemma4TextConfig,
    Gemma4VisionConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    SiglipVisionConfig,
)
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.engine.core.scheduler import StepCost, StepWork
from tokenmill.engine.sequence import Sequence

VOCAB = 320

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=None)

# Each config exercises what its architecture adds: GQA everywhere, head_dim
# different from hidden/heads, llama3 rope scaling, tied and untied embeddings,
# q/k/v bias (Qwen2), q/k norm (Qwen3), a sliding window shorter than the prompts.
# Gemma 3: sliding/global layers (window shorter than the prompts) with their own RoPE
# (linear scaling on the global ones), a query_pre_attn_scalar unlike head_dim, final-logit
# softcapping; and the language model of a multimodal checkpoint (nested text_config,
# weights under language_model., a vision tower to skip, the older sliding_window_pattern).
GEMMA3_TEXT = dict(**{**COMMON, "num_hidden_layers": 3}, head_dim=32, query_pre_attn_scalar=24, sliding_window=24)


def gemma3_multimodal() -> Gemma3Config:
    text = Gemma3TextConfig(**GEMMA3_TEXT, sliding_window_pattern=2)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    return Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                        image_token_index=VOCAB - 3, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 1,
                        initializer_range=COMMON["initializer_range"])


# For GGUF files, which state less: "gemma3-six-layers" is Gemma 3 as llama.cpp lays layers out (every
# sixth global), its window shorter than the prompts, its global rope base not the default;
# "llama-wide" has rows of 256 values, a K-quant's super-block.
GGUF_CONFIGS = {
    # Heads of 256, as the Gemma 3 sizes but the 27B have: their attention scale is the head size's.
    "gemma3-six-layers": lambda: Gemma3TextConfig(
        **{**GEMMA3_TEXT, "num_hidden_layers": 6, "sliding_window": 8, "head_dim": 256, "query_pre_attn_scalar": 256},
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
    # The 4B-27B's linear rope scaling on the global layers, and the scale of the head size (32).
    "gemma3-rope-scaled": lambda: Gemma3TextConfig(
        **{**GEMMA3_TEXT, "num_hidden_layers": 6, "sliding_window": 8, "query_pre_attn_scalar": 32},
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000.0}}),
    "gemma3-62-layers": lambda: Gemma3TextConfig(**{**GEMMA3_TEXT, "num_hidden_layers": 62}),
    "llama-wide": lambda: LlamaConfig(**{**COMMON, "hidden_size": 256, "intermediate_size": 256}, head_dim=64),
}

# Gemma 4: sliding and global layers (window shorter than the prompts; proportional RoPE on the
# global ones). "gemma4": global layers with wider heads and fewer KV heads than the sliding ones,
# v = k there (attention_k_eq_v), per-layer inputs, final softcap, untied head. "gemma4-kv-shared":
# the last 2 of 5 layers read the caches of layers 2 (sliding) and 1 (global, wider heads) and have
# double-wide MLPs; separate v, per-layer inputs. "gemma4-multimodal": the language model of a
# checkpoint with vision and audio towers to skip, use_bidirectional_attention "vision" (causal for
# text), no per-layer inputs, all layers of one cache shape (so an engine of one KV shape runs it).
# (transformers 5.24 cannot run KV sharing without per-layer inputs: its prefill slicing indexes them.)
GEMMA4_TEXT = dict(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=24,
                   hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                       "rope_theta": 10000.0}})


def gemma4_multimodal() -> Gemma4Config:
    text = Gemma4TextConfig(**{**GEMMA4_TEXT, "num_hidden_layers": 3, "hidden_size_per_layer_input": 0,
                               "pad_token_id": 0,  # Gemma4Model swaps multimodal placeholders for it, and needs one
                               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
                            global_head_dim=16, attention_k_eq_v=True, use_bidirectional_attention="vision")
    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=16,
                                pooling_kernel_size=2)
    audio = Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, conv_kernel_size=3,
                              subsampling_conv_channels=[4, 4], output_proj_dims=16)
    return Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=audio.to_dict(),
                        initializer_range=COMMON["initializer_range"])


TINY_CONFIGS = {
    "llama3": lambda: LlamaConfig(**COMMON, head_dim=32, tie_word_embeddings=False, rope_theta=500000.0,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "llama2-tied": lambda: LlamaConfig(**{**COMMON, "num_key_value_heads": 4}, tie_word_embeddings=True),
    "mistral-window": lambda: MistralConfig(**COMMON, head_dim=16, sliding_window=24, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
    # Mixtures of experts: 4 experts, 2 per token. "qwen3-moe": sparse layers every second one
    # (decoder_sparse_step 2) less those in mlp_only_layers (1): layers 3 and 5 sparse, 0, 1, 2, 4 dense; experts
    # narrower than the dense MLPs, top-k weights left as the softmax gave them (norm_topk_prob off);
    # "qwen3-moe-norm": every layer sparse, weights renormalised; "mixtral-window": every layer sparse,
    # a sliding window shorter than the prompts.
    "qwen3-moe": lambda: Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 6}, head_dim=16, num_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2,
                                        mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=False),
    "qwen3-moe-norm": lambda: Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                             norm_topk_prob=True, tie_word_embeddings=True),
    "mixtral-window": lambda: MixtralConfig(**{**COMMON, "intermediate_size": 48}, head_dim=16, num_local_experts=4,
                                            num_experts_per_tok=2, sliding_window=24, tie_word_embeddings=False),
    "gemma3": lambda: Gemma3TextConfig(
        **GEMMA3_TEXT, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=5.0, tie_word_embeddings=False,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
    "gemma3-multimodal": gemma3_multimodal,
    "gemma4": lambda: Gemma4TextConfig(**GEMMA4_TEXT, global_head_dim=32, num_global_key_value_heads=1,
                                       attention_k_eq_v=True, final_logit_softcapping=5.0, tie_word_embeddings=False),
    "gemma4-kv-shared": lambda: Gemma4TextConfig(
        **{**GEMMA4_TEXT, "num_hidden_layers": 5,
           "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                           "full_attention"]},
        global_head_dim=32, num_kv_shared_layers=2, use_double_wide_mlp=True),
    "gemma4-multimodal": gemma4_multimodal,
}


def make_model_dir(name: str, path: Path, seed: int = 0, max_positions: int | None = None) -> torch.nn.Module:
    """Save a random tiny model of config ``name`` (of TINY_CONFIGS or GGUF_CONFIGS) to ``path``;
    returns the transformers model. ``max_positions`` replaces the config's max_position_embeddings
    (512), past which the engine refuses a max_model_len, for tests of longer sequences."""
    torch.manual_seed(seed)
    config = (TINY_CONFIGS | GGUF_CONFIGS)[name]()
    if max_positions is not None:
        config.max_position_embeddings = max_positions
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if config.model_type.startswith("gemma4") or name in GGUF_CONFIGS:
        vary_unit_weights(model)
    model.save_pretrained(path)
    return model


def vary_unit_weights(model: torch.nn.Module) -> None:
    """Norm weights and Gemma 4's layer scalars start at one (zero for Gemma 3's ``1 + w``), where a
    norm read wrongly (as ``1 + w``, or with a GGUF file's offset left in) or a scalar left out goes
    unnoticed: draw them from [0.5, 1.5) instead."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(("norm.weight", "layer_scalar")):
            tensor.data.uniform_(0.5, 1.5)


def make_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with a chat template, trained on a few lines of text
    that include multi-byte characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = ["def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
             "héllo wörld ünïcode ✓ 日本語 🙂 naïve café", "the quick brown fox jumps over the lazy dog"] * 4
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    fast.save_pretrained(path)
    return fast


def make_model_with_tokenizer(name: str, path: Path) -> Path:
    """A tiny model of config ``name`` and the test tokenizer, in ``path``."""
    make_model_dir(name, path)
    make_tokenizer(path)
    return path


def frozen_step_cost(fixed_s: float, per_token_s: float, per_pair_s: float = 0.0) -> StepCost:
    """A CPU step-cost estimate fitted to steps that took exactly ``fixed_s + per_token_s`` × tokens +
    ``per_pair_s`` × query-key pairs, which the engine's own timings then leave alone: the prompt
    chunks it sizes are the same every run."""
    cost = StepCost()
    for work in (StepWork(1, 100), StepWork(64, 4096), StepWork(256, 300_000), StepWork(1024, 1 << 20),
                 StepWork(16, 30_000)):
        cost.observe(work, fixed_s + per_token_s * work.tokens + per_pair_s * work.pairs)
    cost.observe = lambda work, seconds: None
    return cost


def num_scheduled_tokens(seq: Sequence) -> int:
    """Known tokens and this step's drafts: what a step that computes everything covers."""
    return len(seq.token_ids) + len(seq.draft_token_ids)


def assert_clean(llm) -> None:
    """Nothing left of finished or failed requests: no request state, no blocks held, no queue."""
    core = llm.engine.core
    assert llm.engine.requests == {} and core.requests == {}
    assert core.kv.num_blocks_in_use == 0 and not core.scheduler.running and not core.scheduler.waiting


# Speculative decoding by prompt lookup, as the tests configure it.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def echo_prompts(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt followed by the model's own greedy continuation and the prompt's tail again: the
    tail's earlier occurrence proposes that continuation, which the model may well repeat."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return [p + o.outputs[0].token_ids + p[-4:] for p, o in zip(prompts, outs)]


def assert_equal_up_to_a_near_tie(expected: list, got: list, logprob_tol: float, tie: float,
                                  flip_tol: float | None = None) -> None:
    """Greedy outputs the same, each token's logprob within ``logprob_tol``, up to a first difference
    that only a near-tie explains (the two tokens within ``tie`` of each other where it happens).

    With ``flip_tol`` (quantized caches) the median difference is within ``logprob_tol`` and each one
    within ``flip_tol``: float rounding that moves a value across a quantization boundary changes
    it by a whole step, and the tokens after it by more than rounding (Gemma 4's tiny config on the
    CPU, its queries perturbed by 1e-6: median 1e-5, up to a tenth of the tokens over 1e-2, the
    largest 0.08), where a wrong block or scale moves most tokens."""
    diffs = []
    for a, b in zip(expected, got):
        ours, theirs = a.outputs[0], b.outputs[0]
        n = next((i for i, (x, y) in enumerate(zip(ours.token_ids, theirs.token_ids)) if x != y), len(ours.token_ids))
        diffs += [abs(ours.logprobs[i][ours.token_ids[i]] - theirs.logprobs[i][theirs.token_ids[i]]) for i in range(n)]
        if n < len(ours.token_ids):
            lp = ours.logprobs[n]
            assert lp[ours.token_ids[n]] - lp.get(theirs.token_ids[n], float("-inf")) < tie
    if flip_tol is None:
        assert max(diffs, default=0.0) < logprob_tol
    else:
        assert diffs and statistics.median(diffs) < logprob_tol and max(diffs) < flip_tol
