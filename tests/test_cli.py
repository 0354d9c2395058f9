"""The ``tokenmill`` command line, parsed only: no engine is built and no server started
(a fake engine stands in where a command must run)."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import types

import pytest

from tokenmill.engine.config import EngineConfig, add_engine_args, engine_config_from_args
from tokenmill.entrypoints import cli


@pytest.fixture
def server_stub(monkeypatch) -> None:
    """``serve`` parsing without the real server module (FastAPI, and its own tests)."""
    module = types.ModuleType("tokenmill.entrypoints.openai.server")

    def add_serve_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument_group("server").add_argument("--port", type=int, default=8000, help="port")

    module.add_serve_args = add_serve_args
    module.run_server = lambda args: 0
    monkeypatch.setitem(sys.modules, module.__name__, module)


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    return info.value.code


def test_version(capsys) -> None:
    assert _exit_code(["--version"]) == 0
    assert capsys.readouterr().out == f"tokenmill {importlib.metadata.version('tokenmill')}\n"


@pytest.mark.parametrize("argv, level", [
    (["generate", "p"], "warning"),
    (["--log-level", "info", "generate", "p"], "info"),
    (["generate", "p", "--log-level", "DEBUG"], "debug"),
    (["--log-level", "info", "generate", "p", "--log-level", "Error"], "error"),
    (["chat", "--log-level", "critical"], "critical"),
    (["bench", "latency", "--log-level", "info"], "info"),
])
def test_log_level_before_or_after_the_command(argv: list[str], level: str) -> None:
    assert cli.parse_args(argv).log_level == level


@pytest.mark.parametrize("argv", [["generate", "p", "--log-level", "loud"], ["--log-level", "loud", "chat"]])
def test_bad_log_level_is_a_usage_error(capsys, argv: list[str]) -> None:
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert "--log-level" in err and "'loud'" in err and "debug, info, warning, error, critical" in err


@pytest.mark.parametrize("argv, model", [
    (["serve"], None), (["serve", "/models/m"], "/models/m"), (["serve", "--model", "/models/m"], "/models/m"),
    (["serve", "/models/m", "--port", "9000"], "/models/m"), (["serve", "/models/m", "--model", "/models/m"], "/models/m"),
])
def test_serve_takes_the_model_as_positional_or_option(server_stub, argv: list[str], model: str | None) -> None:
    args = cli.parse_args(argv)
    assert args.model == model and engine_config_from_args(args).model == model


def test_serve_with_two_different_models_is_an_error(server_stub, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["serve", "/models/a", "--model", "/models/b"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "'/models/a'" in err and "'/models/b'" in err


def test_help_shows_defaults(server_stub, capsys) -> None:
    assert _exit_code(["generate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # undo the line wrapping
    assert "--max-num-seqs MAX_NUM_SEQS most sequences decoded together in one step (default: 256)" in out
    assert "(default: 0.7)" in out and "8192 on a GPU of 70 GiB or more, else 2048 (default: None)" in out
    assert "--no-prefix-caching" in out and "--no-enable-prefix-caching" in out
    assert _exit_code(["serve", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "[MODEL]" in out and "--port PORT port (default: 8000)" in out and "--block-size BLOCK_SIZE tokens per KV cache block (default: 16)" in out


@pytest.mark.parametrize("populate", [cli._generate_args, cli._chat_args])
def test_every_option_says_what_it_does(populate) -> None:
    parser = argparse.ArgumentParser()
    populate(parser)
    assert all(action.help for action in parser._actions)


def test_engine_options_come_from_the_config_fields() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig()
    args = parser.parse_args(["--model", "/m", "--dtype", "half", "--max-model-len", "512", "--no-prefix-caching",
                              "--no-async-scheduling", "--enforce-eager", "--gpu-memory-utilization", "0.5",
                              "--seed", "7", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_config_from_args(args) == EngineConfig(
        model="/m", dtype="float16", max_model_len=512, enable_prefix_caching=False, async_scheduling=False,
        enforce_eager=True, gpu_memory_utilization=0.5, seed=7,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert not engine_config_from_args(parser.parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching
    assert "--random-weights" not in parser.format_help()


def test_the_engine_seed_is_the_sampling_seed() -> None:
    args = cli.parse_args(["generate", "p", "--seed", "5"])
    assert engine_config_from_args(args).seed == 5 and cli._sampling_params(args).seed == 5


class _RefusingEngine:
    """Loads nothing; refuses every prompt, as the real engine refuses one too long."""

    def __init__(self, config: EngineConfig) -> None:
        self.tokenizer = None

    def add_request(self, request_id: str, prompt: object, params: object) -> None:
        raise ValueError("the prompt is longer than max_model_len")


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--temperature", "nan"], "temperature must be a finite number"),
    (["generate", "hi", "--top-k", "-3"], "top_k must be in [-1, 2**63 - 1]"),
    (["generate", "hi", "--max-model-len", "0"], "max_model_len must be >= 1"),
    (["generate", "hi", "--device", "gpu"], "device must be"),
    (["generate", "hi", "--speculative-config", '{"method": "ngram"}'], "speculative_config needs num_speculative_tokens"),
    (["generate", "hi", "--speculative-config", "{4"], "speculative_config is not valid JSON"),
    (["generate", ""], "the prompt is empty"),
    (["generate", "hi"], "longer than max_model_len"),  # refused by the engine: still before any output
])
def test_generate_fails_before_printing(monkeypatch, capsys, argv: list[str], message: str) -> None:
    monkeypatch.setattr(cli, "LLMEngine", _RefusingEngine)
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("tokenmill: error: ") and message in err and "Traceback" not in err


def test_generate_bad_option_type_is_a_usage_error(capsys) -> None:
    assert _exit_code(["generate", "hi", "--max-tokens", "x"]) == 2
    assert capsys.readouterr().out == ""


def test_cli_imports_neither_the_server_nor_the_load_generator() -> None:
    """With FastAPI and uvicorn unimportable, generate and an engine benchmark still parse."""
    code = """
