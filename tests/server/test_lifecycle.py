"""Admission and failure paths: API keys, a full queue, draining, a failing engine step,
and SIGTERM on a real ``tokenmill serve`` process."""

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
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import openai
import pytest

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.openai.server import build_app

from .conftest import MODEL_NAME, LiveServer

BODY = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}


def with_app(async_engine: AsyncEngine, test: Callable[[httpx.AsyncClient], Awaitable[None]],
             api_key: str | None = None, close: bool = True) -> None:
    """Run ``test`` against a fresh app over ``async_engine`` in memory (no socket)."""
    app = build_app(async_engine, MODEL_NAME, api_key=api_key)

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            await asyncio.wait_for(test(client), timeout=60)

    try:
        asyncio.run(run())
    finally:
        if close:
            async_engine.close()


def test_api_key(server: LiveServer) -> None:
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

    # The shared engine stays open: the live server still uses it.
    with_app(server.async_engine, test, api_key="s3cret", close=False)


def test_full_queue_is_503(spare_engine: LLMEngine) -> None:
    async def test(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", json=BODY)
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable"
        assert (await client.get("/health")).status_code == 200

    with_app(AsyncEngine(spare_engine, max_waiting=0), test)


def test_draining_refuses_new_requests(spare_engine: LLMEngine) -> None:
    async_engine = AsyncEngine(spare_engine)

    async def test(client: httpx.AsyncClient) -> None:
        running = asyncio.create_task(
            client.post("/v1/completions", json={**BODY, "max_tokens": 40, "ignore_eos": True}))
        for _ in range(200):
            if async_engine.snapshot.num_running:
                break
            await asyncio.sleep(0.01)
        async_engine.stop_admitting()
        refused = await client.post("/v1/completions", json=BODY)
        assert refused.status_code == 503
        assert (await client.get("/health")).status_code == 503
        finished = await running
        assert finished.status_code == 200
        assert finished.json()["choices"][0]["finish_reason"] == "length"
        assert finished.json()["usage"]["completion_tokens"] == 40

    with_app(async_engine, test)


def test_failed_step_fails_requests_and_keeps_serving(spare_engine: LLMEngine,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real_step = spare_engine.step
    failures = iter([True, True])

    def flaky_step() -> list:
        if next(failures, False):
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(spare_engine, "step", flaky_step)

    async def test(client: httpx.AsyncClient) -> None:
        whole = await client.post("/v1/completions", json=BODY)
        assert whole.status_code == 500
        assert whole.json()["error"]["code"] == "engine_error"
        async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as streamed:
            assert streamed.status_code == 200
            events = [line async for line in streamed.aiter_lines() if line.startswith("data: ")]
        assert json.loads(events[-2][6:])["error"]["code"] == "engine_error"
        assert events[-1] == "data: [DONE]"
        ok = await client.post("/v1/completions", json=BODY)
        assert ok.status_code == 200, ok.text

    with_app(AsyncEngine(spare_engine), test)
    assert spare_engine.requests == {} and spare_engine.kv.num_blocks_in_use == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_lets_running_requests_finish(model_dir: Path) -> None:
    port = _free_port()
    command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--model", str(model_dir),
               "--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
               "--port", str(port), "--served-model-name", MODEL_NAME, "--grace-period", "20",
               "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {**BODY, "max_tokens": 200, "ignore_eos": True, "stream": True, "logprobs": 0}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        try:  # a new request is refused: 503 while draining, or no listener any more
            assert httpx.post(f"{base}/v1/completions", json=BODY, timeout=10).status_code == 503
        except httpx.TransportError:
            pass
        reader.join(60)
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == 200
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
