"""Admission and failure paths: API keys, a full queue, draining, a failing engine step,
a core process that dies, and SIGTERM on a real ``tokenmill serve`` process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from tokenmill.engine.frontend import async_llm
from tokenmill.engine.frontend.async_llm import AsyncLLM, EngineStepError
from tokenmill.sampling_params import SamplingParams

from .conftest import MAX_MODEL_LEN, MODEL_NAME, LiveServer, small_engine_config, with_app

BODY = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}


def test_api_key(engine_in_thread: AsyncLLM) -> None:
    async def test(raw: httpx.AsyncClient) -> None:
        wrong = openai.AsyncOpenAI(base_url="http://test/v1", api_key="wrong", max_retries=0, http_client=raw)
        with pytest.raises(openai.AuthenticationError) as info:
            await wrong.completions.create(**BODY)
        assert info.value.status_code == 401
        assert info.value.body["code"] == "invalid_api_key"
        missing = await raw.post("/v1/completions", json=BODY)
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        bad_json = await raw.post("/v1/completions", content="{oops", headers={"Authorization": "Bearer no"})
        assert bad_json.status_code == 401
        assert (await raw.get("/health")).status_code == 200
        good = openai.AsyncOpenAI(base_url="http://test/v1", api_key="s3cret", max_retries=0, http_client=raw)
        out = await good.completions.create(**BODY)
        assert len(out.choices) == 1

    with_app(engine_in_thread, test, api_key="s3cret")


def test_queue_limit(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """``max_waiting`` counts requests beyond those that can run: with 0, an idle server still
    serves; more prompts in one request than could ever be queued is a 400, not a 503 forever;
    a full engine answers 503 and serves again once the running requests end."""
    monkeypatch.setattr(server.engine, "max_waiting", 0)
    slots = server.engine.config.max_num_seqs
    base = server.base_url
    assert httpx.post(f"{base}/v1/completions", json=BODY, timeout=30).status_code == 200
    too_many = httpx.post(f"{base}/v1/completions", json={**BODY, "prompt": [[1, 2]] * (slots + 1)}, timeout=30)
    assert too_many.status_code == 400 and "at most" in too_many.json()["error"]["message"]
    long = {**BODY, "prompt": [[1, 2, 3]] * slots, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=long, timeout=60) as filling:
        assert filling.status_code == 200
        full = httpx.post(f"{base}/v1/completions", json=BODY, timeout=30)
        assert full.status_code == 503
        assert full.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
        events = [line for line in filling.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert httpx.post(f"{base}/v1/completions", json=BODY, timeout=30).status_code == 200


def test_draining_refuses_new_requests(engine_in_thread: AsyncLLM) -> None:
    engine = engine_in_thread

    async def test(client: httpx.AsyncClient) -> None:
        running = asyncio.create_task(
            client.post("/v1/completions", json={**BODY, "max_tokens": 40, "ignore_eos": True}))
        for _ in range(200):
            if engine.num_unfinished:
                break
            await asyncio.sleep(0.01)
        engine.stop_admitting()
        refused = await client.post("/v1/completions", json=BODY)
        assert refused.status_code == 503
        assert (await client.get("/health")).status_code == 503
        finished = await running
        assert finished.status_code == 200
        assert finished.json()["choices"][0]["finish_reason"] == "length"
        assert finished.json()["usage"]["completion_tokens"] == 40

    with_app(engine, test)


def test_failed_step_fails_only_its_requests_and_keeps_serving(engine_in_thread: AsyncLLM,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    core = engine_in_thread.client.core
    real_launch = core.runner.launch
    failures = iter([True, True])

    def flaky_launch(*args: object) -> object:
        if next(failures, False):
            raise RuntimeError("injected failure")
        return real_launch(*args)

    monkeypatch.setattr(core.runner, "launch", flaky_launch)

    async def test(client: httpx.AsyncClient) -> None:
        whole = await client.post("/v1/completions", json=BODY)
        assert whole.status_code == 500
        assert whole.json()["error"]["code"] == "engine_error"
        assert "injected failure" in whole.json()["error"]["message"]
        async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as streamed:
            assert streamed.status_code == 200
            events = [line async for line in streamed.aiter_lines() if line.startswith("data: ")]
        assert json.loads(events[-2][6:])["error"]["code"] == "engine_error"
        assert events[-1] == "data: [DONE]"
        ok = await client.post("/v1/completions", json=BODY)
        assert ok.status_code == 200, ok.text
        assert "tokenmill:num_failed_steps_total 2.0" in (await client.get("/metrics")).text

    with_app(engine_in_thread, test)
    assert core.requests == {} and core.kv.num_blocks_in_use == 0
    assert core.stats.num_failed_steps == 2


# ------------------------------------------------------- a real server process
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve_process(model_dir: Path, *options: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """``tokenmill serve`` in a child process, up and healthy; killed if the test leaves it."""
    port = _free_port()
    command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", str(model_dir),
               "--device", "cpu", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
               "--num-kv-blocks", "64", "--port", str(port), "--served-model-name", MODEL_NAME,
               "--uvicorn-log-level", "warning", *options]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


class StreamReader(threading.Thread):
    """Reads one streamed completion in the background, keeping its data lines."""

    def __init__(self, base: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.base, self.body = base, body
        self.events: list[str] = []
        self.started = threading.Event()

    def run(self) -> None:
        with httpx.stream("POST", f"{self.base}/v1/completions", json=self.body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line)
                    self.started.set()

    def chunks(self) -> list[dict]:
        return [json.loads(e[6:]) for e in self.events if e != "data: [DONE]"]


def _core_pid(server_pid: int) -> int:
    """The engine core: the server's child that multiprocessing spawned."""
    for pid in Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return int(pid)
    raise AssertionError("the server has no engine core process")


