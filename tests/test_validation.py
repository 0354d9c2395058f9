"""SamplingParams and EngineConfig reject every bad value with a ValueError that names
the field, the rule and the value; whatever they accept is in its documented range."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.config import SpeculativeConfig
from tokenmill.sampling_params import MAX_N, SamplingParams, StructuredOutputsParams
from tokenmill.tokenizer import invalid_unicode_at

NAN, INF = float("nan"), float("inf")
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1


def _raises_naming(cls: type, field: str, **kwargs: object) -> str:
    with pytest.raises(ValueError) as info:
        cls(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{field} must be "), message
    assert ", got " in message, message
    return message


# ------------------------------------------------------------ SamplingParams
BAD_SAMPLING_VALUES = [
    # Wrong types used to raise TypeError (or pass).
    ("temperature", None), ("max_tokens", "x"), ("stop", 123), ("top_k", 2.5), ("max_tokens", 1.5),
    ("seed", "x"), ("stop", [1]), ("stop_token_ids", "ab"), ("n", True), ("n", 2.0), ("top_p", "1"),
    ("min_tokens", None), ("logprobs", 1.0), ("prompt_logprobs", "3"), ("ignore_eos", 1),
    ("skip_special_tokens", None), ("include_stop_str_in_output", "yes"), ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", [True]), ("stop_token_ids", 5), ("stop", {"a": 1}), ("temperature", True),
    ("presence_penalty", [0.5]),
    # Not finite.
    ("temperature", NAN), ("temperature", INF), ("repetition_penalty", NAN), ("repetition_penalty", INF),
    ("top_p", NAN), ("min_p", NAN), ("presence_penalty", NAN), ("frequency_penalty", -INF),
    ("temperature", 10**400),
    # Out of range.
    ("n", 0), ("n", MAX_N + 1), ("n", 10**6), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", -0.1),
    ("min_p", 1.01), ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("seed", SEED_MAX + 1), ("seed", SEED_MIN - 1), ("max_tokens", 0), ("min_tokens", -1),
    ("stop_token_ids", [-1]), ("logprobs", -2), ("prompt_logprobs", -5),
    ("logit_bias", {3: 100.5}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"3": 1.0}), ("logit_bias", {3: NAN}),
    ("logit_bias", {True: 1.0}), ("logit_bias", {3: "1"}), ("logit_bias", [(3, 1.0)]),
    # Stop strings: empty, or not encodable as UTF-8.
    ("stop", ""), ("stop", [""]), ("stop", "ab\ud800"), ("stop", ["ok", "\udfff"]),
]


@pytest.mark.parametrize("field, value", BAD_SAMPLING_VALUES)
def test_bad_sampling_value_is_a_value_error_naming_the_field(field: str, value: object) -> None:
    _raises_naming(SamplingParams, field, **{field: value})


@pytest.mark.parametrize("field, value", BAD_SAMPLING_VALUES)
def test_bad_sampling_value_assigned_later_is_refused_at_once(field: str, value: object) -> None:
    """Assignment is checked as construction is: the field keeps its value (``sp.n = 0`` once made
    ``LLM.generate`` spin forever, ``sp.temperature = nan`` reached the sampler)."""
    params = SamplingParams(stop=["x"], max_tokens=8)
    before = getattr(params, field)
    with pytest.raises(ValueError) as info:
        setattr(params, field, value)
    assert str(info.value).startswith(f"{field} must be ") and ", got " in str(info.value), info.value
    assert getattr(params, field) == before and params == SamplingParams(stop=["x"], max_tokens=8)


def test_assigned_values_are_stored_in_normal_form_and_stop_strings_follow_stop() -> None:
    params = SamplingParams()
    params.n, params.temperature, params.top_p = np.int64(3), 1, Fraction(1, 2)
    assert (type(params.n), type(params.temperature), params.top_p) == (int, float, 0.5)
    params.stop = ("a", "b")
    assert params.stop == ["a", "b"] and params.stop_strings == ["a", "b"]
    params.stop = "\n"
    assert params.stop_strings == ["\n"]
    params.stop = None
    assert params.stop_strings == []
    params.stop_token_ids = None
    assert params.stop_token_ids == []
    with pytest.raises(AttributeError, match="stop_strings follows stop"):
        params.stop_strings = ["y"]
    assert params.stop_strings == []


def test_assigned_min_and_max_tokens_must_agree() -> None:
    params = SamplingParams(min_tokens=5, max_tokens=10)
    with pytest.raises(ValueError, match=r"^max_tokens must be >= min_tokens \(5\), got 4$"):
        params.max_tokens = 4
    with pytest.raises(ValueError, match=r"^min_tokens must be <= max_tokens \(10\), got 11$"):
        params.min_tokens = 11
    assert (params.min_tokens, params.max_tokens) == (5, 10)
    params.max_tokens = None
    params.min_tokens = 100  # no limit to be under
    params.max_tokens = 100
    assert (params.min_tokens, params.max_tokens) == (100, 100)


def test_min_tokens_above_max_tokens() -> None:
    message = _raises_naming(SamplingParams, "min_tokens", min_tokens=5, max_tokens=2)
    assert "max_tokens (2)" in message and message.endswith("got 5")


def test_sampling_message_shows_the_rule_and_the_value() -> None:
    assert "finite number in [0, 1e+30]" in _raises_naming(SamplingParams, "temperature", temperature=NAN)
    assert "(0, 1]" in _raises_naming(SamplingParams, "top_p", top_p=0)
    assert _raises_naming(SamplingParams, "stop", stop="ab\ud800").endswith(r"got 'ab\ud800'")


def test_sampling_values_are_stored_in_normal_form() -> None:
    p = SamplingParams(n=np.int64(2), temperature=1, top_k=np.int32(5), seed=np.uint64(SEED_MAX),
                       stop=("a", "b"), stop_token_ids=(np.int64(7), 3), logprobs=np.int8(2),
                       top_p=np.float32(0.5), presence_penalty=Fraction(1, 2))
    assert (p.n, p.top_k, p.seed, p.logprobs) == (2, 5, SEED_MAX, 2)
    assert all(type(v) is int for v in (p.n, p.top_k, p.seed, p.logprobs, *p.stop_token_ids))
    assert type(p.temperature) is float and p.temperature == 1.0
    assert type(p.top_p) is float and p.presence_penalty == 0.5
    assert p.stop == ["a", "b"] and p.stop_strings == ["a", "b"] and p.stop_token_ids == [7, 3]


def test_sampling_edges_that_are_allowed() -> None:
    assert SamplingParams(top_k=-1).top_k == -1 and not SamplingParams(top_k=0).greedy
    assert SamplingParams(top_k=10**9).top_k == 10**9  # the engine clamps it to the vocabulary
    assert SamplingParams(top_k=1).greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(seed=SEED_MIN).seed == SEED_MIN
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None
    assert SamplingParams(stop="\n").stop_strings == ["\n"] and SamplingParams().stop_strings == []
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(repetition_penalty=1.2).uses_penalties and not SamplingParams().uses_penalties
    assert SamplingParams(stop="é✓😀").stop_strings == ["é✓😀"]
    assert SamplingParams(n=MAX_N).n == MAX_N


# --------------------------------------------------------------- EngineConfig
@pytest.mark.parametrize("field, value", [
    ("max_model_len", 0), ("max_model_len", -5), ("max_model_len", 1.5), ("max_model_len", "128"),
    ("max_num_seqs", 0), ("max_num_seqs", None), ("max_num_batched_tokens", 0), ("block_size", 0),
    ("block_size", 16.0), ("num_kv_blocks", 0), ("num_kv_blocks", True),
    ("gpu_memory_utilization", 0), ("gpu_memory_utilization", 1.5), ("gpu_memory_utilization", NAN),
    ("cpu_kv_cache_gib", 0), ("cpu_kv_cache_gib", INF), ("cpu_kv_cache_gib", -1.0), ("cpu_kv_cache_gib", "1"),
    ("seed", None), ("seed", 1.5), ("seed", 2**64), ("dtype", "fp8"), ("dtype", "BFLOAT16"), ("dtype", None),
    ("device", "gpu"), ("device", "cuda:"), ("device", "cuda:x"), ("device", "cuda1"), ("device", 0),
    ("model", ""), ("model", 5), ("model", b"/bytes/path"), ("enable_prefix_caching", "no"),
    ("enforce_eager", 1), ("async_scheduling", None), ("static_batching", 0), ("random_weights", "true"),
    ("scheduling_policy", "lifo"), ("scheduling_policy", None), ("kv_cache_dtype", "fp16"),
    ("kv_cache_dtype", "FP8"), ("kv_cache_dtype", None), ("kv_cache_dtype", 8), ("quantization", "int4"),
    ("quantization", 8), ("quantization", ""), ("tensor_parallel_size", 0), ("tensor_parallel_size", 2.0),
    ("tensor_parallel_size", None), ("grammar_compile_workers", 0), ("grammar_compile_workers", 65),
    ("grammar_compile_workers", 2.5), ("grammar_cache_bytes", -1), ("grammar_cache_bytes", "1G"),
    ("grammar_cache_bytes", None), ("max_structured_output_bytes", 0), ("max_structured_output_bytes", 1.5),
])
def test_bad_engine_value_is_a_value_error_naming_the_field(field: str, value: object) -> None:
    _raises_naming(EngineConfig, field, **{field: value})


def test_engine_values_are_stored_in_normal_form(tmp_path: Path) -> None:
    config = EngineConfig(model=tmp_path, dtype="half", device="cuda:1", max_model_len=np.int64(128),
                          gpu_memory_utilization=1, cpu_kv_cache_gib=2)
    assert config.model == str(tmp_path) and config.dtype == "float16" and config.device == "cuda:1"
    assert type(config.max_model_len) is int and config.gpu_memory_utilization == 1.0
    assert type(config.cpu_kv_cache_gib) is float
    assert EngineConfig(dtype="float").dtype == "float32"
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig() == EngineConfig(model=None, dtype="auto", device="auto")


def test_from_options_names_the_unknown_options_and_the_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        EngineConfig.from_options("m", max_seqs=4, tensor_parallel_size=2)
    message = str(info.value)
    assert "max_seqs" in message and "tensor_parallel_size" in message
    assert "max_num_seqs" in message and "enable_prefix_caching" in message


def test_from_options_builds_a_checked_config() -> None:
    config = EngineConfig.from_options(Path("/some/model"), max_num_seqs=4, device="cpu")
    assert config == EngineConfig(model="/some/model", max_num_seqs=4, device="cpu")
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineConfig.from_options(None, max_num_seqs=0)


# ------------------------------------------------------------------- fuzzing
SAMPLING_FIELDS = [name for name in SamplingParams.__dataclass_fields__ if name != "stop_strings"]
ENGINE_FIELDS = list(EngineConfig.__dataclass_fields__)


def _anything() -> st.SearchStrategy:
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(), st.integers(-3, 300), st.floats(), st.floats(-3, 3),
        st.text(max_size=8), st.binary(max_size=4), st.fractions(),
        st.integers(-2**63, 2**63 - 1).map(np.int64), st.floats(width=32).map(np.float32),
        st.sampled_from([2**64 - 1, 2**64, -2**63, -2**63 - 1, 10**400, "", "\ud800", "cpu", "cuda:0",
                         "auto", "half", "bfloat16", np.bool_(True), complex(1, 0), object()]),
    )
    return st.one_of(scalars, st.lists(scalars, max_size=4), st.tuples(scalars, scalars),
                     st.dictionaries(st.text(max_size=2), scalars, max_size=2))


_COUNT = st.none() | st.integers(-1, 20)
SAMPLING_VALID = {
    "n": st.integers(1, 8), "temperature": st.floats(0, 2), "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, 100), "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.01, 2),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "seed": st.none() | st.integers(SEED_MIN, SEED_MAX), "max_tokens": st.none() | st.integers(1, 64),
    "min_tokens": st.integers(0, 8), "stop": st.none() | st.text(min_size=1) | st.lists(st.text(min_size=1)),
    "stop_token_ids": st.none() | st.lists(st.integers(0, 100)), "ignore_eos": st.booleans(),
    "logprobs": _COUNT, "prompt_logprobs": _COUNT, "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "logit_bias": st.none() | st.dictionaries(st.integers(0, 1000), st.floats(-100, 100), max_size=4),
    "structured_outputs": st.none() | st.sampled_from([{"regex": "[a-z]+"}, {"choice": ["a", "b"]}, {"json_object": True},
                                                       {"json": {"type": "object"}}, {"grammar": 'root ::= "x"'}]),
}
_SIZE = st.integers(1, 4096)
_SPEC = st.fixed_dictionaries(
    {"num_speculative_tokens": st.integers(1, 16)},
    optional={"method": st.sampled_from(["ngram", "prompt_lookup"]), "prompt_lookup_max": st.integers(4, 64),
              "prompt_lookup_min": st.integers(1, 4), "disable_by_batch_size": st.integers(1, 1024)})
ENGINE_VALID = {
    "model": st.none() | st.sampled_from(["/models/m", Path("relative/dir")]),
    "dtype": st.sampled_from(["auto", "bfloat16", "float16", "float32", "half", "float"]),
    "device": st.sampled_from(["auto", "cpu", "cuda"]) | st.integers(0, 15).map(lambda i: f"cuda:{i}"),
    "seed": st.integers(SEED_MIN, SEED_MAX), "block_size": _SIZE, "max_num_seqs": _SIZE,
    "max_num_batched_tokens": st.none() | _SIZE, "max_model_len": st.none() | _SIZE, "num_kv_blocks": st.none() | _SIZE,
    "gpu_memory_utilization": st.floats(0, 1, exclude_min=True), "cpu_kv_cache_gib": st.floats(1e-3, 64),
    "enable_prefix_caching": st.booleans(), "static_batching": st.booleans(), "enforce_eager": st.booleans(),
    "async_scheduling": st.booleans(), "random_weights": st.booleans(),
    "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
    "kv_cache_dtype": st.sampled_from(["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"]),
    "speculative_config": st.none() | _SPEC | _SPEC.map(json.dumps),
    "quantization": st.none() | st.just("q8_0"),
    "tensor_parallel_size": _SIZE,
    "grammar_compile_workers": st.integers(1, 64), "grammar_cache_bytes": st.integers(0, 2**40),
    "max_structured_output_bytes": st.integers(1, 2**30), "max_logprobs": st.integers(-1, 2**20),
}


@st.composite
def _kwargs(draw: st.DrawFn, valid: dict[str, st.SearchStrategy]) -> dict:
    """Some fields valid, then up to two of them anything at all."""
    kwargs = draw(st.fixed_dictionaries({}, optional=valid))
    for name in draw(st.lists(st.sampled_from(sorted(valid)), max_size=2, unique=True)):
        kwargs[name] = draw(_anything())
    return kwargs


def _is_int(value: object, lo: int | None = None, hi: int | None = None) -> bool:
    return type(value) is int and (lo is None or value >= lo) and (hi is None or value <= hi)


def _is_float(value: object, lo: float, hi: float = math.inf, lo_open: bool = False) -> bool:
    return (type(value) is float and math.isfinite(value) and (value > lo if lo_open else value >= lo)
            and value <= hi)


def _is_stop_text(value: object) -> bool:
    return isinstance(value, str) and bool(value) and invalid_unicode_at(value) is None


def _check_sampling_invariants(p: SamplingParams) -> None:
    assert _is_int(p.n, 1, MAX_N)
    assert _is_float(p.temperature, 0)
    assert _is_float(p.top_p, 0, 1, lo_open=True)
    assert _is_int(p.top_k, -1)
    assert _is_float(p.min_p, 0, 1)
    assert _is_float(p.repetition_penalty, 0, lo_open=True)
    assert _is_float(p.presence_penalty, -2, 2) and _is_float(p.frequency_penalty, -2, 2)
    assert p.seed is None or _is_int(p.seed, SEED_MIN, SEED_MAX)
    assert p.max_tokens is None or _is_int(p.max_tokens, 1)
    assert _is_int(p.min_tokens, 0, p.max_tokens)
    assert p.stop is None or _is_stop_text(p.stop) or (
        type(p.stop) is list and all(_is_stop_text(s) for s in p.stop))
    assert type(p.stop_strings) is list and all(_is_stop_text(s) for s in p.stop_strings)
    assert type(p.stop_token_ids) is list and all(_is_int(t, 0) for t in p.stop_token_ids)
    assert all(type(v) is bool for v in (p.ignore_eos, p.skip_special_tokens, p.include_stop_str_in_output))
    assert p.logprobs is None or _is_int(p.logprobs, -1)
    assert p.prompt_logprobs is None or _is_int(p.prompt_logprobs, -1)
    assert p.logit_bias is None or (type(p.logit_bias) is dict and all(
        _is_int(t, 0) and _is_float(v, -100, 100) for t, v in p.logit_bias.items()))
    so = p.structured_outputs
    assert so is None or (isinstance(so, StructuredOutputsParams) and sum(
        x is not None for x in (so.json, so.regex, so.choice, so.grammar)) + (so.json_object is True) == 1)


@settings(max_examples=400, deadline=None)
@given(_kwargs(SAMPLING_VALID))
def test_fuzz_sampling_params_is_valid_or_a_value_error(kwargs: dict) -> None:
    try:
        params = SamplingParams(**kwargs)
    except ValueError as exc:
        assert str(exc).split(" ")[0] in kwargs, exc
        assert " must be " in str(exc)
        return
    _check_sampling_invariants(params)


@settings(max_examples=400, deadline=None)
@given(_kwargs(SAMPLING_VALID), st.sampled_from(SAMPLING_FIELDS), _anything())
def test_fuzz_an_assignment_keeps_sampling_params_valid(kwargs: dict, field: str, value: object) -> None:
    try:
        params = SamplingParams(**kwargs)
    except ValueError:
        return
    before = {name: getattr(params, name) for name in SAMPLING_FIELDS}
    try:
        setattr(params, field, value)
    except ValueError as exc:
        assert str(exc).split(" ")[0] == field and " must be " in str(exc), exc
        assert {name: getattr(params, name) for name in SAMPLING_FIELDS} == before
    _check_sampling_invariants(params)


def _check_engine_invariants(c: EngineConfig) -> None:
    assert c.model is None or (type(c.model) is str and c.model)
    assert c.dtype in ("auto", "bfloat16", "float16", "float32")
    assert c.device in ("auto", "cpu", "cuda") or (c.device.startswith("cuda:") and c.device[5:].isdigit())
    assert _is_int(c.seed, SEED_MIN, SEED_MAX)
    assert all(_is_int(v, 1) for v in (c.block_size, c.max_num_seqs, c.tensor_parallel_size))
    assert all(v is None or _is_int(v, 1) for v in (c.max_model_len, c.max_num_batched_tokens))
    assert c.num_kv_blocks is None or _is_int(c.num_kv_blocks, 1)
    assert _is_float(c.gpu_memory_utilization, 0, 1, lo_open=True)
    assert _is_float(c.cpu_kv_cache_gib, 0, lo_open=True)
    assert c.scheduling_policy in ("fcfs", "priority")
    assert c.kv_cache_dtype in ("auto", "fp8_e4m3", "fp8_e5m2", "int8")
    assert all(type(v) is bool for v in (c.enable_prefix_caching, c.static_batching, c.enforce_eager,
                                         c.async_scheduling, c.random_weights))
    assert c.quantization in (None, "q8_0")
    assert _is_int(c.grammar_compile_workers, 1, 64) and _is_int(c.grammar_cache_bytes, 0)
    assert _is_int(c.max_structured_output_bytes, 1) and _is_int(c.max_logprobs, -1)
    spec = c.speculative_config
    assert spec is None or (isinstance(spec, SpeculativeConfig) and spec.method == "ngram"
                            and _is_int(spec.num_speculative_tokens, 1, 16) and _is_int(spec.disable_by_batch_size, 1)
                            and 1 <= spec.prompt_lookup_min <= spec.prompt_lookup_max <= 64)


@settings(max_examples=400, deadline=None)
@given(_kwargs(ENGINE_VALID))
def test_fuzz_engine_config_is_valid_or_a_value_error(kwargs: dict) -> None:
    try:
        config = EngineConfig(**kwargs)
    except ValueError as exc:
        assert str(exc).split(" ")[0].rstrip(":") in kwargs, exc
        return
    _check_engine_invariants(config)


_NAMES = st.one_of(st.sampled_from(ENGINE_FIELDS), st.from_regex(r"[a-z_]{1,12}", fullmatch=True))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_NAMES.filter(lambda name: name != "model"), st.integers(0, 64), max_size=3))
def test_fuzz_from_options_lists_unknown_names(options: dict) -> None:
    unknown = set(options) - set(ENGINE_FIELDS)
    try:
        config = EngineConfig.from_options(None, **options)
    except ValueError as exc:
        if unknown:
            assert str(exc).startswith("unknown engine option") and all(name in str(exc) for name in unknown)
        else:
            assert str(exc).split(" ")[0] in options, exc
        return
    assert not unknown
    _check_engine_invariants(config)


def test_the_fuzzers_cover_every_field() -> None:
    assert set(SAMPLING_VALID) == set(SAMPLING_FIELDS) and set(ENGINE_VALID) == set(ENGINE_FIELDS)
