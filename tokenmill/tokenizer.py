"""Tokenizer loading, chat templates, and incremental detokenization."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

# Tokens of prompt context kept in front of the output when decoding, so that
# tokenizers that mark word starts (SentencePiece's "▁") space the first word right.
_CONTEXT_TOKENS = 5


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """The model's own tokenizer (fast, with its chat template), or None when the directory
    ships none (the engine then takes token ids only); a GGUF file's from its metadata.
    transformers (seconds to import) is imported only when there is a tokenizer to build."""
    model_dir = Path(model_dir)
    is_gguf = model_dir.suffix.lower() == ".gguf"
    if not is_gguf and not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        if is_gguf:  # rebuilt from the file's metadata, as transformers does
            return AutoTokenizer.from_pretrained(str(model_dir.parent), gguf_file=model_dir.name)
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:  # a corrupt or unreadable file, named by what failed
        raise ValueError(f"cannot load the tokenizer of {model_dir}: {type(exc).__name__}: {exc}") from exc


def invalid_unicode_at(text: str) -> int | None:
    """Where ``text`` stops being valid Unicode, or None. A lone surrogate (JSON allows
    ``"\\ud800"``) cannot be tokenized nor written as UTF-8, so every boundary refuses it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def check_text(text: str, what: str = "the prompt") -> None:
    """Refused here rather than failing inside the tokenizer."""
    index = invalid_unicode_at(text)
    if index is not None:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate U+{ord(text[index]):04X} at position {index}")


def encode_prompt(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``. The engine checks the length against its own limit, so the
    tokenizer's warning about its ``model_max_length`` would only mislead."""
    check_text(text)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens, verbose=False)


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered, named as vLLM's chat request fields."""

    add_generation_prompt: bool = True  # open the assistant's turn
    continue_final_message: bool = False  # leave the last message open, to be continued
    chat_template: str | None = None  # a Jinja template instead of the tokenizer's
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra variables for the template
    add_special_tokens: bool = False  # the tokenizer's own (BOS...) on top of those the template writes
    tools: list[dict[str, Any]] | None = None  # function tools offered to the template, as transformers takes them


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its tool calls' arguments as objects: OpenAI sends them as JSON text,
    and templates write them with ``tojson``, which would quote that text once more. Text that
    is no JSON object stays as it is."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    return {**message, "tool_calls": [_call_with_object_arguments(call) for call in calls]}


def _call_with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": parsed}} if isinstance(parsed, dict) else call


class TemplateTimeout(ValueError):
    """A chat template ran past its time limit and was stopped."""


_TEMPLATE_FILE = "<template>"  # the file name of the code Jinja compiles a template from a string to


@contextlib.contextmanager
def _template_time_limit(seconds: float | None) -> Iterator[None]:
    """Stop the Jinja templates that this thread renders once they have run ``seconds``: a trace
    function counts the lines each executes (the compiled template's own code only, so the
    tokenizer and Jinja's runtime run untraced) and raises inside the template when the time is
    up. A loop cannot escape it, however it nests; the sandbox already caps each ``range``."""
    if seconds is None:
        yield
        return
    deadline = time.monotonic() + seconds
    lines = 0

    def in_template(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal lines
        lines += 1
        if lines % 256 == 0 and time.monotonic() > deadline:
            raise TemplateTimeout(f"the chat template took longer than {seconds:g} s to render these messages")
        return in_template

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        return in_template if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    options: ChatOptions = ChatOptions(),
    time_limit: float | None = None,
    max_chars: int | None = None,
) -> str:
    """``messages`` through the chat template, ready for the reply. The template decides
    which roles and contents it takes; its refusal, or any error it raises, is a ValueError, and
    so is a rendering stopped after ``time_limit`` seconds (``TemplateTimeout``) or one longer than
    ``max_chars`` (before it is tokenized)."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it cannot take chat messages")
    if options.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    if options.add_generation_prompt and options.continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"each chat message must be a dict with a string 'role', got {message!r:.80}")
        if isinstance(message.get("content"), str):
            check_text(message["content"], "a message's content")
    try:
        with _template_time_limit(time_limit):
            text = tokenizer.apply_chat_template(
                [_template_message(m) for m in messages],
                tokenize=False,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                chat_template=options.chat_template,
                **{"tools": options.tools, **options.chat_template_kwargs},
            )  # the kwargs win, as in vLLM
    except TemplateTimeout:
        raise
    except Exception as exc:
        raise ValueError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from None
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(
            f"the chat template rendered these messages as {len(text)} characters, more than the {max_chars} taken"
        )
    return text


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    options: ChatOptions = ChatOptions(),
    time_limit: float | None = None,
    max_chars: int | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template (the template already holds
    any special tokens it wants)."""
    text = render_chat(tokenizer, messages, options, time_limit, max_chars)
    return encode_prompt(tokenizer, text, options.add_special_tokens)


class Detokenizer:
    """Turns a growing list of token ids into text, one delta at a time; a token that ends
    inside a multi-byte UTF-8 character gives no text until the character is complete, so
    no half character is ever emitted."""

    def add(self, token_id: int) -> str:
        """The text that ``token_id`` completes (possibly empty)."""
        raise NotImplementedError


class StreamDetokenizer(Detokenizer):
    """For fast tokenizers: the ``tokenizers`` library's own incremental decoder, one call
    into Rust per token (about 7x cheaper than decoding two windows of ids in Python)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self.backend = tokenizer._tokenizer
        self.stream = DecodeStream(
            ids=list(prompt_token_ids[-_CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens
        )

    def add(self, token_id: int) -> str:
        return self.stream.step(self.backend, token_id) or ""


class WindowDetokenizer(Detokenizer):
    """For any tokenizer: decode the window of ids before and with the new token, and emit
    the difference (held back while it ends in U+FFFD, a character not yet complete)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix) :]


def make_detokenizer(tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> Detokenizer:
    from tokenizers import Tokenizer

    kind = StreamDetokenizer if isinstance(getattr(tokenizer, "_tokenizer", None), Tokenizer) else WindowDetokenizer
    return kind(tokenizer, prompt_token_ids, skip_special_tokens)
