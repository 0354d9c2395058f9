"""A tiny random Llama with a byte-level BPE tokenizer and a chat template, for server
tests that must not wait for (or depend on) the embedded default model."""

from __future__ import annotations

from pathlib import Path

from tokenmill.default_model import DEFAULT_MODEL_DIR

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "import numpy as np\nx = np.zeros((3, 4))\n",
]


def build_tiny_model(directory: Path) -> Path:
    """Write config, random weights and tokenizer into ``directory`` (seeded, so every run
    builds the same model)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_CORPUS * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory)
    return directory


def model_dir_for_tests(tmp_dir: Path) -> Path:
    """The embedded default model once it exists, else a tiny one built in ``tmp_dir``."""
    if (DEFAULT_MODEL_DIR / "config.json").is_file():
        return DEFAULT_MODEL_DIR
    return build_tiny_model(tmp_dir)
