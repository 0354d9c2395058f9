"""Many streaming clients at once: each gets exactly its tokens, cancelled ones are
aborted at once without disturbing the others, and nothing leaks afterwards."""

from __future__ import annotations

import asyncio
import re
import time

import httpx

from .conftest import MODEL_NAME, LiveServer

NUM_CLIENTS = 64
NUM_CANCELLED = 10
MAX_TOKENS = 12
CANCELLED_MAX_TOKENS = 200


def metric(text: str, name: str) -> float:
    match = re.search(rf"^tokenmill:{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


async def _full_stream(client, i: int) -> tuple[int, int]:
    """(completion tokens by usage, tokens counted through logprobs)."""
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=f"# client {i}\ndef f{i}(x):", max_tokens=MAX_TOKENS, temperature=0.8, seed=i,
        logprobs=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    counted, usage = 0, None
    async for chunk in stream:
        for choice in chunk.choices:
            counted += len(choice.logprobs.tokens)
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return usage, counted


async def _cancelled_stream(client, i: int) -> int:
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=f"# cancelled {i}\n", max_tokens=CANCELLED_MAX_TOKENS, temperature=0.8,
        stream=True, extra_body={"ignore_eos": True})
    received = 0
    async for chunk in stream:
        received += len(chunk.choices)
        if received >= 2:
            break
    await stream.close()
    return received


async def _run_all(server: LiveServer) -> tuple[list, list]:
    client = server.async_client()
    async with client:
        full = [_full_stream(client, i) for i in range(NUM_CLIENTS)]
        cancelled = [_cancelled_stream(client, i) for i in range(NUM_CANCELLED)]
        results = await asyncio.wait_for(asyncio.gather(*full, *cancelled), timeout=120)
    return results[:NUM_CLIENTS], results[NUM_CLIENTS:]


def test_concurrent_streams_with_cancellations(server: LiveServer, http: httpx.Client) -> None:
    generated_before = server.engine.stats.generation_tokens
    full, cancelled = asyncio.run(_run_all(server))
    assert full == [(MAX_TOKENS, MAX_TOKENS)] * NUM_CLIENTS
    assert all(n == 2 for n in cancelled)

    deadline = time.monotonic() + 10
    while True:
        text = http.get("/metrics").text
        idle = (metric(text, "num_requests_running") == 0 and metric(text, "num_requests_waiting") == 0
                and metric(text, "kv_cache_blocks_in_use") == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, text
    assert metric(text, "kv_cache_usage_perc") == 0
    assert metric(text, "time_to_first_token_seconds_count") >= NUM_CLIENTS
    assert metric(text, "generation_tokens_total") >= NUM_CLIENTS * MAX_TOKENS
    assert metric(text, 'request_success_total{finished_reason="length"}') >= NUM_CLIENTS
    assert metric(text, 'request_success_total{finished_reason="abort"}') >= NUM_CANCELLED
    # The cancelled requests stopped early: far fewer tokens than running them out would take.
    generated = server.engine.stats.generation_tokens - generated_before
    assert generated < NUM_CLIENTS * MAX_TOKENS + NUM_CANCELLED * CANCELLED_MAX_TOKENS // 2
    assert server.engine.outputs.requests == {}


def test_a_huge_prompt_does_not_stall_other_streams(server: LiveServer) -> None:
    """Tokenizing a prompt of millions of characters takes seconds; it happens beside the
    event loop, so another stream keeps getting its tokens meanwhile. (The body, 4.0 MB, stays
    within the server's default limit.)"""
    prompt = "def fibonacci(n): return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 60_000  # 4.0M characters
    gaps: list[float] = []

    async def stream_and_time(client) -> None:
        stream = await client.completions.create(model=MODEL_NAME, prompt="# timing\n", max_tokens=240,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        last = time.monotonic()
        async for _ in stream:
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async def run() -> int:
        client = server.async_client()
        async with client, httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            streaming = asyncio.create_task(stream_and_time(client))
            await asyncio.sleep(0.3)  # the stream is under way
            started = time.monotonic()
            response = await http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1})
            assert time.monotonic() - started > 1.0, "the huge prompt was meant to take a while"
            await streaming
            return response.status_code

    assert asyncio.run(run()) == 400  # far longer than max_model_len, which it was tokenized to learn
    assert len(gaps) > 10
    assert max(gaps[1:]) < 1.0, f"a stream stalled for {max(gaps[1:]):.1f} s while a prompt was tokenized"


POISON_BODIES = [  # raw JSON: some of these no client library would send
    '{"model": "%s", "prompt": "x", "max_tokens": 2, "min_tokens": 1, "stop_token_ids": [99999]}',
    '{"model": "%s", "prompt": "x", "max_tokens": 2, "top_k": 1' + "0" * 400 + "}",
    '{"model": "%s", "prompt": "x", "max_tokens": 2, "temperature": NaN}',
    '{"model": "%s", "prompt": "x", "max_tokens": 2, "repetition_penalty": NaN}',
    '{"model": "%s", "prompt": "ab\\ud800", "max_tokens": 2}',
    '{"model": "%s", "messages": [{"role": "user", "content": "ab\\ud800"}], "max_tokens": 2}',
    '{"model": "%s", "prompt": "x", "max_tokens": 100000}',
    '{"model": "%s", "prompt": "x", "max_tokens": 2, "response_format": {"type": "xml"}}',
    '{"model": "%s", "prompt": "x", "max_tokens": 2, "guided_regex": "(unclosed"}',
]


def test_poisoned_requests_leave_concurrent_streams_complete(server: LiveServer) -> None:
    async def poison(http: httpx.AsyncClient, body: str) -> int:
        path = "/v1/chat/completions" if '"messages"' in body else "/v1/completions"
        response = await http.post(path, content=body % MODEL_NAME, headers={"Content-Type": "application/json"})
        assert response.status_code < 500, response.text
        if response.status_code != 200:
            assert response.json()["error"]["type"] == "invalid_request_error"
        return response.status_code

    async def run() -> tuple[list, list[int]]:
        client = server.async_client()
        async with client, httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            good = [_full_stream(client, 100 + i) for i in range(8)]
            bad = [poison(http, body) for body in POISON_BODIES for _ in range(2)]
            results = await asyncio.wait_for(asyncio.gather(*good, *bad), timeout=120)
        return results[:8], results[8:]

    good, statuses = asyncio.run(run())
    assert good == [(MAX_TOKENS, MAX_TOKENS)] * 8
    assert statuses.count(400) >= 2 * (len(POISON_BODIES) - 1)  # a clamped top_k may run
