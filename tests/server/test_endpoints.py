"""vLLM's endpoints beyond completions and chat: /tokenize, /detokenize, /version, the
/v1/models fields, which of them the API key guards, the vLLM-named metrics, and the
server flags that switch them."""

from __future__ import annotations

import asyncio
import importlib.metadata
import re

import httpx
import pytest

from tokenmill.engine.frontend.async_llm import AsyncLLM
from tokenmill.entrypoints import cli
from tokenmill.entrypoints.openai.metrics import VLLM_SHARED_NAMES
from tokenmill.entrypoints.openai import server as server_module
from tokenmill.entrypoints.openai.server import serving_options_from_args
from tokenmill.entrypoints.openai.serving import ServingOptions
from tokenmill.tokenizer import ChatOptions

from .conftest import MAX_MODEL_LEN, MODEL_NAME, LiveServer, with_app

PROMPT = "def add(a, b):\n    return a + b"
MESSAGES = [{"role": "system", "content": "You write code."}, {"role": "user", "content": "Add two numbers."}]


def render(server: LiveServer, options: ChatOptions = ChatOptions()) -> list[int]:
    """What a chat request over MESSAGES feeds the model, from the engine itself."""
    return asyncio.run(server.engine.render_chat(MESSAGES, options))


def test_tokenize_completion_form_round_trip(http: httpx.Client) -> None:
    out = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT, "add_special_tokens": False}).json()
    assert out["count"] == len(out["tokens"]) > 0
    assert out["max_model_len"] == MAX_MODEL_LEN
    assert out["token_strs"] is None
    assert http.post("/detokenize", json={"model": MODEL_NAME, "tokens": out["tokens"]}).json() == {"prompt": PROMPT}


def test_tokenize_has_no_length_limit(http: httpx.Client) -> None:
    """As in vLLM: the client compares count with max_model_len itself."""
    out = http.post("/tokenize", json={"prompt": "hello world " * 20_000}).json()
    assert out["count"] > out["max_model_len"]


def test_tokenize_returns_token_strs_when_asked(http: httpx.Client, server: LiveServer) -> None:
    out = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert out["token_strs"] == server.engine.tokenizer.convert_ids_to_tokens(out["tokens"])
    assert len(out["token_strs"]) == out["count"]


def test_tokenize_chat_form_is_what_a_chat_request_is_fed(http: httpx.Client, server: LiveServer) -> None:
    out = http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES}).json()
    assert out["tokens"] == render(server)
    assert out["count"] == len(out["tokens"])
    open_turn = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False,
                                              "continue_final_message": True}).json()
    assert open_turn["tokens"] == render(server, ChatOptions(add_generation_prompt=False,
                                                             continue_final_message=True))
    assert open_turn["tokens"] != out["tokens"]
    chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == out["count"]


def test_tokenize_chat_form_with_its_own_template(http: httpx.Client) -> None:
    body = {"messages": MESSAGES, "chat_template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}",
            "return_token_strs": True}
    out = http.post("/tokenize", json=body).json()
    assert http.post("/detokenize", json={"tokens": out["tokens"]}).json()["prompt"] == \
        "[You write code.][Add two numbers.]"


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"model": MODEL_NAME}, "prompt"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": 1}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{% if %}"}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, True]}, "tokens[1]"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_bad_input_is_an_openai_400(http: httpx.Client, path: str, body: dict | str, param: str) -> None:
    if isinstance(body, str):  # a lone surrogate is no str that httpx can encode as JSON
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_detokenize_names_the_vocabulary_size(http: httpx.Client, server: LiveServer) -> None:
    vocab = server.engine.vocab_size
    response = http.post("/detokenize", json={"tokens": [1, vocab]})
    assert response.status_code == 400
    assert f"size {vocab}" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "tokens"


def test_version(http: httpx.Client) -> None:
    assert http.get("/version").json() == {"version": importlib.metadata.version("tokenmill")}


