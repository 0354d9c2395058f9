"""The OpenAI-compatible HTTP server: app factory, API-key check, and ``tokenmill serve``.

Shutdown on SIGTERM: the engine stops admitting at once (new requests get 503),
uvicorn closes its sockets and waits up to ``--grace-period`` seconds for the
responses in flight, then the app's shutdown aborts whatever is left.
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.entrypoints.openai.chat import create_chat_completion
from tokenmill.entrypoints.openai.completions import create_completion
from tokenmill.entrypoints.openai.errors import APIError, install_error_handlers
from tokenmill.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from tokenmill.entrypoints.openai.serving import ServingContext

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "tokenmill-default"


class _APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on /v1/*, before the body is even read
    (so a bad key is a 401 whatever the body holds); /health and /metrics stay open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = APIError(401, "invalid or missing API key", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              grace_period: float = 0.0) -> FastAPI:
    """An app over ``async_engine``; its shutdown drains the engine for ``grace_period`` s."""
    engine = async_engine.engine
    ctx = ServingContext(async_engine, served_model_name, engine.tokenizer, ServerMetrics(async_engine))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await async_engine.drain(grace_period)

    app = FastAPI(title="tokenmill", lifespan=lifespan)
    app.state.serving = ctx
    install_error_handlers(app)
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, req, raw)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=engine.max_model_len)])

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.accepting:
            return APIError(503, "the server is shutting down", code="unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    return app


class _DrainingServer(uvicorn.Server):
    """uvicorn, but a shutdown signal first makes the engine refuse new requests (503)."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine) -> None:
        super().__init__(config)
        self.async_engine = async_engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.async_engine.stop_admitting()
        super().handle_exit(sig, frame)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Server options of ``tokenmill serve``; the engine options come from the CLI's
    shared ``add_engine_args``."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model path, or tokenmill-default)")
    g.add_argument("--max-waiting", type=int, default=1024,
                   help="requests allowed to wait for scheduling before new ones get 503")
    g.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds that running requests get to finish on SIGTERM")
    g.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run_server(args: argparse.Namespace) -> int:
    """``tokenmill serve``: load the engine, serve until SIGTERM/SIGINT, drain, exit 0."""
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.entrypoints.cli import engine_config_from_args

    engine = LLMEngine(engine_config_from_args(args))
    async_engine = AsyncEngine(engine, max_waiting=args.max_waiting)
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    app = build_app(async_engine, name, api_key=args.api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=max(0.1, args.grace_period))
    logger.info("serving %s on http://%s:%d", json.dumps(name), args.host, args.port)
    _DrainingServer(config, async_engine).run()
    return 0
