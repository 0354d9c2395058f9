"""Engine options, defined once: ``LLM(...)``, the CLI and the server all read them from here.

Each field carries its rule (checked on construction) and its command-line help, and
``add_engine_args`` builds the argparse options from the fields, so a new option is one
new field.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import types
import typing
from dataclasses import dataclass, fields
from typing import Any, cast

from tokenmill.validation import BOOLEAN, REJECT, Rule, check_fields, integer, number, one_of, ruled

# Defaults of the engine's options. Compile time grows faster than a constraint's size (a 2-core host,
# xgrammar 0.2.9: JSON schemas of 20, 50, 100 and 200 KiB took 0.1, 0.7, 5.5 and 25 s; the forced-call
# grammar of 32 distinct tools, 77 KiB, 0.1 s, of 128 tools, 313 KiB, 0.6 s): 128 KiB keeps a schema's
# compile to seconds and lets through tool sets of about fifty tools. A compiled 200-property schema
# takes 1-2 MB as xgrammar counts (an 8k vocabulary; more for larger ones), the process about 1.3
# times that: 300 distinct ones grew it by 395 MiB with no limit, by 342 MiB under a 256 MiB one.
# Four workers: three slow compiles still leave one to the quick ones (each compile also runs up to
# eight threads of xgrammar's own).
DEFAULT_COMPILE_WORKERS = 4
DEFAULT_CACHE_BYTES = 256 << 20
DEFAULT_MAX_CONSTRAINT_BYTES = 128 << 10


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config`` for prompt lookup (``method="ngram"``)."""

    num_speculative_tokens: int = ruled(None, integer(1, 16), help="draft tokens proposed for each sequence each step")
    method: str = ruled(
        "ngram",
        one_of({"ngram": "ngram", "prompt_lookup": "ngram"}),
        help="how drafts are proposed: ngram (prompt lookup)",
    )
    prompt_lookup_max: int = ruled(4, integer(1, 64), help="longest n-gram matched")
    prompt_lookup_min: int = ruled(1, integer(1, 64), help="shortest n-gram matched")
    # 16: on the H200 a verify step of 5 tokens a sequence costs 1.03-1.15x a one-token step up to 16
    # sequences, 1.27x at 32 and 1.59x at 64 (Llama-3-8B, docs/PERFORMANCE.md).
    disable_by_batch_size: int = ruled(
        16,
        integer(1),
        help="no drafts while this many sequences or more are running: the batch alone keeps "
        "the GPU busy, and a draft rejected costs more than it saves",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """From ``LLM(speculative_config=...)`` (a dict, or this class) or the command line (its JSON)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(map(repr, set(value) - known))
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(unknown)}; the keys are {', '.join(sorted(known))}"
            )
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        try:
            return cls(**value)
        except ValueError as exc:
            raise ValueError(f"speculative_config: {exc}") from None


SPECULATIVE_CONFIG = Rule("None, a dict or its JSON", "", SpeculativeConfig.parse)


# Accepted spellings of each dtype, as torch names them.
_DTYPES = {
    "auto": "auto",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "float32": "float32",
    "float": "float32",
}
_POLICIES = {"fcfs": "fcfs", "priority": "priority"}
# vLLM's names for the KV cache's dtype; fp8 is fp8_e4m3.
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "int8": "int8"}
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
_QUANTIZATIONS = {"q8_0": "q8_0", "fp8": "fp8"}


def _model(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        return REJECT
    path = os.fspath(value)
    return path if isinstance(path, str) and path else REJECT


def _device(value: Any) -> Any:
    return value if isinstance(value, str) and _DEVICE.fullmatch(value) else REJECT


_POSITIVE = integer(lo=1)


@dataclass
class EngineConfig:
    """Engine options, named as in vLLM. ``model=None`` is the embedded default model.
    Every field is checked on construction: a bad value is a ValueError that names it."""

    model: str | None = ruled(
        None,
        Rule("None or a non-empty path (str or os.PathLike)", "", _model),
        help="directory of a Hugging Face checkpoint; none means the small model shipped with tokenmill",
    )
    dtype: str = ruled(
        "auto",
        one_of(_DTYPES),
        choices=tuple(_DTYPES),
        help="weight and activation dtype; auto keeps the checkpoint's dtype on a GPU and uses float32 on "
        "the CPU (half is float16, float is float32)",
    )
    device: str = ruled(
        "auto",
        Rule("auto, cpu, cuda or cuda:N", "", _device),
        help="where to run: auto (a GPU if there is one), cpu, cuda or cuda:N",
    )
    seed: int = ruled(
        0,
        integer(-(2**63), 2**64 - 1, bounds="in [-2**63, 2**64 - 1]"),
        help="seed of the engine's random numbers (random weights); generate and chat also sample with it, "
        "so the same seed gives the same text",
    )
    block_size: int = ruled(16, _POSITIVE, help="tokens per KV cache block")
    max_num_seqs: int = ruled(256, _POSITIVE, help="most sequences decoded together in one step")
    max_num_batched_tokens: int | None = ruled(
        None,
        _POSITIVE.or_none(),
        help="most tokens one step computes (prompt chunks and decoded tokens together); none means 8192 on a "
        "GPU of 70 GiB or more, else 2048",
    )
    max_model_len: int | None = ruled(
        None,
        _POSITIVE.or_none(),
        help="longest sequence, prompt and output together; none means the model's context length",
    )
    enable_prefix_caching: bool = ruled(
        True,
        BOOLEAN,
        negative_alias="--no-prefix-caching",
        help="reuse the KV cache of prompt prefixes computed before",
    )
    kv_cache_dtype: str = ruled(
        "auto",
        one_of(KV_CACHE_DTYPES),
        choices=tuple(KV_CACHE_DTYPES),
        help="what the KV cache stores: auto (the model's dtype), or fp8 (= fp8_e4m3), fp8_e5m2 or int8 with "
        "one scale per token and KV head (about half the bytes, so twice the tokens; fp8 e4m3 needs compute "
        "capability 8.9 or later on a GPU)",
    )
    quantization: str | None = ruled(
        None,
        one_of(_QUANTIZATIONS).or_none(),
        choices=tuple(_QUANTIZATIONS),
        help="keep the projections' weights quantized: q8_0 (int8 with a scale per 32 values, GGUF's Q8_0: about "
        "half of bf16's bytes) or fp8 (float8 e4m3 with a scale per output row, activations quantized per token; "
        "computed by the torch reference for now); none keeps them in dtype, except a GGUF file's Q8_0 weights, "
        "which stay packed, and an FP8 checkpoint's (compressed-tensors or quant_method fp8), which stay FP8",
    )
    num_kv_blocks: int | None = ruled(
        None,
        _POSITIVE.or_none(),
        help="KV cache blocks to allocate; none sizes the cache from the memory left after the weights",
    )
    gpu_memory_utilization: float = ruled(
        0.9,
        number(0, 1, lo_open=True),
        help="fraction of the GPU's memory the engine may use (weights, activations and KV cache)",
    )
    cpu_kv_cache_gib: float = ruled(
        1.0, number(0, lo_open=True), help="KV cache size in GiB when the engine runs on the CPU"
    )
    static_batching: bool = ruled(
        False,
        BOOLEAN,
        help="admit new requests only when the batch is empty, in waves (to compare with continuous batching)",
    )
    scheduling_policy: str = ruled(
        "fcfs",
        one_of(_POLICIES),
        choices=tuple(_POLICIES),
        help="order of admission and preemption: fcfs (arrival) or priority (each request's priority, lower "
        "first, then arrival; preemption takes the last in that order)",
    )
    max_logprobs: int = ruled(
        20,
        integer(-1, bounds=">= -1 (-1: no limit)"),
        help="most logprobs a request may ask for at each position (logprobs, prompt_logprobs; chat's top_logprobs); "
        "-1 lets a request ask for the whole vocabulary (-1), which costs the engine and the server memory in "
        "proportion to the vocabulary for each token",
    )
    enforce_eager: bool = ruled(False, BOOLEAN, help="run without CUDA graphs")
    async_scheduling: bool = ruled(
        True, BOOLEAN, help="launch step N+1 before reading step N's tokens, so the GPU never waits for the host"
    )
    speculative_config: SpeculativeConfig | None = ruled(
        None,
        SPECULATIVE_CONFIG,
        cli_type=str,
        help='speculative decoding by prompt lookup, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1} (optional "disable_by_batch_size": no drafts from '
        "that many running sequences on, default 16); outputs are those of plain decoding",
    )
    grammar_compile_workers: int = ruled(
        DEFAULT_COMPILE_WORKERS,
        integer(1, 64),
        help="threads that compile structured-output constraints (JSON schemas, regexes, grammars) beside the "
        "step loop; a request whose constraint finds none free for 30 s, or compiles for longer than 30 s, "
        "fails with HTTP 503",
    )
    grammar_cache_bytes: int = ruled(
        DEFAULT_CACHE_BYTES,
        integer(0),
        help="most bytes of compiled structured-output grammars kept for reuse (as xgrammar measures them; the "
        "process holds about 1.3 times that), least recently used dropped first; 0 keeps none",
    )
    max_structured_output_bytes: int = ruled(
        DEFAULT_MAX_CONSTRAINT_BYTES,
        _POSITIVE,
        help="largest structured-output constraint a request may send: the JSON schema's text, the regex, the "
        "grammar, or all choices together, in UTF-8 bytes (compile time grows faster than the size: a "
        "100 KiB JSON schema of 1000 properties takes seconds)",
    )
    tensor_parallel_size: int = ruled(
        1,
        _POSITIVE,
        help="split every layer over this many GPUs (processes on the CPU), one process each: the model's "
        "attention heads (and KV heads, or else it is a multiple of them) must divide evenly; 1 runs in "
        "one process",
    )
    random_weights: bool = ruled(
        False, BOOLEAN, cli=False, help="real shapes with random values: for benchmarks, which need no checkpoint"
    )

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def from_options(cls, model: str | os.PathLike[str] | None = None, **options: Any) -> EngineConfig:
        """The config of ``LLM(model, **options)``: an unknown option is a ValueError that
        lists the valid ones (a plain dataclass would raise a TypeError naming one)."""
        valid = [f.name for f in fields(cls) if f.name != "model"]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown engine option{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}; "
                f"the options are model, {', '.join(valid)}"
            )
        return cls(model=cast(str | None, model), **options)  # __post_init__ turns a PathLike into its str


def _cli_fields(cls: type) -> list[Any]:
    return [f for f in fields(cls) if f.metadata.get("cli", True)]


def _value_type(hint: Any) -> type:
    """``int`` for ``int | None``: what argparse converts the option's text to."""
    if isinstance(hint, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint


def add_option_args(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """Add an options dataclass's fields (each ``ruled`` with its ``help``) as an argument group,
    ``--field-name`` each. A boolean that is on by default also gets ``--no-...``."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in _cli_fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"]
        if hints[f.name] is bool:
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            group.add_argument(flag, action=action, default=f.default, help=help_text)
        else:
            group.add_argument(
                flag,
                type=f.metadata.get("cli_type", _value_type(hints[f.name])),
                default=f.default,
                choices=f.metadata.get("choices"),
                help=help_text,
            )
        if "negative_alias" in f.metadata:
            group.add_argument(
                f.metadata["negative_alias"],
                dest=f.name,
                action="store_false",
                default=argparse.SUPPRESS,
                help=f"the same as --no-{flag[2:]}",
            )


def options_from_args(cls: type, args: argparse.Namespace) -> Any:
    """An options dataclass from parsed command-line options (the others are ignored)."""
    names = {f.name for f in _cli_fields(cls)}
    return cls(**{name: value for name, value in vars(args).items() if name in names})


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine options (``--model``, ``--max-num-seqs``, ...), one per ``EngineConfig`` field."""
    add_option_args(parser, EngineConfig, "engine")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of parsed command-line options (other options are ignored)."""
    return options_from_args(EngineConfig, args)
