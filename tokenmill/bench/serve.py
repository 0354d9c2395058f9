"""``tokenmill bench serve``: load against any OpenAI-compatible server.

Requests go to ``/v1/completions`` with streaming on, arriving as a Poisson
process at ``--request-rate`` (``inf``: all at once), at most
``--max-concurrency`` in flight. The standard workload sends random token ids
(prompt and output lengths uniform in a range, fixed seed) with ``ignore_eos``,
so every request produces exactly its output length whatever the model says.

The client must not be what limits the measurement, so it does as little as it can
per token: one aiohttp session with a connection pool sized to the concurrency,
request bodies encoded before the clock starts, and server-sent events split by
hand with only ``data:`` lines decoded. Output tokens come from the final usage
chunk (asked for with ``stream_options.include_usage``), because servers may pack
several tokens into one chunk; only a server that sends no usage gets its text
chunks counted instead. TTFT runs to the first chunk with choices, ITL is each gap
between later ones.

``--stub`` runs the same workload against ``tokenmill.bench.stub_server``, started in
a child process, which answers instantly: the figures are then the client's own
ceiling, which should sit well above any server you mean to measure with it.

A refused connection or a ``--base-url`` ending in ``/v1`` stops the run with one
line. Ctrl-C cancels what is in flight and still prints (and writes with ``--out``)
what finished, marked partial, then exits 130.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from tqdm import tqdm

from tokenmill.bench.stub_server import DEFAULT_MODEL, StubConfig, run_stub_server

_decode = msgspec.json.Decoder().decode


@dataclass
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


class BenchSetupError(Exception):
    """The run cannot start (the server is unreachable or names no model); the
    message is the one line the user sees."""


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    """Options of ``tokenmill bench serve``."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument(
        "--stub",
        action="store_true",
        help="ignore --base-url and run against a stub server that answers instantly, "
        "to measure this client's own ceiling",
    )
    parser.add_argument("--model", default=None, help="model name to send (unset: the server's first model)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--num-prompts", type=int, default=256, help="requests to send")
    parser.add_argument("--min-input-len", type=int, default=100, help="shortest random prompt, in tokens")
    parser.add_argument("--max-input-len", type=int, default=1024, help="longest random prompt, in tokens")
    parser.add_argument(
        "--min-output-len", type=int, default=100, help="fewest tokens a request asks for (max_tokens, with ignore_eos)"
    )
    parser.add_argument("--max-output-len", type=int, default=1024, help="most tokens a request asks for")
    parser.add_argument(
        "--vocab-size", type=int, default=1000, help="random prompt token ids are drawn from [0, vocab-size)"
    )
    parser.add_argument("--prompt-file", default=None, help="one text prompt per line, instead of random ids")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrival times")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def check_base_url(url: str) -> str:
    """The base URL without a trailing slash; ValueError for one the run would only fail on later."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"--base-url {url} must start with http:// or https://")
    if base.endswith("/v1"):
        raise ValueError(f"--base-url {url} ends in /v1: drop the /v1 (requests go to <base-url>/v1/completions)")
    return base


def build_workload(args: argparse.Namespace) -> list[BenchRequest]:
    """The requests, the same for the same seed and options."""
    rng = random.Random(args.seed)

    def out_len() -> int:
        return rng.randint(args.min_output_len, args.max_output_len)

    if args.prompt_file:
        lines = [line.rstrip("\n") for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"{args.prompt_file} holds no prompt")
        return [BenchRequest(lines[i % len(lines)], out_len()) for i in range(args.num_prompts)]
    requests = []
    for _ in range(args.num_prompts):
        length = rng.randint(args.min_input_len, args.max_input_len)
        requests.append(BenchRequest([rng.randrange(args.vocab_size) for _ in range(length)], out_len()))
    return requests


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process at
    ``rate``, or all at 0 for an infinite rate. Absolute offsets keep the schedule
    from drifting when the event loop is busy."""
    if not (math.isfinite(rate) and rate > 0):
        return [0.0] * count
    gaps = random.Random(seed + 1)
    offsets, at = [], 0.0
    for _ in range(count):
        offsets.append(at)
        at += gaps.expovariate(rate)
    return offsets