LONG = {**BODY, "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "stream": True, "logprobs": 0}


def test_ctrl_c_lets_running_requests_finish(model_dir: Path) -> None:
    """A terminal's Ctrl-C reaches the whole process group, the engine core too: the core
    leaves its lifetime to the server, which drains."""
    with serve_process(model_dir, "--grace-period", "30") as (proc, base):
        reader = StreamReader(base, LONG)
        reader.start()
        assert reader.started.wait(30)
        os.killpg(proc.pid, signal.SIGINT)
        try:  # a new request is refused: 503 while draining, or no listener any more
            assert httpx.post(f"{base}/v1/completions", json=BODY, timeout=10).status_code == 503
        except httpx.TransportError:
            pass
        reader.join(60)
        assert proc.wait(60) in (0, 130, -signal.SIGINT)  # uvicorn re-raises the signal once drained
        assert "died" not in proc.stdout.read().decode()
        assert reader.events[-1] == "data: [DONE]"
        chunks = reader.chunks()
        assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == LONG["max_tokens"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_sigterm_after_the_grace_period_ends_streams_with_abort(model_dir: Path) -> None:
    """SIGTERM to the whole process group (as a service manager sends it)."""
    with serve_process(model_dir, "--grace-period", "0.2") as (proc, base):
        readers = [StreamReader(base, LONG) for _ in range(3)]
        for reader in readers:
            reader.start()
        assert all(reader.started.wait(30) for reader in readers)
        os.killpg(proc.pid, signal.SIGTERM)
        for reader in readers:
            reader.join(60)
        assert proc.wait(60) in (0, -signal.SIGTERM)
        output = proc.stdout.read().decode()
        assert "CancelledError" not in output and "Traceback" not in output and "died" not in output, output
        for reader in readers:
            assert reader.events[-1] == "data: [DONE]"
            chunks = reader.chunks()
            assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
            assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) < LONG["max_tokens"]


def test_dead_core_fails_requests_and_health(model_dir: Path) -> None:
    """Killing the engine core mid-stream: the stream ends with an error event and [DONE],
    ``/health`` turns 503, new requests get 503 at once; nothing hangs."""
    with serve_process(model_dir, "--grace-period", "1") as (proc, base):
        reader = StreamReader(base, LONG)
        reader.start()
        assert reader.started.wait(30)
        os.kill(_core_pid(proc.pid), signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive()
        assert reader.events[-1] == "data: [DONE]"
        error = json.loads(reader.events[-2][6:])["error"]
        assert error["code"] == "engine_error" and "died" in error["message"]
        health = httpx.get(f"{base}/health", timeout=10)
        assert health.status_code == 503 and "died" in health.json()["error"]["message"]
        refused = httpx.post(f"{base}/v1/completions", json=BODY, timeout=10)
        assert refused.status_code == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)


def test_a_core_that_dies_before_any_request_turns_health_503(model_dir: Path) -> None:
    engine = AsyncLLM(small_engine_config(model_dir))
    try:
        engine.client.process.kill()
        engine.client.process.join(10)

        async def test(client: httpx.AsyncClient) -> None:
            health = await client.get("/health")
            assert health.status_code == 503 and "died" in health.json()["error"]["message"]
            assert (await client.post("/v1/completions", json=BODY)).status_code == 503

        with_app(engine, test)
    finally:
        engine.close()


def test_a_killed_core_is_reported_by_its_signal_and_reaped(model_dir: Path) -> None:
    """The core killed mid-request: the request's error and the engine's reason name the signal (the
    event loop hears of the death from the process's sentinel, which may be readable before the
    kernel lets the exit status be read), and the dead process is reaped, not left a zombie."""
    engine = AsyncLLM(small_engine_config(model_dir))
    process = engine.client.process
    try:
        async def kill_mid_request() -> str:
            stream = await engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
            os.kill(process.pid, signal.SIGKILL)
            with pytest.raises(EngineStepError) as info:
                async for _ in stream:
                    pass
            return str(info.value)

        error = asyncio.run(asyncio.wait_for(kill_mid_request(), timeout=60))
        reason = "the engine core process died (killed by signal SIGKILL (9))"
        assert error == engine.dead_reason == reason
        with pytest.raises(ChildProcessError):  # already reaped: nothing is left to wait for
            os.waitpid(process.pid, os.WNOHANG)
        assert not engine.core_alive()
    finally:
        engine.close()


def test_a_tokenizer_that_fails_while_the_core_starts_stops_the_core(model_dir: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The front end loads its tokenizer while the core process starts; when that load fails, the
    caller gets its error and the core process is gone, not left running."""
    for name in model_dir.iterdir():
        (tmp_path / name.name).write_bytes(name.read_bytes())
    (tmp_path / "tokenizer.json").write_text("{ not json")
    real, started = async_llm.CoreClient, []

    def recording(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(async_llm, "CoreClient", recording)
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        AsyncLLM(small_engine_config(tmp_path))
    assert started and not started[0].process.is_alive()


def test_a_core_process_with_speculative_decoding_serves_the_same_text(server: LiveServer, model_dir: Path) -> None:
    """The core in its own process, with prompt lookup on: a greedy completion equals the plain
    server's, and /metrics counts the drafts under tokenmill:'s and vLLM's names."""
    import dataclasses

    body = {"model": MODEL_NAME, "prompt": "a b c d a b c d a b c", "max_tokens": 24, "temperature": 0}
    expected = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    config = dataclasses.replace(small_engine_config(model_dir),
                                 speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    engine = AsyncLLM(config)
    try:
        async def test(client: httpx.AsyncClient) -> None:
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected
            metrics = (await client.get("/metrics")).text
            drafts = [line for line in metrics.splitlines() if line.startswith("tokenmill:spec_decode_num_drafts")]
            assert drafts and float(drafts[0].split()[-1]) > 0
            assert "vllm:spec_decode_num_accepted_tokens" in metrics

        with_app(engine, test, vllm_metrics=True)
    finally:
        engine.close()
