"""A table of bad inputs: each gets its documented status and OpenAI error body, and the
server keeps answering afterwards."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from .conftest import MAX_MODEL_LEN, MODEL_NAME

CHAT = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> str:
    return json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, **fields})


def chat(**fields: Any) -> str:
    return json.dumps({"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, **fields})


CASES = {
    # name: (method, path, raw body, status, error code or None); status None: 200 if the
    # model's template takes the message, else a 400 with that code
    "malformed json": ("POST", "/v1/completions", '{"prompt": "x",', 400, "invalid_json"),
    "body not an object": ("POST", "/v1/completions", "[1, 2]", 400, None),
    "missing prompt": ("POST", "/v1/completions", json.dumps({"model": MODEL_NAME}), 400, None),
    "prompt wrong type": ("POST", "/v1/completions", completion(prompt=5), 400, None),
    "max_tokens wrong type": ("POST", "/v1/completions", completion(max_tokens="lots"), 400, None),
    "seed wrong type": ("POST", "/v1/completions", completion(seed="abc"), 400, None),
    "stream_options wrong type": ("POST", "/v1/completions", completion(stream=True, stream_options=3), 400, None),
    "unknown model": ("POST", "/v1/completions", completion(model="gpt-9"), 400, "model_not_found"),
    "negative temperature": ("POST", "/v1/completions", completion(temperature=-1), 400, "invalid_value"),
    "top_p above 1": ("POST", "/v1/completions", completion(top_p=1.5), 400, "invalid_value"),
    "n zero": ("POST", "/v1/completions", completion(n=0), 400, None),
    "n huge": ("POST", "/v1/completions", completion(n=100000), 400, None),
    "max_tokens zero": ("POST", "/v1/completions", completion(max_tokens=0), 400, "invalid_value"),
    "min_tokens above max_tokens": ("POST", "/v1/completions", completion(min_tokens=9), 400, "invalid_value"),
    "presence_penalty out of range": ("POST", "/v1/completions", completion(presence_penalty=5), 400,
                                      "invalid_value"),
    "logprobs too many": ("POST", "/v1/completions", completion(logprobs=50), 400, None),
    "empty stop string": ("POST", "/v1/completions", completion(stop=[""]), 400, "invalid_value"),
    "empty prompt": ("POST", "/v1/completions", completion(prompt=""), 400, "invalid_value"),
    "empty prompt list": ("POST", "/v1/completions", completion(prompt=[]), 400, None),
    "empty token list": ("POST", "/v1/completions", completion(prompt=[[]]), 400, "invalid_value"),
    "token id outside vocab": ("POST", "/v1/completions", completion(prompt=[1, 10**9]), 400, "invalid_value"),
    "negative token id": ("POST", "/v1/completions", completion(prompt=[-1]), 400, "invalid_value"),
    "ids prompt too long": ("POST", "/v1/completions", completion(prompt=[3] * (MAX_MODEL_LEN + 10)), 400,
                            "invalid_value"),
    "text prompt too long": ("POST", "/v1/completions", completion(prompt="hello world " * 400), 400,
                             "invalid_value"),
    "too long in a batch": ("POST", "/v1/completions", completion(prompt=["ok", "x " * 1000]), 400,
                            "invalid_value"),
    "too long while streaming": ("POST", "/v1/completions", completion(prompt=[3] * 1000, stream=True), 400,
                                 "invalid_value"),
    "suffix": ("POST", "/v1/completions", completion(suffix="end"), 400, None),
    "chat messages empty": ("POST", "/v1/chat/completions", chat(messages=[]), 400, None),
    "chat messages a string": ("POST", "/v1/chat/completions", chat(messages="hi"), 400, None),
    "chat unknown role": ("POST", "/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), 400,
                          None),
    "chat top_logprobs without logprobs": ("POST", "/v1/chat/completions", chat(top_logprobs=2), 400, None),
    "chat max_completion_tokens zero": ("POST", "/v1/chat/completions", chat(max_completion_tokens=0), 400,
                                        "invalid_value"),
    "chat role the template refuses": ("POST", "/v1/chat/completions",
                                       chat(messages=[{"role": "tool", "content": "x"}]), None, "invalid_value"),
    "chat unknown model": ("POST", "/v1/chat/completions", chat(model="nope"), 400, "model_not_found"),
    "chat too long": ("POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "hi " * 600}]),
                      400, "invalid_value"),
    "unknown path": ("GET", "/v1/nothing", "", 404, None),
    "wrong method": ("GET", "/v1/completions", "", 405, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name: str, http: httpx.Client) -> None:
    method, path, body, status, code = CASES[name]
    response = http.request(method, path, content=body or None, headers={"Content-Type": "application/json"})
    if not (status is None and response.status_code == 200):
        assert response.status_code == (status or 400), response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        if code is not None:
            assert error["code"] == code
    assert http.get("/health").status_code == 200
