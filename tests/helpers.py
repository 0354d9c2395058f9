"""Tiny models and tokenizers built inside the tests (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Gemma3Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    SiglipVisionConfig,
)
from transformers import AutoModelForCausalLM

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


TINY_CONFIGS = {
    "llama3": lambda: LlamaConfig(**COMMON, head_dim=32, tie_word_embeddings=False, rope_theta=500000.0,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "llama2-tied": lambda: LlamaConfig(**{**COMMON, "num_key_value_heads": 4}, tie_word_embeddings=True),
    "mistral-window": lambda: MistralConfig(**COMMON, head_dim=16, sliding_window=24, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
    "gemma3": lambda: Gemma3TextConfig(
        **GEMMA3_TEXT, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=5.0, tie_word_embeddings=False,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
    "gemma3-multimodal": gemma3_multimodal,
}


def make_model_dir(name: str, path: Path, seed: int = 0) -> torch.nn.Module:
    """Save a random tiny model of config ``name`` to ``path``; returns the transformers model."""
    torch.manual_seed(seed)
    config = TINY_CONFIGS[name]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return model


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
