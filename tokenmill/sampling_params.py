"""Per-request sampling and stopping options, named as in vLLM."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from tokenmill.tokenizer import invalid_unicode_at
from tokenmill.validation import BOOLEAN, REJECT, Rule, field_rules, integer, number, ruled


def _is_stop_text(value: Any) -> bool:
    """A stop string must be non-empty (it would match everywhere) and encodable as UTF-8
    (a lone surrogate can never appear in decoded text, and breaks JSON output)."""
    return isinstance(value, str) and bool(value) and invalid_unicode_at(value) is None


def _stop(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, str):
        return value if _is_stop_text(value) else REJECT
    if isinstance(value, (list, tuple)) and all(_is_stop_text(s) for s in value):
        return list(value)
    return REJECT


_TOKEN_ID = integer(lo=0)


def _token_ids(value: Any) -> Any:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        return REJECT
    ids = [_TOKEN_ID.normal(v) for v in value]
    return REJECT if any(i is REJECT for i in ids) else ids


_STOP = Rule("None, a string or a list of strings, each non-empty and valid UTF-8", "", _stop)
# Token ids are only known to be >= 0 here; the engine checks them against the vocabulary.
_STOP_TOKEN_IDS = Rule("None or a list of integers >= 0", "", _token_ids)
# The range torch's Generator.manual_seed takes.
_SEED = integer(-(2**63), 2**64 - 1, bounds="in [-2**63, 2**64 - 1]").or_none()
# Counts must fit the 64-bit integers of the engine's messages; floats the device's float32.
_INT64_MAX = 2**63 - 1
_FLOAT32_MAX, _FLOAT32_MIN = 1e30, 1e-30
# -1 asks for every token of the vocabulary, as in vLLM.
_LOGPROBS = integer(-1, _INT64_MAX, bounds="in [-1, 2**63 - 1] (-1 means the whole vocabulary)").or_none()
_BIAS_TOKEN = integer(0, _INT64_MAX)
# OpenAI's range: -100 in effect bans a token, +100 in effect forces it.
_BIAS_VALUE = number(-100, 100)


def _logit_bias(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, dict):
        return REJECT
    bias = {_BIAS_TOKEN.normal(k): _BIAS_VALUE.normal(v) for k, v in value.items()}
    return REJECT if REJECT in bias or any(v is REJECT for v in bias.values()) else bias


# Token ids are only known to be >= 0 here; the engine checks them against the vocabulary.
_LOGIT_BIAS = Rule("None or a dict of token ids (integers >= 0) to finite numbers in [-100, 100]", "", _logit_bias)


@dataclass
class StructuredOutputsParams:
    """What the output must be, named as vLLM names it: exactly one of a JSON schema (``json``, a dict
    or its text), any JSON object (``json_object=True``), a regular expression (``regex``), one of
    some strings (``choice``), or an EBNF grammar (``grammar``)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if type(self.json_object) is not bool:
            raise ValueError(f"structured_outputs must be json_object: True or False, got {self.json_object!r}")
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must be exactly one of json, regex, choice, grammar or json_object, "
                f"got {', '.join(given) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(
                f"structured_outputs must be json: a JSON schema (a dict or its text), got {type(self.json).__name__}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value and invalid_unicode_at(value) is None):
                raise ValueError(f"structured_outputs must be {name}: a non-empty string, got {value!r}")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(_is_stop_text(c) for c in self.choice)
            ):
                raise ValueError(
                    f"structured_outputs must be choice: a non-empty list of non-empty strings, got {self.choice!r}"
                )
            self.choice = list(self.choice)

    def key(self) -> str:
        """One text per distinct constraint (compiled grammars are cached under it)."""
        return json.dumps(
            {
                "json": self.json,
                "regex": self.regex,
                "choice": self.choice,
                "grammar": self.grammar,
                "json_object": self.json_object,
            },
            sort_keys=True,
        )


def _structured_outputs(value: Any) -> Any:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(map(repr, set(value) - {f.name for f in fields(StructuredOutputsParams)}))
        if unknown:
            raise ValueError(
                "structured_outputs must be a dict of json, regex, choice, grammar or json_object, got "
                f"the unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
            )
        return StructuredOutputsParams(**value)  # its own checks raise with the field named
    return REJECT


