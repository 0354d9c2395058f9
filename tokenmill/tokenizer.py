"""Tokenizer loading, chat templates, and incremental detokenization."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

# Tokens of prompt context kept in front of the output when decoding, so that
# tokenizers that mark word starts (SentencePiece's "▁") space the first word right.
_CONTEXT_TOKENS = 5


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """The model's own tokenizer (fast, with its chat template), or None when the directory
    ships none (the engine then takes token ids only)."""
    model_dir = Path(model_dir)
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of ``messages`` rendered by the model's chat template, ready for the reply."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it cannot take chat messages")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one delta at a time.

    A token that ends inside a multi-byte UTF-8 character decodes to U+FFFD; the
    delta is then held back until the character is complete, so no half character
    is ever emitted.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """The text that ``token_id`` completes (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix):]
