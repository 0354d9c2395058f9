"""What one client can do to everyone else: ``tokenmill serve`` (the embedded model, CPU, ngram
speculation on, an API key) under the inputs of an adversarial probe, each sent while
background streams decode and a pinger times ``/health``.

For every input it reports the statuses it got, its wall time, the largest gap between two
chunks of a background request under way and the longest wait of one sent meanwhile for its
first chunk, the slowest ``/health`` answer while it ran (how long the event loop was held), and
the peak resident memory of the API process and of the engine core.

    python benchmarks/suite/server_abuse_probe.py --out probe.json
    python benchmarks/suite/server_abuse_probe.py --skip prompt_logprobs_2000 --out before.json   # an older server

A name in ``--skip`` leaves that input out (the 2,000-token whole-vocabulary request grew an
older server past 17 GB). The server's flags that a version lacks are left out of its command.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from serve_vs_engine import served

KEY = "probe-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tokenmill-default"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}]


@dataclass
class Row:
    name: str
    statuses: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    max_stream_gap_seconds: float = 0.0
    max_first_chunk_seconds: float = 0.0
    max_health_seconds: float = 0.0
    peak_api_rss_mib: float = 0.0
    peak_core_rss_mib: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class Watch:
    """Background streams, a /health pinger and a memory sampler, each keeping timestamps."""

    def __init__(self, base: str, server_pid: int, streams: int) -> None:
        self.base, self.pid = base, server_pid
        self.stop = threading.Event()
        self.chunks: list[list[float]] = [[] for _ in range(streams)]  # each stream's chunks, all its requests
        self.starts: list[list[float]] = [[] for _ in range(streams)]  # when each of its requests was sent
        self.health: list[tuple[float, float]] = []  # (sent at, seconds)
        self.rss: list[tuple[float, float, float]] = []  # (at, api, core)
        self.stream_errors: list[str] = []
        self.threads = [threading.Thread(target=self._stream, args=(i,), daemon=True) for i in range(streams)]
        self.threads += [threading.Thread(target=self._ping, daemon=True), threading.Thread(target=self._sample,
                                                                                           daemon=True)]
        for t in self.threads:
            t.start()

    def _stream(self, index: int) -> None:
        body = {"model": MODEL, "prompt": f"def task_{index}(x):", "max_tokens": 48, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.base, headers=AUTH, timeout=600) as client:
            while not self.stop.is_set():
                try:
                    self.starts[index].append(time.monotonic())
                    with client.stream("POST", "/v1/completions", json=body) as response:
                        for line in response.iter_lines():
                            if line.startswith("data: "):
                                self.chunks[index].append(time.monotonic())
                                if '"error"' in line:
                                    self.stream_errors.append(line[:200])
                except httpx.HTTPError as exc:
                    self.stream_errors.append(repr(exc))
                    time.sleep(0.2)

    def _ping(self) -> None:
        with httpx.Client(base_url=self.base, timeout=600) as client:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    client.get("/health")
                except httpx.HTTPError:
                    pass
                self.health.append((sent, time.monotonic() - sent))
                time.sleep(0.05)

    def _sample(self) -> None:
        while not self.stop.is_set():
            core = sum(_rss_mib(c) for c in _children(self.pid))
            self.rss.append((time.monotonic(), _rss_mib(self.pid), core))
            time.sleep(0.1)

    def window(self, row: Row, start: float, end: float) -> None:
        """The window's figures: the largest gap between two chunks of one running request (a stall
        of a stream under way; the wait of a request sent meanwhile for its first token is apart),
        the slowest /health answer, the peak memory."""
        gaps, firsts = [], []
        for times, starts in zip(self.chunks, self.starts):
            for sent, after in zip(starts, starts[1:] + [math.inf]):
                mine = [t for t in times if sent <= t < after]
                gaps += [b - a for a, b in zip(mine, mine[1:]) if b >= start and a <= end]
                if mine and start <= mine[0] and sent <= end:
                    firsts.append(mine[0] - sent)
        row.max_stream_gap_seconds = round(max(gaps, default=0.0), 3)
        row.max_first_chunk_seconds = round(max(firsts, default=0.0), 3)
        row.max_health_seconds = round(max((s for at, s in self.health if start <= at <= end), default=0.0), 3)
        inside = [(a, c) for at, a, c in self.rss if start <= at <= end + 0.5]
        row.peak_api_rss_mib = round(max((a for a, _ in inside), default=0.0), 1)
        row.peak_core_rss_mib = round(max((c for _, c in inside), default=0.0), 1)


def _count(row: Row, response: httpx.Response | str) -> None:
    key = response if isinstance(response, str) else str(response.status_code)
    row.statuses[key] = row.statuses.get(key, 0) + 1


def _post(client: httpx.Client, row: Row, path: str, **kwargs: Any) -> httpx.Response | None:
    try:
        response = client.post(path, **kwargs)
    except httpx.HTTPError as exc:
        _count(row, type(exc).__name__)
        return None
    _count(row, response)
    return response


def logprobs_inputs(client: httpx.Client, row: Row, prompt_tokens: int) -> None:
    prompt = [100 + i % 5000 for i in range(prompt_tokens)]
    _post(client, row, "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                "prompt_logprobs": -1})


def chat_top_logprobs(client: httpx.Client, row: Row) -> None:
    _post(client, row, "/v1/chat/completions", json={"model": MODEL, "max_tokens": 32, "ignore_eos": True,
                                                     "messages": [{"role": "user", "content": "hi"}],
                                                     "logprobs": True, "top_logprobs": -1})


def spec_and_grammar(client: httpx.Client, row: Row, watch: Watch) -> None:
    """tool_choice "required" at temperature 1 beside the background streams, 20 times."""
    before = len(watch.stream_errors)
    for _ in range(20):
        _post(client, row, "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris for 3 days?"}],
            "tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "max_tokens": 64})
    row.notes["background_stream_errors"] = len(watch.stream_errors) - before


def reused_request_id(client: httpx.Client, row: Row) -> None:
    second = {"model": MODEL, "prompt": "import os\n", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    expected = client.post("/v1/completions", json=second).json()["choices"][0]["text"]
    wrong = 0
    for _ in range(20):
        first = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                 "stream": True}
        with client.stream("POST", "/v1/completions", json=first, headers={"X-Request-Id": "dup"}) as stream:
            lines = stream.iter_lines()
            for _ in range(3):
                next(line for line in lines if line.startswith("data: "))
        out = _post(client, row, "/v1/completions", json=second, headers={"X-Request-Id": "dup"})
        body = out.json() if out is not None and out.status_code == 200 else None
        wrong += body is None or body["choices"][0]["text"] != expected or body["usage"]["completion_tokens"] != 12
    row.notes["wrong_outputs_of_20"] = wrong


def many_stop_strings(client: httpx.Client, row: Row) -> None:
    _post(client, row, "/v1/completions", json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 16, "n": 128,
                                                "ignore_eos": True, "stop": [f"zq{i}x" for i in range(10000)]})


def huge_body(client: httpx.Client, row: Row) -> None:
    body = b'{"model": "' + MODEL.encode() + b'", "max_tokens": 1, "prompt": [' + b"1234, " * (100 * 2**20 // 6) \
        + b"5]}"
    _post(client, row, "/v1/completions", content=body, headers={"Content-Type": "application/json"})


def many_prompts(client: httpx.Client, row: Row, count: int) -> None:
    """``count`` prompts of 4,096 characters in one request, each within the context; the client
    gives up after 60 s (the engine then drops what it has not computed)."""
    prompts = [("word%d " % i) * 512 for i in range(count)]
    _post(client, row, "/v1/completions", json={"model": MODEL, "prompt": [p[:4096] for p in prompts],
                                                "max_tokens": 1}, timeout=60)


def template_loops(client: httpx.Client, row: Row) -> None:
    """Two unauthenticated /tokenize calls with nested loops at once (the pool had two threads),
    then an authorized long prompt."""
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": loops}
    hogs = [threading.Thread(target=_post, args=(client, row, "/tokenize"), kwargs={"json": body,
                                                                                     "headers": {}})
            for _ in range(2)]
    for hog in hogs:
        hog.start()
    time.sleep(1.0)
    started = time.monotonic()
    _post(client, row, "/v1/completions", json={"model": MODEL, "prompt": "x " * 3000, "max_tokens": 1}, timeout=60)
    row.notes["long_prompt_seconds"] = round(time.monotonic() - started, 2)
    for hog in hogs:
        hog.join(130)


def slow_grammars(client: httpx.Client, row: Row) -> None:
    """Three valid grammars of 20,000 rules, then a trivial choice request behind them."""
    rules = "\n".join(f'r{i} ::= "t{i}" | r{i + 1}' for i in range(20000))
    grammars = [f'root ::= r0\n{rules}\nr20000 ::= "end{k}"' for k in range(3)]
    hogs = [threading.Thread(target=_post, args=(client, row, "/v1/completions"), kwargs={"json": {
        "model": MODEL, "prompt": "x", "max_tokens": 4, "structured_outputs": {"grammar": g}}, "timeout": 200})
        for g in grammars]
    for hog in hogs:
        hog.start()
    time.sleep(0.5)
    out = _post(client, row, "/v1/completions", json={"model": MODEL, "prompt": "Pick:", "max_tokens": 4,
                                                      "structured_outputs": {"choice": ["yes", "no"]}}, timeout=200)
    row.notes["trivial_choice_status"] = None if out is None else out.status_code
    row.notes["trivial_choice_error"] = None if out is None or out.status_code == 200 else out.text[:200]
    for hog in hogs:
        hog.join(200)


def distinct_schemas(client: httpx.Client, row: Row) -> None:
    for k in range(300):
        schema = {"type": "object", "properties": {f"p{k}_{i}": {"type": "integer"} for i in range(200)}}
        _post(client, row, "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "json"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})


def small_items(client: httpx.Client, row: Row) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    out = _post(client, row, "/v1/chat/completions", json={**chat, "chat_template": "{% for i in range(100000000) %}"
                                                                                    "{% endfor %}"})
    row.notes["template_range_1e8_status"] = None if out is None else out.status_code
    connection = http.client.HTTPConnection(client.base_url.host, client.base_url.port, timeout=30)
    connection.putrequest("GET", "/v1/models")
    for value in ("Bearer x", f"Bearer {KEY}"):
        connection.putheader("Authorization", value)
    connection.endheaders()
    status = connection.getresponse().status
    connection.close()
    _count(row, str(status))
    row.notes["two_authorization_headers_status"] = status
    out = _post(client, row, "/v1/completions", json={"model": MODEL, "prompt": [7] * 3000, "max_tokens": 5,
                                                      "truncate_prompt_tokens": -1})
    row.notes["truncate_minus_one_status"] = None if out is None else out.status_code


def long_prefill(client: httpx.Client, row: Row) -> None:
    _post(client, row, "/v1/completions", json={"model": MODEL, "prompt": [100 + i % 4000 for i in range(2047)],
                                                "max_tokens": 1})


INPUTS: dict[str, Callable[..., None]] = {
    "prompt_logprobs_50": lambda c, r, w: logprobs_inputs(c, r, 50),
    "chat_top_logprobs_32": lambda c, r, w: chat_top_logprobs(c, r),
    "prompt_logprobs_2000": lambda c, r, w: logprobs_inputs(c, r, 2000),
    "speculation_and_grammar": spec_and_grammar,
    "reused_request_id": lambda c, r, w: reused_request_id(c, r),
    "stop_strings_10000_n128": lambda c, r, w: many_stop_strings(c, r),
    "body_100_mb": lambda c, r, w: huge_body(c, r),
    "prompts_1200x4096": lambda c, r, w: many_prompts(c, r, 1200),
    "prompts_900x4096": lambda c, r, w: many_prompts(c, r, 900),
    "template_loops_unauthenticated": lambda c, r, w: template_loops(c, r),
    "grammars_3x20000_rules": lambda c, r, w: slow_grammars(c, r),
    "schemas_300x200_properties": lambda c, r, w: distinct_schemas(c, r),
    "small_items": lambda c, r, w: small_items(c, r),
    "prefill_2047_tokens": lambda c, r, w: long_prefill(c, r),
}


def server_arguments() -> list[str]:
    """The embedded model with an API key and ngram speculation; requests' own chat templates
    trusted where the server has the flag (an older one lacks it, and runs them regardless)."""
    arguments = ["--api-key", KEY, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    help_text = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--help"],
                               capture_output=True, text=True).stdout
    return arguments + (["--trust-request-chat-template"] if "--trust-request-chat-template" in help_text else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", default=None, choices=sorted(INPUTS))
    parser.add_argument("--skip", nargs="*", default=[], choices=sorted(INPUTS))
    parser.add_argument("--streams", type=int, default=4, help="background streams decoding all along")
    args = parser.parse_args()
    rows = []
    with served(*server_arguments(), "--uvicorn-log-level", "warning") as (base, server):
        watch = Watch(base, server.pid, args.streams)
        time.sleep(3)
        idle = Row("idle")
        with httpx.Client(base_url=base, headers=AUTH, timeout=200) as client:
            start = time.monotonic()
            time.sleep(5)
            watch.window(idle, start, time.monotonic())
            rows.append(idle)
            for name in args.only or list(INPUTS):
                if name in args.skip:
                    continue
                row = Row(name)
                start = time.monotonic()
                INPUTS[name](client, row, watch)
                end = time.monotonic()
                time.sleep(1.0)  # the stall a request leaves behind counts too
                row.seconds = round(end - start, 2)
                watch.window(row, start, time.monotonic())
                alive = server.poll() is None
                row.notes["server_alive"] = alive
                rows.append(row)
                print(json.dumps(asdict(row)), flush=True)
                if not alive:
                    break
        watch.stop.set()
        rows.append(Row("background_stream_errors", notes={"count": len(watch.stream_errors),
                                                           "first": watch.stream_errors[:3]}))
    args.out.write_text(json.dumps({"commit": os.environ.get("PROBE_COMMIT"), "rows": [asdict(r) for r in rows]},
                                   indent=1))


if __name__ == "__main__":
    main()