_STRUCTURED_OUTPUTS = Rule("None, a StructuredOutputsParams or a dict of its fields", "", _structured_outputs)

# The most sequences one request may ask for. Each is made when the request is queued (its sequence,
# its detokenizer, a seeded generator), before anything runs, so n = 10**6 offline meant a million of
# them and gigabytes first. 1024 is far past any best-of-n use (the server takes at most 128, vLLM's
# benchmarks go to 64) and keeps that work to milliseconds.
MAX_N = 1024


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Every field is checked as it is set, on construction
    and by any later assignment, so that a bad value fails with a ValueError (naming the field, the
    rule and the value) at once, before it reaches the engine; every field is then in its normal
    form (``int``, finite ``float``, ``bool``; ``stop_token_ids`` a list)."""

    n: int = ruled(1, integer(1, MAX_N))
    temperature: float = ruled(1.0, number(0, _FLOAT32_MAX))
    top_p: float = ruled(1.0, number(0, 1, lo_open=True))
    # Any size is allowed: the engine clamps it to the vocabulary.
    top_k: int = ruled(0, integer(-1, _INT64_MAX, bounds="in [-1, 2**63 - 1] (-1 and 0 turn it off)"))
    min_p: float = ruled(0.0, number(0, 1))
    repetition_penalty: float = ruled(1.0, number(_FLOAT32_MIN, _FLOAT32_MAX))
    presence_penalty: float = ruled(0.0, number(-2, 2))
    frequency_penalty: float = ruled(0.0, number(-2, 2))
    seed: int | None = ruled(None, _SEED)
    max_tokens: int | None = ruled(16, integer(1, _INT64_MAX).or_none())
    min_tokens: int = ruled(0, integer(0, _INT64_MAX))
    stop: str | list[str] | None = ruled(None, _STOP)
    stop_token_ids: list[int] | None = ruled(None, _STOP_TOKEN_IDS)
    ignore_eos: bool = ruled(False, BOOLEAN)
    logprobs: int | None = ruled(None, _LOGPROBS)
    prompt_logprobs: int | None = ruled(None, _LOGPROBS)
    skip_special_tokens: bool = ruled(True, BOOLEAN)
    include_stop_str_in_output: bool = ruled(False, BOOLEAN)
    # Added to the raw logits of the named tokens before penalties and temperature.
    logit_bias: dict[int, float] | None = ruled(None, _LOGIT_BIAS)
    # Constrained decoding: each step samples only tokens that keep the output valid.
    structured_outputs: StructuredOutputsParams | None = ruled(None, _STRUCTURED_OUTPUTS)
    stop_strings: list[str] = field(init=False, repr=False)  # ``stop`` as a list, set with it

    def __setattr__(self, name: str, value: Any) -> None:
        """Each field's rule, applied by the constructor's assignments and by any later one alike (an
        object changed after it was checked, ``sp.n = 0``, once made the engine spin forever); also
        keeps ``min_tokens`` <= ``max_tokens`` and ``stop_strings`` in step with ``stop``. During the
        constructor a field not set yet reads as its default. msgspec decodes the engine's messages
        without calling this: their params were checked where they were made."""
        rule = _RULES.get(name)
        if rule is None:
            if name == "stop_strings":
                raise AttributeError("stop_strings follows stop: assign stop instead")
            object.__setattr__(self, name, value)
            return
        if value is not _NORMAL_DEFAULTS.get(name, REJECT):  # (most fields of a request keep theirs)
            value = rule(name, value)
        if name == "min_tokens":
            if self.max_tokens is not None and value > self.max_tokens:
                raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {value}")
        elif name == "max_tokens":
            if value is not None and value < self.min_tokens:
                raise ValueError(f"max_tokens must be >= min_tokens ({self.min_tokens}), got {value}")
        elif name == "stop":
            object.__setattr__(self, "stop_strings", [value] if isinstance(value, str) else list(value or []))
        object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """Penalties read every output token so far, so the sampler needs them all on the host."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


_RULES = field_rules(SamplingParams)
# The defaults that are their own normal form (not stop_token_ids' None, which becomes []): a field
# given its default object needs no check, and construction costs what it did before assignments
# were checked.
_NORMAL_DEFAULTS = {
    f.name: f.default
    for f in fields(SamplingParams)
    if f.name in _RULES and _RULES[f.name](f.name, f.default) is f.default
}
