"""``tokenmill bench serve`` against the live server, and the CLI wiring of serve/bench args."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tokenmill.bench.serve import add_bench_serve_args, run_serve_bench
from tokenmill.entrypoints.openai.server import add_serve_args

from .conftest import LiveServer


def test_bench_serve_prints_its_table(server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args([
        "--base-url", server.base_url, "--num-prompts", "12", "--min-input-len", "4", "--max-input-len", "24",
        "--min-output-len", "4", "--max-output-len", "10", "--vocab-size", str(server.engine.model_config.vocab_size),
        "--request-rate", "100", "--max-concurrency", "6", "--out", str(out)])
    assert run_serve_bench(args) == 0
    table = capsys.readouterr().out
    for row in ("Successful requests", "Output token throughput (tok/s)", "Median TTFT (ms)", "P99 ITL (ms)",
                "Mean TPOT (ms)", "Mean E2E latency (ms)"):
        assert row in table
    summary = json.loads(out.read_text())
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert 12 * 4 <= summary["total_output_tokens"] <= 12 * 10
    assert summary["ttft"]["p99_ms"] >= summary["ttft"]["median_ms"] > 0


def test_prompt_file_workload(server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n\nHello there\nimport os\n")
    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    args = parser.parse_args(["--base-url", server.base_url, "--prompt-file", str(prompts), "--num-prompts", "5",
                              "--min-output-len", "3", "--max-output-len", "3"])
    assert run_serve_bench(args) == 0
    assert "Total output tokens" in capsys.readouterr().out


def test_serve_args() -> None:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--api-key", "k", "--max-waiting", "7"])
    assert (args.host, args.port, args.api_key, args.max_waiting) == ("127.0.0.1", 8000, "k", 7)
