"""The most work one request may ask of the server, checked before any of it is done.

A request's cost is known from its body and its prompt's length before the engine
sees it: the bytes of the body (parsing holds the event loop, which every stream
shares), the logprob entries it would have the engine compute and the server
serialize (rows times alternatives, the whole vocabulary for ``-1``), the stop
strings each of its sequences checks at every token, and the time its chat
template may run. Each limit is a server option (``tokenmill serve --help``); a
request past one gets a 400 (413 for the body) that names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.validation import check_fields, integer, number, ruled


@dataclass
class ServerLimits:
    """Per-request limits of ``tokenmill serve``; checked on construction."""

    max_request_body_bytes: int = ruled(
        4 * 2**20,
        integer(1),
        help="largest request body in bytes (larger: 413), and the most characters a chat template may render a "
        "request's messages to. Parsing a body holds every stream for about 0.25 s a MiB in the worst case "
        "(many tiny chat messages), so raise it only as far as your longest prompts need",
    )
    max_logprob_entries: int = ruled(
        2**20,
        integer(1),
        help="most logprob entries one request may ask for: for each prompt, its sequences' rows (n x max_tokens, "
        "or the room left in the context) times 1 + logprobs (the vocabulary for -1), plus its prompt's tokens "
        "times 1 + prompt_logprobs",
    )
    max_stop_strings: int = ruled(
        64, integer(0), help="most stop strings in one request (each sequence looks for all of them at every token)"
    )
    max_stop_string_chars: int = ruled(1024, integer(1), help="longest stop string, in characters")
    chat_template_timeout: float = ruled(
        5.0,
        number(0, lo_open=True),
        help="seconds a chat template may take to render one request's messages; past them the rendering is "
        "stopped and the request gets a 400",
    )

    def __post_init__(self) -> None:
        check_fields(self)

    def check_stop_strings(self, stop: str | list[str] | None) -> None:
        """The request's stop strings against the limits, before any sequence looks for them."""
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > self.max_stop_strings:
            raise APIError(
                400,
                f"{len(strings)} stop strings, but this server takes at most {self.max_stop_strings} "
                "(its --max-stop-strings)",
                param="stop",
                code="invalid_value",
            )
        longest = max(strings, key=len, default="")
        if len(longest) > self.max_stop_string_chars:
            raise APIError(
                400,
                f"a stop string of {len(longest)} characters, but this server takes at most "
                f"{self.max_stop_string_chars} (its --max-stop-string-chars)",
                param="stop",
                code="invalid_value",
            )


def logprob_entries(
    num_prompt_tokens: int, rows: int, logprobs: int | None, prompt_logprobs: int | None, vocab_size: int
) -> int:
    """The logprob entries (token, logprob) that one prompt's request makes the engine compute and the
    server send: per sampled row the sampled token and ``logprobs`` alternatives, per prompt token
    the same with ``prompt_logprobs``; -1 is the whole vocabulary."""

    def per_row(count: int | None) -> int:
        return 0 if count is None else 1 + (vocab_size if count == -1 else count)

    return rows * per_row(logprobs) + num_prompt_tokens * per_row(prompt_logprobs)


class RequestBodyLimit:
    """Refuses a body past ``max_bytes`` with a 413: at once when its ``Content-Length`` says so,
    else as soon as the bytes read pass it (a chunked body), before anything parses it. The body
    is read here whole, then handed on."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        too_large = APIError(
            413,
            f"the request body is larger than this server takes: {self.max_bytes} bytes (its --max-request-body-bytes)",
            code="request_too_large",
        )
        if declared.isdigit() and int(declared) > self.max_bytes:
            await too_large.response()(scope, receive, send)
            return
        chunks: list[bytes] = []
        size, client_left = 0, False
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees it so
                client_left = True
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await too_large.response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        if client_left:
            await self.app(scope, receive, send)
            return
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()  # after the body: the client's disconnect, when it comes
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
