"""The OpenAI-compatible HTTP server: app factory, API-key check, and ``tokenmill serve``.

The engine core runs in a child process (``AsyncLLM``); this process only
speaks HTTP, tokenizes and detokenizes.

Shutdown on SIGTERM: the engine stops admitting at once (new requests get 503)
and uvicorn closes its listening sockets. Requests in flight get
``--grace-period`` seconds to finish; then every one still running ends with
``finish_reason: "abort"``, so each stream closes properly (its last chunk,
then ``[DONE]``), and the core process is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import logging
import secrets
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.engine.config import add_option_args, engine_config_from_args, options_from_args
from tokenmill.engine.frontend.async_llm import AsyncLLM
from tokenmill.entrypoints.openai.chat import create_chat_completion
from tokenmill.entrypoints.openai.completions import create_completion
from tokenmill.entrypoints.openai.errors import APIError, install_error_handlers
from tokenmill.entrypoints.openai.limits import RequestBodyLimit, ServerLimits
from tokenmill.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    now_seconds,
    random_id,
)
from tokenmill.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from tokenmill.entrypoints.openai.serving import ServingContext, ServingOptions
from tokenmill.entrypoints.openai.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)
from tokenmill.entrypoints.openai.tool_parsers import TOOL_PARSERS

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "tokenmill-default"


_OPEN_PATHS = frozenset({"/health", "/version", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"})
"""What ``--api-key`` leaves open: liveness, the version and the API's own description, none of
which does work for the caller."""


class _APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on every path that does work (the API, /tokenize,
    /detokenize, and /metrics unless ``open_metrics``), before the body is even read (so a bad key
    is a 401 whatever the body holds). A request with two ``Authorization`` headers is a 400:
    proxies disagree on which one counts."""

    def __init__(self, app: ASGIApp, api_key: str, open_metrics: bool) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = _OPEN_PATHS | ({"/metrics"} if open_metrics else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = [value for name, value in scope["headers"] if name == b"authorization"]
            error = None
            if len(given) > 1:
                error = APIError(400, "the request has more than one Authorization header", code="invalid_request")
            elif scope["path"] not in self.open_paths and not secrets.compare_digest(
                given[0] if given else b"", self.expected
            ):
                error = APIError(401, "invalid or missing API key", code="invalid_api_key")
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ModelPermission(BaseModel):
    """OpenAI's legacy permission entry, which vLLM still lists and some clients still read."""

    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=now_seconds)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ServedModelCard(ModelCard):
    """A ``/v1/models`` entry with vLLM's fields: ``root`` is the model it was loaded from."""

    root: str
    parent: str | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ServedModelList(ModelList):
    data: list[ServedModelCard]  # type: ignore[assignment]  # pydantic: a subclass narrows a field's type


