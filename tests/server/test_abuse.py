"""What one client can ask of the server is bounded before any of it is done, and nothing it
sends reaches another request: the server's limits (body bytes, logprob entries, stop
strings, chat templates), client-chosen request ids, and the request fields whose cost
grew without bound."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tokenmill.engine.frontend.async_llm import AsyncLLM
from tokenmill.entrypoints import cli
from tokenmill.entrypoints.openai.limits import ServerLimits
from tokenmill.entrypoints.openai.server import serving_options_from_args
from tokenmill.entrypoints.openai.serving import ServingOptions

from .conftest import MAX_MODEL_LEN, MODEL_NAME, with_app

MESSAGES = [{"role": "user", "content": "Add two numbers."}]
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:300]
    return response.json()["error"]


def test_limits_are_server_options_checked_on_the_command_line() -> None:
    args = cli.parse_args(["serve", "--max-request-body-bytes", "1000", "--max-logprob-entries", "50",
                           "--max-stop-strings", "3", "--max-stop-string-chars", "7", "--chat-template-timeout", "0.5",
                           "--trust-request-chat-template"])
    options = serving_options_from_args(args)
    assert options.limits == ServerLimits(1000, 50, 3, 7, 0.5) and options.trust_request_chat_template
    assert serving_options_from_args(cli.parse_args(["serve"])).limits == ServerLimits()
    with pytest.raises(ValueError, match="chat_template_timeout must be > 0"):
        serving_options_from_args(cli.parse_args(["serve", "--chat-template-timeout", "0"]))


def test_a_body_past_the_limit_is_a_413_read_or_unread(engine_in_thread: AsyncLLM) -> None:
    small = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    big = {**small, "prompt": list(range(5, 500))}

    async def chunks() -> Iterator[bytes]:  # no Content-Length: the bytes are counted as they come
        body = json.dumps(big).encode()
        for i in range(0, len(body), 100):
            yield body[i:i + 100]

    async def test(client: httpx.AsyncClient) -> None:
        assert (await client.post("/v1/completions", json=small)).status_code == 200
        error = _error(await client.post("/v1/completions", json=big), 413)
        assert "1000 bytes" in error["message"] and "--max-request-body-bytes" in error["message"]
        headers = {"Content-Type": "application/json"}
        _error(await client.post("/v1/completions", content=chunks(), headers=headers), 413)
        _error(await client.post("/tokenize", json={"prompt": "x" * 2000}), 413)

    with_app(engine_in_thread, test, options=ServingOptions(limits=ServerLimits(max_request_body_bytes=1000)))


def test_logprob_entries_past_the_limit_are_refused_before_any_work(engine_in_thread: AsyncLLM) -> None:
    vocab = engine_in_thread.vocab_size
    prompt = list(range(5, 25))  # 20 tokens

    async def test(client: httpx.AsyncClient) -> None:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": -1}
        error = _error(await client.post("/v1/completions", json=body), 400)
        assert error["param"] == "prompt_logprobs" and "--max-logprob-entries" in error["message"]
        assert str(20 * (vocab + 1)) in error["message"]
        chat = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "logprobs": True, "top_logprobs": -1}
        assert _error(await client.post("/v1/chat/completions", json=chat), 400)["param"] == "logprobs"
        # n multiplies the rows; without max_tokens the rows are the room left in the context.
        many = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 100, "logprobs": 20, "n": 20}
        _error(await client.post("/v1/completions", json=many), 400)
        unbounded = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": None, "logprobs": 20, "n": 8}
        _error(await client.post("/v1/completions", json=unbounded), 400)
        within = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "logprobs": 5, "prompt_logprobs": 5}
        assert (await client.post("/v1/completions", json=within)).status_code == 200

    limits = ServerLimits(max_logprob_entries=4 * vocab)
    with_app(engine_in_thread, test, options=ServingOptions(limits=limits))


def test_stop_strings_past_the_limits_are_refused(http: httpx.Client) -> None:
    limits = ServerLimits()
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    too_many = [f"s{i}" for i in range(limits.max_stop_strings + 1)]
    error = _error(http.post("/v1/completions", json={**body, "stop": too_many}), 400)
    assert error["param"] == "stop" and "--max-stop-strings" in error["message"]
    too_long = "x" * (limits.max_stop_string_chars + 1)
    error = _error(http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES,
                                                           "max_tokens": 2, "stop": too_long}), 400)
    assert "--max-stop-string-chars" in error["message"]
    most = [f"never{i}" for i in range(limits.max_stop_strings)]
    assert http.post("/v1/completions", json={**body, "stop": most, "n": 4}).status_code == 200


def test_request_chat_templates_need_the_servers_trust(engine_in_thread: AsyncLLM) -> None:
    async def test(client: httpx.AsyncClient) -> None:
        for path, body in (("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 1}), ("/tokenize", {})):
            body = {**body, "messages": MESSAGES, "chat_template": "{{ messages[0]['content'] }}"}
            error = _error(await client.post(path, json=body), 400)
            assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]
        assert (await client.post("/tokenize", json={"messages": MESSAGES})).status_code == 200

    with_app(engine_in_thread, test)


def test_a_chat_template_is_stopped_at_its_time_limit(engine_in_thread: AsyncLLM) -> None:
    """Nested loops of the sandbox's longest range would run for hours; a range past it used to
    be a 500; a template may write no more text than a request's body may hold. Each is the
    request's fault, and the worker threads are free again after."""

    async def test(client: httpx.AsyncClient) -> None:
        for path, body in (("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 1}), ("/tokenize", {})):
            looping = {**body, "messages": MESSAGES, "chat_template": NESTED_LOOPS}
            error = _error(await client.post(path, json=looping), 400)
            assert error["code"] == "template_timeout" and "--chat-template-timeout" in error["message"]
            huge = {**body, "messages": MESSAGES, "chat_template": "{% for i in range(100000000) %}{% endfor %}"}
            assert "Range too big" in _error(await client.post(path, json=huge), 400)["message"]
            long = {**body, "messages": MESSAGES, "chat_template": "{% for i in range(3000) %}xxxx{% endfor %}"}
            assert "12000 characters, more than the 10000 taken" in _error(await client.post(path, json=long),
                                                                           400)["message"]
        fine = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1}
        assert (await client.post("/v1/chat/completions", json=fine)).status_code == 200

    limits = ServerLimits(chat_template_timeout=0.3, max_request_body_bytes=10_000)
    with_app(engine_in_thread, test, options=ServingOptions(trust_request_chat_template=True, limits=limits))


def test_truncate_minus_one_keeps_room_for_the_output(http: httpx.Client) -> None:
    """-1 keeps as many of the prompt's last tokens as leave room for max_tokens (it kept
    max_model_len tokens, which no request can have)."""
    prompt = [5 + i % 200 for i in range(MAX_MODEL_LEN + 40)]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "truncate_prompt_tokens": -1, "return_token_ids": True}
    out = http.post("/v1/completions", json=body).json()
    assert out["usage"] == {"prompt_tokens": MAX_MODEL_LEN - 5, "completion_tokens": 5,
                            "total_tokens": MAX_MODEL_LEN, "prompt_tokens_details": None}
    assert out["choices"][0]["prompt_token_ids"] == prompt[-(MAX_MODEL_LEN - 5):]


def test_a_reused_request_id_never_gets_another_requests_tokens(http: httpx.Client) -> None:
    """A stream closed early, then a new request under the same X-Request-Id: the aborted
    request's tokens still on their way must not reach the new one (they did in 18 of 20 trials)."""
    greedy = {"model": MODEL_NAME, "temperature": 0, "ignore_eos": True}
    second = {**greedy, "prompt": "import os\n", "max_tokens": 12, "return_token_ids": True}
    expected = http.post("/v1/completions", json=second).json()["choices"][0]["token_ids"]
    headers = {"X-Request-Id": "dup"}
    for _ in range(10):
        first = {**greedy, "prompt": "def fib(n):", "max_tokens": 200, "stream": True}
        with http.stream("POST", "/v1/completions", json=first, headers=headers) as stream:
            lines = stream.iter_lines()
            for _ in range(3):
                next(line for line in lines if line.startswith("data: "))
        out = http.post("/v1/completions", json=second, headers=headers).json()
        assert out["choices"][0]["token_ids"] == expected
        assert out["usage"]["completion_tokens"] == 12
