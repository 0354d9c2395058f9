"""Structured outputs over HTTP: OpenAI's response_format, vLLM's structured_outputs and guided_*."""

from __future__ import annotations

import json
import re

import httpx
from pydantic import BaseModel, Field

from .conftest import MODEL_NAME, LiveServer

CHAT = [{"role": "user", "content": "Give me a person."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def test_response_format_json_schema_and_json_object(server: LiveServer) -> None:
    client = server.client()
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=120, temperature=0.7, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    value = json.loads(out.choices[0].message.content)
    assert isinstance(value["name"], str) and isinstance(value["age"], int)
    out = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=200, temperature=0,
                                         response_format={"type": "json_object"})
    assert out.choices[0].finish_reason != "stop" or isinstance(json.loads(out.choices[0].message.content), dict)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


def test_the_openai_client_parses_into_a_pydantic_model(server: LiveServer) -> None:
    """``beta.chat.completions.parse`` sends the model's strict JSON schema and reads the reply
    back into the model (64 tokens hold any reply the schema allows, one byte per token)."""
    for seed in (1, 2):
        out = server.client().beta.chat.completions.parse(model=MODEL_NAME, messages=CHAT, response_format=Person,
                                                          max_tokens=64, temperature=1.0, seed=seed)
        message = out.choices[0].message
        assert isinstance(message.parsed, Person) and message.parsed == Person(**json.loads(message.content))
        assert out.choices[0].finish_reason == "stop"


def test_guided_fields_and_structured_outputs_on_completions(server: LiveServer) -> None:
    client = server.client()
    out = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=10, n=3, temperature=1, seed=2,
                                    extra_body={"guided_choice": ["left", "right"]})
    assert all(c.text in ("left", "right") for c in out.choices)
    out = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=12, temperature=1, seed=2,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{2}:[0-9]{2}"}})
    assert re.fullmatch("[0-9]{2}:[0-9]{2}", out.choices[0].text)


def test_a_constraint_that_does_not_parse_is_a_400_naming_it(server: LiveServer) -> None:
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                          json={"model": MODEL_NAME, "prompt": "x", "guided_regex": "(unclosed"})
    assert response.status_code == 400
    assert "structured_outputs.regex is not valid" in response.json()["error"]["message"]


def test_a_constraint_that_fails_in_the_engine_is_a_400(model_dir, monkeypatch) -> None:
    """(The front-end's parse catches malformed constraints; one that the engine still cannot compile,
    here one whose parse is skipped, is the request's fault too.)"""
    import dataclasses

    from tokenmill.engine.frontend.async_llm import AsyncLLM

    from .conftest import small_engine_config, with_app

    monkeypatch.setattr("tokenmill.engine.frontend.input_processor.check_constraint", lambda spec, max_bytes: None)
    engine = AsyncLLM(dataclasses.replace(small_engine_config(model_dir), async_scheduling=True))
    try:
        async def test(client: httpx.AsyncClient) -> None:
            response = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x",
                                                                   "guided_regex": "(unclosed"})
            assert response.status_code == 400, response.text
            assert "structured_outputs cannot be compiled" in response.json()["error"]["message"]

        with_app(engine, test)
    finally:
        engine.close()


def test_a_constraint_that_compiles_too_long_is_a_503(model_dir, monkeypatch) -> None:
    """A compile past its time limit is the server's limit of the moment, not the request's fault:
    503 with a code that says so, and the server serves on."""
    import threading

    from tokenmill.engine.core import structured_outputs
    from tokenmill.engine.frontend.async_llm import AsyncLLM

    from .conftest import small_engine_config, with_app

    release = threading.Event()
    compile_ = structured_outputs.GrammarCompiler._compile
    monkeypatch.setattr(structured_outputs.GrammarCompiler, "_compile",
                        lambda self, spec: (release.wait(), compile_(self, spec))[1])
    monkeypatch.setattr(structured_outputs, "GRAMMAR_TIMEOUT_S", 0.0)
    engine = AsyncLLM(small_engine_config(model_dir), core_in_thread=True)
    try:
        async def test(client: httpx.AsyncClient) -> None:
            body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
            response = await client.post("/v1/completions", json={**body, "guided_regex": "[a-z]+"})
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "engine_timeout" and "took longer than 0 s" in error["message"], error
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text

        with_app(engine, test)
    finally:
        release.set()
        engine.close()


def test_a_constraint_over_the_size_limit_is_a_400(engine_in_thread) -> None:
    from .conftest import with_app

    limit = engine_in_thread.config.max_structured_output_bytes

    async def test(client: httpx.AsyncClient) -> None:
        choices = [f"choice {i:06d}" for i in range(limit // 10)]  # 13 bytes each
        response = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x",
                                                               "guided_choice": choices})
        assert response.status_code == 400, response.text
        assert "max_structured_output_bytes" in response.json()["error"]["message"]

    with_app(engine_in_thread, test)
