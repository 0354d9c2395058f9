"""Random mixes of the request fields whose cost a client controls (logprobs of the whole
vocabulary, n, stop strings, many long prompts, chat templates of its own, truncation, reused
request ids, bodies near the size limit), sent beside good streams: no request gets a 500,
every good stream finishes exact, the event loop never stalls for a second (a pinger times
``/health``), and the server's memory stays bounded."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.entrypoints.openai.limits import ServerLimits
from tokenmill.entrypoints.openai.serving import ServingOptions

from .conftest import MODEL_NAME, LiveServer, live_server, small_engine_config
from .test_fuzz import good_traffic

LIMITS = ServerLimits(max_request_body_bytes=2**18, max_logprob_entries=2**16, chat_template_timeout=0.3)
LOOP_STALL_LIMIT_S = 1.0
RSS_GROWTH_LIMIT_MIB = 1024

TEMPLATES = [
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000000) %}{% endfor %}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ raise_exception('no') }}",
]
stop_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=8)
stops = st.one_of(st.none(), st.lists(stop_text, max_size=70), st.just(["x" * 1100]),
                  st.lists(stop_text, min_size=200, max_size=200))
costly = st.fixed_dictionaries({}, optional={
    "n": st.sampled_from([1, 2, 8, 128]),
    "prompt_logprobs": st.sampled_from([0, 5, 20, -1]),
    "stop": stops,
    "truncate_prompt_tokens": st.sampled_from([-1, 1, 5]),
    "temperature": st.sampled_from([0.0, 1.0]),
    "ignore_eos": st.booleans(),
    "padding": st.sampled_from(["x" * 1000, "x" * 100_000, "x" * LIMITS.max_request_body_bytes]),
})
prompts = st.one_of(
    st.text(max_size=40).filter(bool),
    st.lists(st.integers(5, 400), min_size=1, max_size=600),
    st.integers(1, 70).map(lambda count: ["word " * 800] * count),
)
completions = st.tuples(costly, prompts, st.sampled_from([None, 0, 5, 20])).map(
    lambda t: ("/v1/completions", t[0] | {"prompt": t[1]} | ({} if t[2] is None else {"logprobs": t[2]})))
chats = st.tuples(costly, st.sampled_from([None, *TEMPLATES]), st.sampled_from([None, -1, 0, 20])).map(
    lambda t: ("/v1/chat/completions", t[0] | {"messages": [{"role": "user", "content": "hi"}]}
               | ({} if t[1] is None else {"chat_template": t[1]})
               | ({} if t[2] is None else {"logprobs": True, "top_logprobs": t[2]})))
requests = st.tuples(st.one_of(completions, chats, chats), st.sampled_from([None, "same-id"]), st.booleans())


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


class LoopWatch:
    """Times ``/health`` every 50 ms (the event loop answers it): the slowest answer is the
    longest the loop was held."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.stop = threading.Event()
        self.slowest = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60) as client:
            while not self.stop.is_set():
                sent = time.monotonic()
                assert client.get("/health").status_code == 200
                self.slowest = max(self.slowest, time.monotonic() - sent)
                time.sleep(0.05)


@pytest.fixture(scope="module")
def costly_server(model_dir: Path) -> Iterator[LiveServer]:
    options = ServingOptions(trust_request_chat_template=True, limits=LIMITS)
    with live_server(small_engine_config(model_dir), options=options) as running:
        yield running


def _check(http: httpx.Client, path: str, body: dict[str, Any], request_id: str | None, stream: bool) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 2, **body, "stream": stream}
    headers = {"Content-Type": "application/json"} | ({"X-Request-Id": request_id} if request_id else {})
    response = http.post(path, content=json.dumps(body), headers=headers)
    status = response.status_code
    assert status in (200, 400, 413), f"{status} for {json.dumps(body)[:300]}: {response.text[:300]}"
    if status != 200:
        assert response.json()["error"]["message"]
    elif stream:
        events = [line[len("data: "):] for line in response.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not [e for e in events[:-1] if "error" in json.loads(e)], response.text[:300]
    else:
        choices = response.json()["choices"]
        assert len(choices) == body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list)
                                                   and isinstance(body["prompt"][0], str) else 1)


def test_costly_requests_beside_good_streams(costly_server: LiveServer) -> None:
    core_pid = costly_server.engine.client.process.pid
    before = _rss_mib(os.getpid()), _rss_mib(core_pid)
    watch = LoopWatch(costly_server.base_url)
    http = httpx.Client(base_url=costly_server.base_url, timeout=120)

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=requests)
    def property_(request: tuple[tuple[str, dict[str, Any]], str | None, bool]) -> None:
        (path, body), request_id, stream = request
        if stream and "prompt_logprobs" in body:
            body.pop("prompt_logprobs")  # refused with a stream; asked here with whole responses
        _check(http, path, body, request_id, stream)

    try:
        with good_traffic(costly_server):
            property_()
    finally:
        watch.stop.set()
        watch.thread.join(10)
        http.close()
    after = _rss_mib(os.getpid()), _rss_mib(core_pid)
    assert watch.slowest < LOOP_STALL_LIMIT_S, f"the event loop was held {watch.slowest:.2f} s"
    growth = [a - b for a, b in zip(after, before)]
    assert max(growth) < RSS_GROWTH_LIMIT_MIB, f"memory grew by {growth} MiB (API process, core)"
