"""OpenAI-style errors: every failure leaves the server as ``{"error": {...}}`` with the
right status, so clients (the openai package first) raise the matching exception.
Bad input is a 400, never a 500."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.frontend.async_llm import EngineStepError, EngineStopped, EngineUnavailable, QueueFull
from tokenmill.entrypoints.openai.protocol import (
    UNION_TAGS,
    UNSUPPORTED_PARAMETER,
    UNSUPPORTED_VALUE,
    ErrorInfo,
    ErrorResponse,
)

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error meant for the client, with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message, type=_TYPES.get(self.status, "error"), param=self.param, code=self.code
            )
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to what the client should see; unknown ones are server bugs (500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull | EngineStopped):
        return APIError(503, str(exc), code="unavailable")
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), code="engine_error")
    if isinstance(exc, EngineUnavailable):  # the engine's limit of the moment, not the request's fault
        return APIError(503, str(exc), code="engine_timeout")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), code="invalid_value")
    logger.exception("unexpected error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")


_OWN_CODES = frozenset({UNSUPPORTED_PARAMETER, UNSUPPORTED_VALUE})
"""Validation error types of the protocol's own that are the OpenAI code as they stand."""


def _path(loc: tuple[int | str, ...]) -> str:
    """Where in the body an error sits, as ``messages[0].content``: FastAPI's leading
    ``body`` and the protocol's union tags name no field the client wrote."""
    path = ""
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in UNION_TAGS:
            path += f".{part}" if path else part
    return path


def _describe(error: Mapping[str, Any]) -> str:
    """An error without a path is about the body as a whole, which then is no object."""
    path = _path(tuple(error.get("loc", ())))
    return f"{path}: {error.get('msg', 'invalid')}" if path else "the request body must be a JSON object"


def _validation_error(exc: RequestValidationError) -> APIError:
    """One 400 for all of a body's problems (the first few, each with its path); param and
    code come from the first."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    kind = first.get("type", "")
    if kind == "json_invalid":
        return APIError(
            400,
            f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "),
            code="invalid_json",
        )
    message = "; ".join(dict.fromkeys(_describe(e) for e in errors[:4]))
    code = kind if kind in _OWN_CODES else "invalid_type" if "type" in kind else "invalid_value"
    return APIError(400, message, param=_path(tuple(first.get("loc", ()))) or None, code=code)


def install_error_handlers(app: FastAPI) -> None:
    """Route validation errors, ValueErrors, HTTP errors and anything unexpected to the
    OpenAI error body."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(json.JSONDecodeError)
    async def _on_json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json").response()

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        return APIError(exc.status_code, str(exc.detail or phrase)).response()

    for exc_type in (APIError, ValueError, QueueFull, EngineStopped, EngineStepError, EngineUnavailable, Exception):
        app.add_exception_handler(exc_type, _on_error)


async def _on_error(_: Request, exc: Exception) -> JSONResponse:
    return to_api_error(exc).response()
