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
    match = re.search(rf"^tokenmill:{name} ([0-9.e+-]+)$", text, re.MULTILINE)
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
    # The cancelled requests stopped early: far fewer tokens than running them out would take.
    generated = server.engine.stats.generation_tokens - generated_before
    assert generated < NUM_CLIENTS * MAX_TOKENS + NUM_CANCELLED * CANCELLED_MAX_TOKENS // 2
    assert server.engine.outputs.requests == {}