def test_models_has_vllms_fields(http: httpx.Client, server: LiveServer) -> None:
    listing = http.get("/v1/models").json()
    assert listing["object"] == "list"
    [card] = listing["data"]
    assert card["id"] == MODEL_NAME and card["object"] == "model"
    assert card["root"] == server.engine.config.model
    assert card["parent"] is None
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert isinstance(card["created"], int) and card["owned_by"]
    [permission] = card["permission"]
    assert permission["id"].startswith("modelperm-")
    assert permission | {"id": None, "created": None} == {
        "id": None, "object": "model_permission", "created": None, "allow_create_engine": False,
        "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
        "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}


def test_api_key_guards_every_path_that_does_work(engine_in_thread: AsyncLLM) -> None:
    key = {"Authorization": "Bearer k"}

    async def test(client: httpx.AsyncClient) -> None:
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/v1/models", headers=key)).status_code == 200
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
            assert (await client.post(path, json=body)).status_code == 401, path
            assert (await client.post(path, json=body, headers=key)).status_code == 200, path
        for path in ("/version", "/health", "/metrics"):
            assert (await client.get(path)).status_code == 200, path
        two = [("Authorization", "Bearer k"), ("Authorization", "Bearer other")]
        for path in ("/v1/models", "/health"):
            response = await client.get(path, headers=two)
            assert response.status_code == 400 and "more than one Authorization" in response.text, path

    with_app(engine_in_thread, test, api_key="k")


def test_api_key_for_metrics(engine_in_thread: AsyncLLM) -> None:
    async def test(client: httpx.AsyncClient) -> None:
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/metrics", headers={"Authorization": "Bearer k"})).status_code == 200
        assert (await client.get("/health")).status_code == 200

    args = cli.parse_args(["serve", "--api-key", "k", "--api-key-for-metrics"])
    with_app(engine_in_thread, test, api_key=args.api_key, open_metrics=not args.api_key_for_metrics)


def test_request_id_headers(engine_in_thread: AsyncLLM) -> None:
    async def test(client: httpx.AsyncClient) -> None:
        echoed = await client.post("/tokenize", json={"prompt": "hi"}, headers={"X-Request-Id": "abc-1"})
        assert echoed.headers["x-request-id"] == "abc-1"
        made = [(await client.get("/version")).headers["x-request-id"] for _ in range(2)]
        assert len(set(made)) == 2 and all(len(i) == 32 for i in made)
        assert "x-request-id" in (await client.get("/v1/models")).headers  # a 401 too

    with_app(engine_in_thread, test, api_key="k", request_id_headers=True)


Sample = tuple[str, frozenset[tuple[str, str]]]


def _samples(text: str) -> dict[Sample, float]:
    """(name, labels) -> value, from the Prometheus text format."""
    samples: dict[Sample, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            name, _, labels = key.partition("{")
            samples[name, frozenset(re.findall(r'(\w+)="([^"]*)"', labels))] = float(value)
    return samples


def test_vllm_metric_names_carry_the_same_values(engine_in_thread: AsyncLLM) -> None:
    async def test(client: httpx.AsyncClient) -> None:
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        samples = _samples((await client.get("/metrics")).text)
        vllm_labels = frozenset({("model_name", MODEL_NAME), ("engine", "0")})
        twins = 0
        for (name, labels), value in samples.items():
            suffix = name.removeprefix("tokenmill:")
            family = re.sub(r"_(total|bucket|count|sum)$", "", suffix)
            if name.startswith("tokenmill:") and family in VLLM_SHARED_NAMES:
                assert samples[f"vllm:{suffix}", labels | vllm_labels] == value, name
                twins += 1
        assert twins >= len(VLLM_SHARED_NAMES)
        assert samples["vllm:generation_tokens_total", vllm_labels] == 4
        assert samples["vllm:e2e_request_latency_seconds_count", vllm_labels] == 1
        assert samples["vllm:request_success_total", vllm_labels | {("finished_reason", "length")}] == 1
        assert not any(name.startswith("vllm:num_failed_steps") for name, _ in samples)

    with_app(engine_in_thread, test, vllm_metrics=True)


def test_vllm_metric_names_and_request_ids_are_off_by_default(http: httpx.Client) -> None:
    response = http.get("/metrics")
    assert "tokenmill:prompt_tokens_total" in response.text and "vllm:" not in response.text
    assert "x-request-id" not in response.headers


def test_metrics_state_the_kv_cache_dtype_and_capacity(http: httpx.Client) -> None:
    samples = _samples(http.get("/metrics").text)
    assert samples["tokenmill:kv_cache_info", frozenset({("kv_cache_dtype", "auto")})] == 1
    # num_kv_blocks=512 of 16 tokens (tests/server/conftest.py), one full-attention group.
    assert samples["tokenmill:kv_cache_capacity_tokens", frozenset()] == 512 * 16
    # The CPU engine compiles no kernel; a GPU engine counts here any variant its warm-up missed.
    assert samples["tokenmill:num_compiles_after_startup_total", frozenset()] == 0


def test_serve_flags_parse() -> None:
    flags = ["--enable-prompt-tokens-details", "--enable-force-include-usage", "--return-tokens-as-token-ids",
             "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice", "--exclude-tools-when-tool-choice-none"]
    args = cli.parse_args(["serve", *flags, "--vllm-compatible-metrics", "--enable-request-id-headers"])
    assert args.vllm_compatible_metrics is True and args.enable_request_id_headers is True
    assert serving_options_from_args(args) == ServingOptions(True, True, True, "llama3_json", True, True)
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--tool-call-parser", "mistral"])
    defaults = cli.parse_args(["serve"])
    assert defaults.vllm_compatible_metrics is False and defaults.enable_request_id_headers is False
    assert serving_options_from_args(defaults) == ServingOptions()


def test_run_server_passes_the_flags_to_the_app(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wiring alone: no engine is built and no server runs."""
    built: dict[str, object] = {}

    class Engine:
        def __init__(self, *args: object, **kwargs: object) -> None: ...

        def close(self) -> None: ...

    class Server:
        def __init__(self, *args: object) -> None: ...

        def run(self) -> None: ...

    monkeypatch.setattr(server_module, "AsyncLLM", Engine)
    monkeypatch.setattr(server_module, "_DrainingServer", Server)
    monkeypatch.setattr(server_module, "build_app", lambda engine, name, **kwargs: built.update(kwargs))
    args = cli.parse_args(["serve", "--enable-force-include-usage", "--vllm-compatible-metrics",
                           "--enable-request-id-headers", "--api-key", "k"])
    assert server_module.run_server(args) == 0
    assert built == {"api_key": "k", "options": ServingOptions(enable_force_include_usage=True),
                     "vllm_metrics": True, "request_id_headers": True, "open_metrics": True}
