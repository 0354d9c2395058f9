"""The server over a tensor-parallel engine: its core process (rank 0) starts a worker of its own,
and a completion gives the text of the one-process engine."""

from __future__ import annotations

from dataclasses import replace

import httpx

from tokenmill import LLM, SamplingParams
from tokenmill.engine.frontend.async_llm import AsyncLLM

from .conftest import MODEL_NAME, small_engine_config, with_app

PROMPT = "def fibonacci(n):"


def test_a_two_rank_server_answers_as_one_rank(model_dir) -> None:
    config = replace(small_engine_config(model_dir), tensor_parallel_size=2)
    expected = LLM(str(model_dir), device="cpu", dtype="float32").generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    engine = AsyncLLM(config)
    texts = []

    async def complete(client: httpx.AsyncClient) -> None:
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])

    try:
        with_app(engine, complete)
    finally:
        engine.close()
    assert texts == [expected]
