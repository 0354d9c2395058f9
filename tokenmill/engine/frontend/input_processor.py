"""The front-end's gate: every request is tokenized and checked against the model here,
so the engine core never sees a value it cannot run.

``SamplingParams`` checks what needs no model (types, finiteness, ranges); this
checks what does: token ids within the vocabulary, and the prompt plus
``max_tokens`` within ``max_model_len``. Every failure is a ``ValueError`` that
says what is wrong, raised before anything reaches the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.engine.config import DEFAULT_MAX_CONSTRAINT_BYTES
from tokenmill.engine.core.structured_outputs import check_constraint
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import encode_prompt
from tokenmill.validation import integer

# A priority travels to the core as a 64-bit integer.
_PRIORITY = integer(-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class ModelLimits:
    """What the front-end must know of the engine to validate a request."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int = 20  # -1: any number, the whole vocabulary included
    max_structured_output_bytes: int = DEFAULT_MAX_CONSTRAINT_BYTES  # a constraint's text, at most


@dataclass
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]


class InputProcessor:
    def __init__(self, tokenizer: Any, limits: ModelLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def tokenize(self, prompt: Any, add_special_tokens: bool = True) -> ProcessedPrompt:
        """A prompt is a string (tokenized here, with the tokenizer's special tokens unless
        told not to) or a list of token ids (checked here, taken as they are)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            return ProcessedPrompt(prompt, encode_prompt(self.tokenizer, prompt, add_special_tokens))
        if isinstance(prompt, list | tuple):
            ids = list(prompt)
            vocab = self.limits.vocab_size
            bad = [t for t in ids if type(t) is not int or not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"the prompt has token ids outside the vocabulary [0, {vocab}): {[repr(t) for t in bad[:5]]}"
                )
            return ProcessedPrompt(None, ids)
        raise ValueError(f"a prompt must be a string or a list of token ids, not {type(prompt).__name__}")

    def check(self, prompt: ProcessedPrompt, params: SamplingParams) -> None:
        """The request as a whole against the model's limits."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
        limits = self.limits
        num_prompt = len(prompt.token_ids)
        if num_prompt == 0:
            raise ValueError("the prompt is empty")
        if num_prompt >= limits.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt} tokens, but this model's maximum context length "
                f"(max_model_len) is {limits.max_model_len}: it must be shorter to leave room for "
                "at least one new token"
            )
        if params.max_tokens is not None and num_prompt + params.max_tokens > limits.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {limits.max_model_len} tokens, but "
                f"{num_prompt + params.max_tokens} were asked for ({num_prompt} in the prompt, "
                f"max_tokens {params.max_tokens}): lower max_tokens or shorten the prompt"
            )
        if num_prompt + params.min_tokens > limits.max_model_len:
            raise ValueError(
                f"min_tokens {params.min_tokens} does not fit: the prompt has {num_prompt} tokens and "
                f"this model's maximum context length is {limits.max_model_len}"
            )
        bad = [t for t in params.stop_token_ids or () if t >= limits.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are not in the vocabulary [0, {limits.vocab_size})")
        bad = [t for t in params.logit_bias or () if t >= limits.vocab_size]
        if bad:
            raise ValueError(f"logit_bias has token ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limits.vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary size {limits.vocab_size}, got {value}")
            if value is not None and limits.max_logprobs != -1 and not 0 <= value <= limits.max_logprobs:
                asked = "the whole vocabulary (-1)" if value == -1 else value
                raise ValueError(
                    f"{name} asks for {asked}, but this engine gives at most {limits.max_logprobs} "
                    "logprobs a position (its max_logprobs option; -1 lifts the limit)"
                )
        if params.structured_outputs is not None:
            check_constraint(params.structured_outputs, limits.max_structured_output_bytes)

    def process(
        self, prompt: Any, params: SamplingParams, add_special_tokens: bool = True, truncate: int | None = None
    ) -> ProcessedPrompt:
        """Tokenized and checked. ``truncate`` (vLLM's ``truncate_prompt_tokens``) keeps only the
        prompt's last ``truncate`` tokens, before the length is checked; -1 keeps as many as leave
        room for the request's output (``max_tokens``, ``min_tokens``, or one token)."""
        processed = self.tokenize(prompt, add_special_tokens)
        if truncate is not None:
            keep = truncate
            if truncate == -1:
                keep = self.limits.max_model_len - max(params.max_tokens or 1, params.min_tokens)
            if 0 < keep < len(processed.token_ids):
                processed = ProcessedPrompt(None, processed.token_ids[-keep:])
        self.check(processed, params)
        return processed


def check_priority(priority: Any, scheduling_policy: str) -> int:
    """``priority`` as an ``int``, or a ValueError: it must fit 64 bits, and as in vLLM only
    the priority policy takes a nonzero one (fcfs would silently ignore it)."""
    priority = _PRIORITY("priority", priority)
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(
            f"priority needs scheduling_policy='priority' (this engine's is {scheduling_policy!r}), got {priority}"
        )
    return priority
