"""One server for the whole server suite: uvicorn on 127.0.0.1 (a free port picked by the
OS) in a background thread, over a small CPU engine whose core runs in a child process,
as ``tokenmill serve`` runs it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

from tokenmill.engine.frontend.async_llm import AsyncLLM
from tokenmill.engine.config import EngineConfig
from tokenmill.entrypoints.openai.server import build_app
from tokenmill.entrypoints.openai.serving import ServingOptions

from .tiny_model import model_dir_for_tests

MODEL_NAME = "test-model"
MAX_MODEL_LEN = 256


def small_engine_config(model_dir: Path) -> EngineConfig:
    """A small CPU engine: some requests wait (32 slots for up to 74 clients). Whole-vocabulary
    logprobs are allowed, so the server's own limit on logprob entries is what refuses them."""
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=32,
                        max_num_batched_tokens=512, max_model_len=MAX_MODEL_LEN, num_kv_blocks=512, max_logprobs=-1)


SHARED_OPTIONS = ServingOptions(trust_request_chat_template=True)
"""The shared server's: it takes the requests' own chat templates, so their tests can run on it."""


@dataclass
class LiveServer:
    base_url: str
    engine: AsyncLLM
    app: FastAPI

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=60, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_dir_for_tests(tmp_path_factory.mktemp("tiny_model"))


@contextmanager
def live_server(config: EngineConfig, **app_options: Any) -> Iterator[LiveServer]:
    """uvicorn over an engine of ``config`` in a background thread, the app built with any of
    ``build_app``'s options."""
    engine = AsyncLLM(config, max_waiting=512)
    app = build_app(engine, MODEL_NAME, **app_options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.05)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", engine, app)
    finally:
        uv.should_exit = True
        thread.join(30)
        sock.close()
        engine.close()


@pytest.fixture(scope="session")
def server(model_dir: Path) -> Iterator[LiveServer]:
    with live_server(small_engine_config(model_dir), options=SHARED_OPTIONS) as running:
        yield running


@pytest.fixture()
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture()
def engine_in_thread(model_dir: Path) -> Iterator[AsyncLLM]:
    """An engine of a test's own whose core runs in a thread, so the test can reach into it."""
    engine = AsyncLLM(small_engine_config(model_dir), core_in_thread=True)
    yield engine
    engine.close()


def with_app(engine: AsyncLLM, test: Callable[[httpx.AsyncClient], Awaitable[None]], **app_options: Any) -> None:
    """Run ``test`` against a fresh app over ``engine`` in memory (no socket), built with
    any of ``build_app``'s options."""
    app = build_app(engine, MODEL_NAME, **app_options)

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            await asyncio.wait_for(test(client), timeout=60)

    asyncio.run(run())
