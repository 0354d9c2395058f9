"""``tokenmill bench serve``: load against any OpenAI-compatible server.

Requests go to ``/v1/completions`` with streaming on, arriving as a Poisson
process at ``--request-rate`` (``inf``: all at once), at most
``--max-concurrency`` in flight. The standard workload sends random token ids
(prompt and output lengths uniform in a range, fixed seed) with ``ignore_eos``,
so every request produces exactly its output length whatever the model says.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


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


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    """Options of ``tokenmill bench serve``."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-input-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--min-output-len", type=int, default=100)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--vocab-size", type=int, default=1000,
                        help="random prompt token ids are drawn from [0, vocab-size)")
    parser.add_argument("--prompt-file", default=None, help="one text prompt per line, instead of random ids")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--out", default=None, help="write the results as JSON here")


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


async def _send(client: httpx.AsyncClient, model: str, req: BenchRequest, timeout: float) -> RequestResult:
    """One streamed completion, timing its first token and the gaps between tokens."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(ok=False)
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no usage in the stream"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _discover_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the workload and return the summary (what the table and the JSON show)."""
    workload = build_workload(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or len(workload) or 1, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=args.timeout) as client:
        model = args.model or await _discover_model(client)
        gate = asyncio.Semaphore(args.max_concurrency or len(workload) or 1)
        arrivals = random.Random(args.seed + 1)

        async def one(req: BenchRequest) -> RequestResult:
            async with gate:
                return await _send(client, model, req, args.timeout)

        start = time.perf_counter()
        tasks = []
        for req in workload:
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(arrivals.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, model)


def _stats(values: list[float]) -> dict[str, float]:
    """Mean, median and p99 in milliseconds (zeros when there is nothing to measure)."""
    if not values:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean_ms": 1000 * statistics.fmean(ordered), "median_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * p99}


def summarize(results: list[RequestResult], duration: float, model: str) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "model": model,
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
    rows = [
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
    lines += [f"{name:<{width}}{value}" for name, value in rows]
    lines += [f"error: {e}" for e in summary["errors"]]
    lines.append("=" * 65)
    return "\n".join(lines)


def run_serve_bench(args: argparse.Namespace) -> int:
    """``tokenmill bench serve``: run, print the table, write JSON if asked; 1 if any failed."""
    summary = asyncio.run(run_benchmark(args))
    print(format_table(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({**summary, "args": _jsonable(vars(args))}, indent=2))
    return 0 if summary["failed"] == 0 else 1


def _jsonable(options: dict[str, Any]) -> dict[str, Any]:
    """Options as JSON can hold them (infinite rates and callables become strings)."""
    def plain(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        return v if isinstance(v, str | int | float | bool | type(None)) else str(v)

    return {k: plain(v) for k, v in options.items() if k != "func"}