import sys
sys.modules["fastapi"] = sys.modules["uvicorn"] = None  # import fails
import tokenmill.entrypoints.cli as cli
loaded = set(sys.modules)
cli.parse_args(["generate", "hello"])
cli.parse_args(["bench", "latency"])
print(sorted(m for m in loaded if m.startswith(("tokenmill.bench", "tokenmill.entrypoints.openai"))))
print(sorted(m for m in sys.modules if m.startswith(("tokenmill.bench.serve", "tokenmill.entrypoints.openai"))))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "[]"]


def test_bench_shapes_and_kv_dtypes_are_checked_when_parsed() -> None:
    import argparse

    from tokenmill.bench.offline import add_bench_args

    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    assert parser.parse_args(["--throughput-shapes", "qwen3-0.6b, llama3-8b"]).throughput_shapes == ["qwen3-0.6b",
                                                                                                      "llama3-8b"]
    assert parser.parse_args([]).shapes is None  # each benchmark its own default
    assert parser.parse_args(["--shapes", "gemma3-4b"]).shapes == ["gemma3-4b"]
    for bad in ("qwen3-0.6b,nope", "", ","):
        with pytest.raises(SystemExit):
            parser.parse_args(["--throughput-shapes", bad])
        with pytest.raises(SystemExit):
            parser.parse_args(["--shapes", bad])
    assert parser.parse_args([]).kv_cache_dtypes == ("auto", "fp8", "int8")
    assert parser.parse_args(["--kv-cache-dtypes", "auto, int8"]).kv_cache_dtypes == ("auto", "int8")
    for bad in ("auto,int4", "", ","):
        with pytest.raises(SystemExit):
            parser.parse_args(["--kv-cache-dtypes", bad])


@pytest.mark.parametrize("value, said", [("{bad", "not valid JSON"), ("[1]", "must be a JSON object")])
def test_default_chat_template_kwargs_must_be_a_json_object(capsys, value: str, said: str) -> None:
    assert _exit_code(["serve", "--default-chat-template-kwargs", value]) == 2
    err = capsys.readouterr().err
    assert "--default-chat-template-kwargs" in err and said in err and repr(value) in err


def test_reasoning_options_reach_the_server() -> None:
    from tokenmill.entrypoints.openai.server import serving_options_from_args

    args = cli.parse_args(["serve", "/m", "--reasoning-parser", "deepseek_r1",
                           "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    options = serving_options_from_args(args)
    assert options.reasoning_parser == "deepseek_r1" and options.default_chat_template_kwargs == {
        "enable_thinking": False}
    assert serving_options_from_args(cli.parse_args(["serve"])).reasoning_parser is None
    assert _exit_code(["serve", "--reasoning-parser", "granite"]) == 2