class _RequestIdMiddleware:
    """Echoes the client's ``X-Request-Id`` on every response, or makes one up, so that a
    proxy's logs and the client's can be matched (vLLM's ``--enable-request-id-headers``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id")
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


def build_app(
    engine: AsyncLLM,
    served_model_name: str,
    api_key: str | None = None,
    options: ServingOptions = ServingOptions(),
    vllm_metrics: bool = False,
    request_id_headers: bool = False,
    open_metrics: bool = True,
) -> FastAPI:
    """An app over ``engine``; its shutdown ends whatever still runs and stops the core.
    ``vllm_metrics`` also exports the metrics vLLM has under vLLM's names;
    ``request_id_headers`` puts an ``X-Request-Id`` on every response; ``open_metrics`` leaves
    /metrics open when an ``api_key`` guards the rest. A reasoning parser whose markers the
    model's tokenizer lacks is a ValueError: the server would split nothing."""
    if options.reasoning_parser is not None:
        REASONING_PARSERS[options.reasoning_parser].check_tokenizer(engine.tokenizer)
    server_metrics = ServerMetrics(engine, served_model_name, vllm_names=vllm_metrics)
    ctx = ServingContext(engine, served_model_name, engine.tokenizer, server_metrics, options)
    model_root = str(engine.config.model or served_model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.drain(0.0)

    app = FastAPI(title="tokenmill", lifespan=lifespan)
    app.state.serving = ctx
    install_error_handlers(app)
    app.add_middleware(RequestBodyLimit, max_bytes=options.limits.max_request_body_bytes)
    if api_key:  # added after, so it runs before: a request without the key is refused unread
        app.add_middleware(_APIKeyMiddleware, api_key=api_key, open_metrics=open_metrics)
    if request_id_headers:  # added last, so it is outermost: a 401 gets its id too
        app.add_middleware(_RequestIdMiddleware)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, req, raw)

    @app.get("/v1/models")
    async def models() -> ServedModelList:
        card = ServedModelCard(id=served_model_name, root=model_root, max_model_len=engine.max_model_len)
        return ServedModelList(data=[card])

    @app.post("/tokenize")
    async def tokenize_endpoint(req: TokenizeRequest) -> TokenizeResponse:
        return await tokenize(ctx, req)

    @app.post("/detokenize")
    async def detokenize_endpoint(req: DetokenizeRequest) -> DetokenizeResponse:
        return await detokenize(ctx, req)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version("tokenmill")}

    @app.get("/health")
    async def health() -> Response:
        if not engine.core_alive():
            assert engine.dead_reason is not None  # set when the core is found gone
            return APIError(503, engine.dead_reason, code="engine_dead").response()
        if not engine.accepting:
            return APIError(503, "the server is shutting down", code="unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    return app


class _DrainingServer(uvicorn.Server):
    """uvicorn, but a shutdown signal first makes the engine refuse new requests (503) and,
    after the grace period, end the requests still running, so their responses complete
    before uvicorn's own (later) deadline would cut them."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, grace_period: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace_period = grace_period
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.engine.accepting and self._loop is not None:
            self.engine.stop_admitting()
            self._loop.call_soon_threadsafe(self._loop.call_later, self.grace_period, self.engine.abort_all)
        super().handle_exit(sig, frame)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Server options of ``tokenmill serve``; the engine options come from
    ``tokenmill.engine.config.add_engine_args``."""
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface)",
    )
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every path but /health, /version and the API's docs "
        "(and /metrics, unless --api-key-for-metrics)",
    )
    g.add_argument(
        "--api-key-for-metrics",
        action="store_true",
        help="with --api-key, require the key on /metrics too (a Prometheus scraper must then send it)",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat_template (a Jinja program the server runs, within "
        "--chat-template-timeout); without it, such a request gets a 400",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (unset: the model path, or tokenmill-default)",
    )
    g.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="requests allowed to wait beyond the max-num-seqs that run at once; past it new requests get 503",
    )
    g.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="seconds that running requests get to finish on SIGTERM; then they end with finish_reason 'abort'",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report the prompt tokens found in the prefix cache as usage.prompt_tokens_details.cached_tokens",
    )
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="end every stream with a usage chunk, whether the request asked for it or not",
    )
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="show tokens in logprobs as 'token_id:N', for tokens that are not valid text on their own",
    )
    g.add_argument(
        "--vllm-compatible-metrics",
        action="store_true",
        help="also export each metric that vLLM has under vLLM's name (vllm:...), for vLLM dashboards",
    )
    g.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="put an X-Request-Id header on every response: the client's own, or a new one",
    )
    g.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=sorted(TOOL_PARSERS),
        help="how tool calls are read out of chat replies: hermes (JSON in <tool_call> tags: Qwen2.5, "
        "Qwen3, Hermes, the embedded model) or llama3_json (Llama 3.1+ JSON calls)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let chat requests use tool_choice "auto" (the default when they send tools): the model '
        "decides whether to call a tool",
    )
    g.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='with tool_choice "none", leave the tools out of the chat template too',
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split a reasoning model's thinking (<think>...</think>) out of chat replies into "
        "message.reasoning: qwen3 (Qwen3, QwQ with a template that opens the block) or deepseek_r1 "
        "(DeepSeek-R1 and its distills: the reply always thinks first); unset: the thinking stays in content",
    )
    g.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default={},
        metavar="JSON",
        help='variables for the chat template on every request, as a JSON object, e.g. \'{"enable_thinking": '
        "false}'; a request's chat_template_kwargs override them key by key",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level of the HTTP server (access log at info)",
    )
    add_option_args(parser, ServerLimits, "limits on one request's work")


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object from the command line; anything else is a usage error that says what it got."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object ({{...}}), got {type(value).__name__}: {text!r}")
    return value


def serving_options_from_args(args: argparse.Namespace) -> ServingOptions:
    return ServingOptions(
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_force_include_usage=args.enable_force_include_usage,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        trust_request_chat_template=args.trust_request_chat_template,
        reasoning_parser=args.reasoning_parser,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        limits=options_from_args(ServerLimits, args),
    )


def run_server(args: argparse.Namespace) -> int:
    """``tokenmill serve``: start the engine core process, serve until SIGTERM/SIGINT, drain, exit 0."""
    if args.grace_period < 0:
        raise ValueError(f"--grace-period must be >= 0, got {args.grace_period}")
    engine = AsyncLLM(engine_config_from_args(args), max_waiting=args.max_waiting)
    try:
        name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
        app = build_app(
            engine,
            name,
            api_key=args.api_key,
            options=serving_options_from_args(args),
            vllm_metrics=args.vllm_compatible_metrics,
            request_id_headers=args.enable_request_id_headers,
            open_metrics=not args.api_key_for_metrics,
        )
        # uvicorn's own deadline comes after ours: by then every stream has ended cleanly.
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=args.grace_period + 10,
        )
        logger.info("serving %s on http://%s:%d", json.dumps(name), args.host, args.port)
        _DrainingServer(config, engine, args.grace_period).run()
    finally:
        engine.close()
    return 0
