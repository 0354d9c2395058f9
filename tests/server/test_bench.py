"""``tokenmill bench serve`` against the live server and the stub server, its one-line
errors, its partial result on Ctrl-C, and the CLI wiring of serve/bench args."""

from __future__ import annotations

import argparse
import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tokenmill.bench import serve
from tokenmill.bench.serve import SSEStream, add_bench_serve_args, build_workload, run_serve_bench
from tokenmill.bench.stub_server import run_stub_server
from tokenmill.entrypoints.cli import main
from tokenmill.entrypoints.openai.server import add_serve_args

from .conftest import LiveServer

VOCAB = "300"  # below any test model's vocabulary


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    """The stub server in a child process: answers any workload instantly."""
    with run_stub_server() as base_url:
        yield base_url


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    return parser.parse_args(["--no-progress", "--vocab-size", VOCAB, *argv])


def test_bench_serve_prints_its_table(server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "bench.json"
    args = bench_args("--base-url", server.base_url, "--num-prompts", "12", "--min-input-len", "4",
                      "--max-input-len", "24", "--min-output-len", "4", "--max-output-len", "10",
                      "--request-rate", "100", "--max-concurrency", "6", "--out", str(out))
    assert run_serve_bench(args) == 0
    table = capsys.readouterr().out
    for row in ("Successful requests", "Output token throughput (tok/s)", "Median TTFT (ms)", "P99 ITL (ms)",
                "Mean TPOT (ms)", "Mean E2E latency (ms)"):
        assert row in table
    summary = json.loads(out.read_text())
    assert summary["completed"] == 12 and summary["failed"] == 0 and not summary["partial"]
    assert 12 * 4 <= summary["total_output_tokens"] <= 12 * 10
    assert summary["ttft"]["p99_ms"] >= summary["ttft"]["median_ms"] > 0


def test_prompt_file_workload(server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n\nHello there\nimport os\n")
    args = bench_args("--base-url", server.base_url, "--prompt-file", str(prompts), "--num-prompts", "5",
                      "--min-output-len", "3", "--max-output-len", "3")
    assert run_serve_bench(args) == 0
    assert "Total output tokens" in capsys.readouterr().out


def test_stub_answers_the_workload_exactly(stub_url: str, tmp_path: Path) -> None:
    out = tmp_path / "stub.json"
    args = bench_args("--base-url", stub_url, "--num-prompts", "40", "--min-input-len", "5", "--max-input-len", "50",
                      "--min-output-len", "1", "--max-output-len", "200", "--max-concurrency", "8",
                      "--out", str(out))
    assert run_serve_bench(args) == 0
    workload = build_workload(args)
    summary = json.loads(out.read_text())
    assert (summary["completed"], summary["failed"]) == (40, 0)
    assert summary["total_output_tokens"] == sum(req.max_tokens for req in workload)
    assert summary["total_input_tokens"] == sum(len(req.prompt) for req in workload)


def test_stub_answers_without_streaming(stub_url: str) -> None:
    body = httpx.post(f"{stub_url}/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}).json()
    assert body["choices"][0]["text"] == " tok" * 4 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_stub_mode_says_it_is_the_stub(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "stub.json"
    args = bench_args("--stub", "--num-prompts", "8", "--min-input-len", "2", "--max-input-len", "4",
                      "--min-output-len", "5", "--max-output-len", "5", "--out", str(out))
    assert run_serve_bench(args) == 0
    assert "stub at http://127.0.0.1:" in capsys.readouterr().out
    summary = json.loads(out.read_text())
    assert summary["stub"] and summary["total_output_tokens"] == 40


def test_stream_without_usage_counts_text_chunks() -> None:
    """Events split across reads anywhere, ``data:`` with or without a space, CRLF lines."""
    chunk = b'{"choices":[{"index":0,"text":"%s","finish_reason":null}]}'
    body = (b"data: " + chunk % b"a" + b"\r\n\r\n" + b"data:" + chunk % b"b" + b"\n\n"
            + b": keep-alive\n\n" + b"data: " + chunk % b"" + b"\n\n" + b"data: [DONE]\n\n")
    stream = SSEStream(start=10.0)
    for i, at in zip(range(0, len(body), 7), range(11, 10_000)):
        stream.feed(body[i:i + 7], float(at))
    result = stream.result(end=999.0)
    assert result.ok and result.output_tokens == 2 and result.prompt_tokens == 0
    assert result.ttft > 0 and len(result.itls) == 2 and result.latency < 989


def test_base_url_ending_in_v1_is_one_line(stub_url: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "serve", "--base-url", f"{stub_url}/v1/", "--num-prompts", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "drop the /v1" in captured.err
    assert "Traceback" not in captured.out + captured.err


def test_refused_connection_is_one_line(capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens on it once closed
    assert run_serve_bench(bench_args("--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2")) == 1
    captured = capsys.readouterr()
    assert captured.err == f"tokenmill bench serve: cannot connect to http://127.0.0.1:{port}: connection refused\n"
    assert "Traceback" not in captured.out


def test_ctrl_c_prints_partial_results(stub_url: str, tmp_path: Path, capsys: pytest.CaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SIGINT once 5 requests have finished: the rest are cancelled, what finished is reported."""
    record = serve.BenchRun.record

    def record_then_interrupt(run: serve.BenchRun, result: serve.RequestResult) -> None:
        record(run, result)
        if len(run.results) == 5:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(serve.BenchRun, "record", record_then_interrupt)
    out = tmp_path / "partial.json"
    args = bench_args("--base-url", stub_url, "--num-prompts", "64", "--min-input-len", "5", "--max-input-len", "10",
                      "--min-output-len", "200", "--max-output-len", "400", "--max-concurrency", "4",
                      "--out", str(out))
    # Ctrl-C as a terminal delivers it: a test run started in the background by a non-interactive
    # shell inherits SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert run_serve_bench(args) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    captured = capsys.readouterr()
    assert "PARTIAL: interrupted" in captured.out and "Traceback" not in captured.out + captured.err
    summary = json.loads(out.read_text())
    assert summary["partial"] and summary["failed"] == 0
    assert 5 <= summary["completed"] < summary["num_requests"] == 64


def test_serve_args() -> None:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--api-key", "k", "--max-waiting", "7"])
    assert (args.host, args.port, args.api_key, args.max_waiting) == ("127.0.0.1", 8000, "k", 7)
