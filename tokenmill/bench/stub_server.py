"""A stand-in OpenAI-compatible server that answers at once, to measure the load generator.

``tokenmill bench serve --stub`` runs its workload against this server to show the
client's own ceiling: if the client cannot go faster than a server that does no work,
its figures against a real engine mean nothing near that ceiling. The server answers
``/v1/models`` and ``/v1/completions`` (streamed or not) with ``max_tokens`` tokens of
`` tok``, as completion chunks shaped like vLLM's, the last with
``finish_reason: "length"``, then a usage chunk when ``stream_options.include_usage``
asks for one, then ``data: [DONE]``.

It must never be the bottleneck, so every byte of a response is encoded before the
first is sent, several events go out per write, and the whole body length is known up
front (no chunked encoding). It yields to the event loop between writes so that a
burst of streams progresses together, as under a real engine, rather than one after
another. The stub has no tokenizer: a text prompt counts one token per word.

Run it alone with ``python -m tokenmill.bench.stub_server --port 8001``, or from code
with ``run_stub_server()``, which starts it in a child process on a free port.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

DEFAULT_MODEL = "stub-model"
DEFAULT_EVENTS_PER_WRITE = 16
_MODULE = "tokenmill.bench.stub_server"
# The child runs this file by path rather than with ``-m``: importing the package
# would import the engine (torch), seconds of start-up for a server that needs aiohttp.
_RUN_THIS_FILE = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
_START_TIMEOUT_S = 60.0
_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class StubConfig:
    model: str = DEFAULT_MODEL
    events_per_write: int = DEFAULT_EVENTS_PER_WRITE


@dataclass(frozen=True)
class _Completion:
    """What the stub needs from a request body."""

    max_tokens: int
    prompt_tokens: int
    stream: bool
    include_usage: bool

    @classmethod
    def parse(cls, body: dict[str, Any]) -> _Completion:
        prompt = body.get("prompt", "")
        prompt_tokens = len(prompt.split()) if isinstance(prompt, str) else len(prompt)
        return cls(
            max_tokens=max(1, int(body.get("max_tokens") or 16)),
            prompt_tokens=prompt_tokens,
            stream=bool(body.get("stream")),
            include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
        )

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.max_tokens,
            "total_tokens": self.prompt_tokens + self.max_tokens,
        }


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _event(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


def _stream_writes(head: dict[str, Any], req: _Completion, events_per_write: int) -> Iterator[bytes]:
    """The response body of a streamed completion, in the pieces to write.

    Only two token events differ (the last carries the finish reason), so they are
    encoded once and repeated."""

    def token(finish_reason: str | None) -> bytes:
        return _event(
            {**head, "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": finish_reason}]}
        )

    full_batch = token(None) * events_per_write
    full_batches, rest = divmod(req.max_tokens - 1, events_per_write)
    yield from itertools.repeat(full_batch, full_batches)
    tail = token(None) * rest + token("length")
    if req.include_usage:
        tail += _event({**head, "choices": [], "usage": req.usage()})
    yield tail + _DONE


def build_app(config: StubConfig) -> web.Application:
    """The stub's routes; ids count requests so that each response is distinguishable."""
    ids = itertools.count()
    created = int(time.time())

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": config.model, "object": "model", "created": created, "owned_by": "tokenmill-stub"}],
            }
        )

    async def completions(request: web.Request) -> web.StreamResponse:
        req = _Completion.parse(json.loads(await request.read()))
        head = {"id": f"cmpl-stub-{next(ids)}", "object": "text_completion", "created": created, "model": config.model}
        if not req.stream:
            return web.Response(
                content_type="application/json",
                body=_dumps(
                    {
                        **head,
                        "choices": [
                            {"index": 0, "text": " tok" * req.max_tokens, "logprobs": None, "finish_reason": "length"}
                        ],
                        "usage": req.usage(),
                    }
                ),
            )
        return await _stream(request, list(_stream_writes(head, req, config.events_per_write)))

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


async def _stream(request: web.Request, writes: list[bytes]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    response.content_length = sum(map(len, writes))
    await response.prepare(request)
    try:
        for piece in writes:
            await response.write(piece)
            await asyncio.sleep(0)
    except ConnectionResetError:
        pass  # the client went away (a cancelled benchmark): nothing left to answer
    return response


async def serve(host: str, port: int, config: StubConfig, exit_with_parent: bool) -> None:
    """Serve until SIGINT/SIGTERM (or until stdin closes, with ``exit_with_parent``).

    The first line on stdout is the base URL, which is how a parent that asked for
    port 0 learns the port."""
    runner = web.AppRunner(build_app(config), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # A burst opens hundreds of connections at once: the default backlog of 128 would
    # drop SYNs, and the retries would show up as seconds of TTFT.
    await web.SockSite(runner, sock, backlog=4096).start()
    print(f"stub server listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if exit_with_parent:
        threading.Thread(
            target=lambda: (sys.stdin.buffer.read(), loop.call_soon_threadsafe(stop.set)), daemon=True
        ).start()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


@contextmanager
def run_stub_server(config: StubConfig = StubConfig(), host: str = "127.0.0.1") -> Iterator[str]:
    """Run the stub in a child process on a free port; yield its base URL (without /v1).

    The child has its own session, so a Ctrl-C aimed at the benchmark leaves it serving
    until the benchmark has printed what it measured; it exits when its stdin closes,
    which also happens if this process dies without cleaning up."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _RUN_THIS_FILE,
            __file__,
            "--host",
            host,
            "--port",
            "0",
            "--model",
            config.model,
            "--events-per-write",
            str(config.events_per_write),
            "--exit-with-parent",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None  # both are pipes
    try:
        yield _read_base_url(proc)
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _read_base_url(proc: subprocess.Popen[bytes]) -> str:
    stdout = proc.stdout
    assert stdout is not None  # a pipe
    ready, _, _ = select.select([stdout], [], [], _START_TIMEOUT_S)
    line = stdout.readline().decode() if ready else ""
    if not line:
        raise RuntimeError(f"the stub server did not start (exit status {proc.poll()})")
    return line.split()[-1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {_MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="an IPv4 address")
    parser.add_argument("--port", type=int, default=8001, help="0: any free port (printed on stdout)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--events-per-write",
        type=int,
        default=DEFAULT_EVENTS_PER_WRITE,
        help="token events sent per write (1: the hardest case for a client)",
    )
    parser.add_argument("--exit-with-parent", action="store_true", help="stop when stdin closes")
    args = parser.parse_args(argv)
    if args.events_per_write < 1:
        parser.error("--events-per-write must be at least 1")
    asyncio.run(serve(args.host, args.port, StubConfig(args.model, args.events_per_write), args.exit_with_parent))


if __name__ == "__main__":
    main()