def request_body(model: str, req: BenchRequest) -> bytes:
    return json.dumps(
        {
            "model": model,
            "prompt": req.prompt,
            "max_tokens": req.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        separators=(",", ":"),
    ).encode()


class SSEStream:
    """Timings and token counts of one streamed completion, fed its bytes as they arrive.

    This is the client's whole per-token cost, so lines are split by hand and only
    ``data:`` payloads are decoded. Events that arrive in one read share its time."""

    __slots__ = (
        "_tail",
        "done_at",
        "error",
        "first_at",
        "itls",
        "last_at",
        "output_tokens",
        "prompt_tokens",
        "start",
        "text_chunks",
    )

    def __init__(self, start: float) -> None:
        self.start = start
        self.first_at: float | None = None
        self.last_at = start
        self.done_at: float | None = None
        self.itls: list[float] = []
        self.text_chunks = 0
        self.prompt_tokens = 0
        self.output_tokens: int | None = None
        self.error = ""
        self._tail = b""

    def feed(self, data: bytes, now: float) -> None:
        lines = (self._tail + data).split(b"\n")
        self._tail = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                self._event(line[5:].strip(), now)

    def _event(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.done_at = now
            return
        event = _decode(payload)
        if not isinstance(event, dict):
            raise ValueError(f"an event that is not a JSON object: {payload[:80]!r}")
        choices = event.get("choices")
        if choices:
            if self.first_at is None:
                self.first_at = now
            else:
                self.itls.append(now - self.last_at)
            self.last_at = now
            if choices[0].get("text"):
                self.text_chunks += 1
        usage = event.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens", 0)
            self.output_tokens = usage.get("completion_tokens")
        if "error" in event or event.get("object") == "error":
            error = event.get("error", event)
            self.error = str(error.get("message", error) if isinstance(error, dict) else error)

    def result(self, end: float) -> RequestResult:
        outputs = self.text_chunks if self.output_tokens is None else self.output_tokens
        error = self.error or ("" if self.first_at is not None and outputs > 0 else "no output in the stream")
        return RequestResult(
            ok=not error,
            prompt_tokens=self.prompt_tokens,
            output_tokens=outputs,
            ttft=(self.first_at or end) - self.start,
            latency=(self.done_at or end) - self.start,
            itls=self.itls,
            error=error,
        )


async def _send(session: aiohttp.ClientSession, url: str, body: bytes) -> RequestResult:
    """One streamed completion; the clock starts once the request may go out."""
    start = time.perf_counter()
    stream = SSEStream(start)
    try:
        async with session.post(url, data=body) as response:
            if response.status != 200:
                return RequestResult(ok=False, error=f"HTTP {response.status}: {(await response.text())[:200]}")
            async for data in response.content.iter_any():
                stream.feed(data, time.perf_counter())
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}")
    return stream.result(time.perf_counter())


class BenchRun:
    """What the run has done so far.

    It lives outside the event loop because Ctrl-C tears the loop down: whatever
    finished before must still be readable to print a partial result."""

    def __init__(self, base_url: str, total: int, stub: bool = False, progress: bool = True) -> None:
        self.base_url = base_url
        self.total = total
        self.stub = stub
        self.model = ""
        self.results: list[RequestResult] = []
        self.start: float | None = None
        self.end: float | None = None
        self._show_progress = progress
        self._progress: tqdm | None = None

    def begin(self) -> float:
        """Start the clock and the progress bar (not before: a failed preflight prints one clean line)."""
        self._progress = tqdm(
            total=self.total, unit="req", file=sys.stderr, disable=not self._show_progress, leave=False
        )
        self.start = time.perf_counter()
        return self.start

    def record(self, result: RequestResult) -> None:
        assert self._progress is not None, "record() follows begin()"
        self.results.append(result)
        self._progress.update(1)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()

    @property
    def duration(self) -> float:
        if self.start is None:
            return 0.0
        return (self.end or time.perf_counter()) - self.start


def _connect_failure(exc: aiohttp.ClientConnectorError) -> str:
    refused = isinstance(exc.os_error, ConnectionRefusedError) or exc.os_error.errno == errno.ECONNREFUSED
    return "connection refused" if refused else str(exc.os_error.strerror or exc.os_error)


async def _preflight(session: aiohttp.ClientSession, base_url: str, model: str | None) -> str:
    """Check that the server answers, before any clock starts; the model to send."""
    listing = None
    try:
        async with session.get(f"{base_url}/v1/models") as response:
            if response.status == 200:
                listing = await response.json(content_type=None)
    except aiohttp.ClientConnectorError as exc:
        raise BenchSetupError(f"cannot connect to {base_url}: {_connect_failure(exc)}") from None
    except asyncio.TimeoutError:
        raise BenchSetupError(f"cannot connect to {base_url}: no answer from /v1/models") from None
    except (aiohttp.ClientError, ValueError):
        listing = None
    if model:
        return model
    if not (isinstance(listing, dict) and listing.get("data")):
        raise BenchSetupError(f"{base_url}/v1/models names no model: pass --model")
    return listing["data"][0]["id"]


async def run_benchmark(args: argparse.Namespace, workload: list[BenchRequest], run: BenchRun) -> None:
    """Send the workload, recording each finished request in ``run``."""
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0, ttl_dns_cache=None)
    async with aiohttp.ClientSession(
        connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=args.timeout)
    ) as session:
        run.model = await _preflight(session, run.base_url, args.model)
        bodies = [request_body(run.model, req) for req in workload]
        offsets = arrival_offsets(len(bodies), args.request_rate, args.seed)
        gate = asyncio.Semaphore(args.max_concurrency or max(1, len(bodies)))
        url = f"{run.base_url}/v1/completions"

        async def one(body: bytes) -> None:
            async with gate:
                result = await _send(session, url, body)
            run.record(result)

        tasks: list[asyncio.Task] = []
        start = run.begin()
        try:
            for body, offset in zip(bodies, offsets):
                # Yield even when late (a burst), so that the loop reads answers between
                # sends: tasks all started in one pass would hold the first requests'
                # first tokens until every request had gone out.
                await asyncio.sleep(start + offset - time.perf_counter())
                tasks.append(asyncio.create_task(one(body)))
            await asyncio.gather(*tasks)
        finally:
            run.end = time.perf_counter()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _stats(values: list[float]) -> dict[str, float]:
    """Mean, median and p99 in milliseconds (zeros when there is nothing to measure)."""
    if not values:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        "mean_ms": 1000 * statistics.fmean(ordered),
        "median_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * p99,
    }


def summarize(run: BenchRun, partial: bool = False) -> dict[str, Any]:
    """The figures the table and the JSON show; ``partial`` when Ctrl-C cut the run short."""
    results, duration = run.results, run.duration
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "model": run.model,
        "base_url": run.base_url,
        "stub": run.stub,
        "partial": partial,
        "num_requests": run.total,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "ttft": _stats([r.ttft for r in ok]),
        "tpot": _stats(tpots),
        "itl": _stats([gap for r in ok for gap in r.itls]),
        "e2e_latency": _stats([r.latency for r in ok]),
    }


def format_table(summary: dict[str, Any]) -> str:
    server = summary["base_url"]
    if summary["stub"]:
        server = f"stub at {server} (answers instantly: the client's own ceiling)"
    rows = [
        ("Server", server),
        ("Model", summary["model"]),
        ("Successful requests", summary["completed"]),
        ("Failed requests", summary["failed"]),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total output tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
    ]
    for key, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e_latency", "E2E latency")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {title} (ms)", f"{summary[key][f'{stat}_ms']:.2f}"))
    width = max(len(name) for name, _ in rows) + 2
    lines = ["=" * 20 + " Serving Benchmark Result " + "=" * 20]
    if summary["partial"]:
        finished = summary["completed"] + summary["failed"]
        lines.append(f"PARTIAL: interrupted with {finished} of {summary['num_requests']} requests finished")
    lines += [f"{name:<{width}}{value}" for name, value in rows]
    lines += [f"error: {e}" for e in summary["errors"]]
    lines.append("=" * 65)
    return "\n".join(lines)


def run_serve_bench(args: argparse.Namespace) -> int:
    """``tokenmill bench serve``: run, print the table, write JSON if asked.

    Exit status 0, or 1 if any request failed or the server could not be reached,
    or 130 after Ctrl-C (with the partial result printed)."""
    if args.stub:
        with run_stub_server(StubConfig(model=args.model or DEFAULT_MODEL)) as base_url:
            return _bench(args, base_url, stub=True)
    return _bench(args, check_base_url(args.base_url), stub=False)


def _bench(args: argparse.Namespace, base_url: str, stub: bool) -> int:
    workload = build_workload(args)
    run = BenchRun(base_url, len(workload), stub=stub, progress=not args.no_progress)
    interrupted = False
    try:
        asyncio.run(run_benchmark(args, workload, run))
    except BenchSetupError as exc:
        print(f"tokenmill bench serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        interrupted = True
    finally:
        run.close()
    summary = summarize(run, partial=interrupted)
    print(format_table(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({**summary, "args": _jsonable(vars(args))}, indent=2))
    if interrupted:
        return 130
    return 0 if summary["failed"] == 0 else 1


def _jsonable(options: dict[str, Any]) -> dict[str, Any]:
    """Options as JSON can hold them (infinite rates and callables become strings)."""

    def plain(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        return v if isinstance(v, str | int | float | bool | type(None)) else str(v)

    return {k: plain(v) for k, v in options.items() if k != "func"}
