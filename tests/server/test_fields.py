"""Every request field either works as vLLM documents it, is output-neutral, or is refused
with a 400 naming it: a table that must list every field of both request models, and one
test or more per field that changes the output."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from helpers import make_model_with_tokenizer
from tokenmill.engine.frontend.async_llm import AsyncLLM
from tokenmill.engine.config import EngineConfig
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from tokenmill.entrypoints.openai.serving import ServingContext, ServingOptions

from .conftest import MAX_MODEL_LEN, MODEL_NAME, LiveServer, with_app

CHAT = [{"role": "user", "content": "hi"}]
PROMPT = "def add(a, b):"
GREEDY = {"temperature": 0, "max_tokens": 4}
IDS = list(range(5, 45))  # a token-id prompt long enough to fill prefix-cache blocks

OUTPUT = "changes the output"
NEUTRAL = "output-neutral (documented)"
REFUSED = "refused"

# field: (category, a value: for REFUSED one that is refused, for NEUTRAL one that is taken;
# OUTPUT fields are tested one by one below, and by test_openai_api.py and test_errors.py)
SHARED: dict[str, tuple[str, Any]] = {
    "model": (OUTPUT, None), "temperature": (OUTPUT, None), "top_p": (OUTPUT, None), "top_k": (OUTPUT, None),
    "min_p": (OUTPUT, None), "n": (OUTPUT, None), "stop": (OUTPUT, None), "stop_token_ids": (OUTPUT, None),
    "seed": (OUTPUT, None), "presence_penalty": (OUTPUT, None), "frequency_penalty": (OUTPUT, None),
    "repetition_penalty": (OUTPUT, None), "stream": (OUTPUT, None), "stream_options": (OUTPUT, None),
    "ignore_eos": (OUTPUT, None), "min_tokens": (OUTPUT, None), "include_stop_str_in_output": (OUTPUT, None),
    "skip_special_tokens": (OUTPUT, None), "logit_bias": (OUTPUT, None), "prompt_logprobs": (OUTPUT, None),
    "return_token_ids": (OUTPUT, None), "return_tokens_as_token_ids": (OUTPUT, None),
    "truncate_prompt_tokens": (OUTPUT, None), "priority": (OUTPUT, None), "request_id": (OUTPUT, None),
    "max_tokens": (OUTPUT, None), "logprobs": (OUTPUT, None),
    "user": (NEUTRAL, "user-1"), "metadata": (NEUTRAL, {"team": "x"}), "store": (NEUTRAL, False),
    "service_tier": (NEUTRAL, "auto"), "cache_salt": (NEUTRAL, "salt"),
    "prediction": (NEUTRAL, {"type": "content", "content": "x"}),
    "response_format": (OUTPUT, None), "functions": (REFUSED, [{"name": "f"}]), "function_call": (REFUSED, "auto"),
    "guided_json": (OUTPUT, None), "guided_regex": (OUTPUT, None), "guided_choice": (OUTPUT, None),
    "guided_grammar": (OUTPUT, None), "structured_outputs": (OUTPUT, None),
    "best_of": (REFUSED, 2), "use_beam_search": (REFUSED, True), "length_penalty": (REFUSED, 0.5),
    "allowed_token_ids": (REFUSED, [5]), "bad_words": (REFUSED, ["x"]), "logits_processors": (REFUSED, ["p"]),
    "prompt_embeds": (REFUSED, "AAAA"), "vllm_xargs": (REFUSED, {"k": 1}), "kv_transfer_params": (REFUSED, {}),
    "audio": (REFUSED, {"voice": "x"}), "modalities": (REFUSED, ["text", "audio"]),
    "spaces_between_special_tokens": (REFUSED, False),
}
COMPLETION_ONLY: dict[str, tuple[str, Any]] = {
    "prompt": (OUTPUT, None), "echo": (OUTPUT, None), "suffix": (REFUSED, "end"),
    "add_special_tokens": (OUTPUT, None),
}
CHAT_ONLY: dict[str, tuple[str, Any]] = {
    "messages": (OUTPUT, None), "max_completion_tokens": (OUTPUT, None), "top_logprobs": (OUTPUT, None),
    "echo": (OUTPUT, None), "add_generation_prompt": (OUTPUT, None), "continue_final_message": (OUTPUT, None),
    "chat_template": (OUTPUT, None), "chat_template_kwargs": (OUTPUT, None),
    "documents": (REFUSED, [{"text": "x"}]), "reasoning_effort": (REFUSED, "low"),
    "mm_processor_kwargs": (REFUSED, {"k": 1}), "add_special_tokens": (OUTPUT, None),
    "tools": (OUTPUT, None), "tool_choice": (OUTPUT, None), "parallel_tool_calls": (OUTPUT, None),  # test_tools.py
    "include_reasoning": (OUTPUT, None),  # test_reasoning.py
}
MESSAGE: dict[str, str] = {  # a chat message's fields, each handed to the chat template
    "role": OUTPUT, "content": OUTPUT, "name": OUTPUT, "tool_calls": OUTPUT, "tool_call_id": OUTPUT,
    "reasoning": OUTPUT, "reasoning_content": OUTPUT,  # test_reasoning.py
}
TABLES = {
    "/v1/completions": (CompletionRequest, SHARED | COMPLETION_ONLY, {"prompt": PROMPT}),
    "/v1/chat/completions": (ChatCompletionRequest, SHARED | CHAT_ONLY, {"messages": CHAT}),
}


@pytest.mark.parametrize("path", list(TABLES))
def test_every_field_is_in_the_table(path: str) -> None:
    """A new field must be classified here before it can ship: none is ignored silently."""
    model, table, _ = TABLES[path]
    assert set(model.model_fields) == set(table), set(model.model_fields) ^ set(table)


def test_every_message_field_is_in_the_table() -> None:
    """A message's fields reach the template: a new one must say so here too."""
    assert set(ChatMessage.model_fields) == set(MESSAGE), set(ChatMessage.model_fields) ^ set(MESSAGE)
    full = {name: "x" for name in MESSAGE} | {"tool_calls": [{"id": "c", "function": {"name": "f",
                                                                                     "arguments": "{}"}}]}
    assert set(ChatMessage.model_validate(full).for_template()) == set(MESSAGE)


CASES = [(path, name) for path, (_, table, _) in TABLES.items() for name, (kind, _) in table.items()
         if kind != OUTPUT]


@pytest.mark.parametrize("path, name", CASES)
def test_neutral_taken_refused_named(path: str, name: str, http: httpx.Client) -> None:
    _, table, base = TABLES[path]
    kind, value = table[name]
    response = http.post(path, json={"model": MODEL_NAME, "max_tokens": 2, **base, name: value})
    if kind == NEUTRAL:
        assert response.status_code == 200, response.text
    else:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == name


def test_unknown_fields_are_taken_and_logged_once(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tokenmill.entrypoints.openai.protocol")
    for _ in range(2):
        response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1,
                                                      "frobnicate_level": 3})
        assert response.status_code == 200, response.text
    assert sum("frobnicate_level" in r.getMessage() for r in caplog.records) == 1


# ------------------------------------------------------------------ vLLM's extensions


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


def test_completion_prompt_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=IDS[:6], **GREEDY,
                                    extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    choice = out.model_dump()["choices"][0]
    lp = choice["prompt_logprobs"]
    assert len(lp) == 6 and lp[0] is None
    for token_id, entry in zip(IDS[1:6], lp[1:]):
        assert str(token_id) in entry and 2 <= len(entry) <= 3
        assert all(set(v) == {"logprob", "rank", "decoded_token"} and v["logprob"] <= 0 for v in entry.values())
        ranked = sorted(v["rank"] for k, v in entry.items() if k != str(token_id) or v["rank"] is not None)
        assert ranked[:2] == [1, 2]


def test_prompt_logprobs_whole_vocabulary(client: openai.OpenAI, server: LiveServer) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=IDS[:3], **GREEDY, extra_body={"prompt_logprobs": -1})
    entries = out.model_dump()["choices"][0]["prompt_logprobs"][1:]
    assert [len(e) for e in entries] == [server.engine.vocab_size] * 2
    for entry in entries:
        ranks = [v["rank"] for v in sorted(entry.values(), key=lambda v: -v["logprob"])]
        assert ranks[0] == 1 and ranks == sorted(ranks) and ranks[-1] <= len(entry)


def test_chat_prompt_logprobs_at_the_top(http: httpx.Client) -> None:
    body = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": CHAT, **GREEDY,
                                                   "prompt_logprobs": 0}).json()
    assert body["prompt_logprobs"][0] is None
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in body["prompt_logprobs"][1:])


def test_return_token_ids_completions(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=IDS[:8], **GREEDY, logprobs=0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.prompt_token_ids == IDS[:8] and len(whole.token_ids) == 4
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)]
    assert chunks[0].prompt_token_ids == IDS[:8]
    assert all(c.prompt_token_ids is None for c in chunks[1:])
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    plain = client.completions.create(model=MODEL_NAME, prompt=IDS[:8], **GREEDY).choices[0]
    assert plain.token_ids is None and plain.prompt_token_ids is None


def test_return_token_ids_chat(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, messages=CHAT, **GREEDY, extra_body={"return_token_ids": True,
                                                                         "ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    assert len(whole.prompt_token_ids) == whole.usage.prompt_tokens and len(whole.choices[0].token_ids) == 4
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids
    assert all("prompt_token_ids" not in c.model_dump() for c in chunks[1:])
    assert [t for c in chunks for t in (c.choices[0].token_ids or [])] == whole.choices[0].token_ids


def test_return_tokens_as_token_ids(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY, logprobs=1,
                                    extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = out.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    assert all(key.startswith("token_id:") for top in choice.logprobs.top_logprobs for key in top)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, **GREEDY, logprobs=True, top_logprobs=1,
                                          extra_body={"return_tokens_as_token_ids": True})
    assert all(t.token.startswith("token_id:") for t in chat.choices[0].logprobs.content)


def test_continuous_usage_stats(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, **GREEDY, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 4 and chunks[-1].choices == []
    chat = list(client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, **GREEDY, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chat) and chat[-1].usage.completion_tokens == 4


def test_truncate_prompt_tokens(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=IDS, **GREEDY,
                                    extra_body={"truncate_prompt_tokens": 5, "return_token_ids": True})
    assert out.usage.prompt_tokens == 5 and out.choices[0].prompt_token_ids == IDS[-5:]
    too_long = [7] * (MAX_MODEL_LEN + 20)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=too_long, **GREEDY)
    cut = client.completions.create(model=MODEL_NAME, prompt=too_long, **GREEDY,
                                    extra_body={"truncate_prompt_tokens": 10})
    assert cut.usage.prompt_tokens == 10
    whole = client.completions.create(model=MODEL_NAME, prompt=IDS, **GREEDY,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(IDS)


def test_top_logprobs_whole_vocabulary(client: openai.OpenAI, server: LiveServer) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=2,
                                         logprobs=True, top_logprobs=-1)
    content = out.choices[0].logprobs.content
    assert len(content) == 2
    assert all(len(t.top_logprobs) == server.engine.vocab_size for t in content)


def test_chat_echo_and_continue_final_message(client: openai.OpenAI) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "Once upon"}]
    kwargs = dict(model=MODEL_NAME, messages=messages, **GREEDY,
                  extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    assert whole.startswith("Once upon")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True,
                                                                                                 **kwargs))
    assert streamed == whole
    plain = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, **GREEDY, extra_body={"echo": True})
    assert plain.choices[0].message.role == "assistant"
    assert not plain.choices[0].message.content.startswith("hi")  # a user message is not the reply's


def test_reply_continues_the_last_role(http: httpx.Client) -> None:
    """Without a generation prompt the reply continues the last message, in its role."""
    body = {"model": MODEL_NAME, "messages": CHAT, **GREEDY, "add_generation_prompt": False, "echo": True}
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith("hi")


def chat_prompt_tokens(client: openai.OpenAI, messages: list[dict[str, str]] = CHAT, **extra: Any) -> int:
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=1,
                                         extra_body=extra)
    return out.usage.prompt_tokens


def test_add_generation_prompt(client: openai.OpenAI) -> None:
    assert chat_prompt_tokens(client, add_generation_prompt=False) < chat_prompt_tokens(client)


def test_chat_template_and_kwargs(client: openai.OpenAI) -> None:
    literal = chat_prompt_tokens(client, chat_template="hello there friend")
    assert literal != chat_prompt_tokens(client, chat_template="hello")
    assert chat_prompt_tokens(client, chat_template="{{ greeting }}",
                              chat_template_kwargs={"greeting": "hello there friend"}) == literal
    with pytest.raises(openai.BadRequestError) as info:
        chat_prompt_tokens(client, chat_template="{% if %}")
    assert info.value.param == "messages"
    with pytest.raises(openai.BadRequestError):  # both at once mean nothing
        chat_prompt_tokens(client, continue_final_message=True)


def test_priority_zero_is_taken(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY, extra_body={"priority": 0})
    assert out.choices[0].finish_reason is not None


def test_request_id(http: httpx.Client) -> None:
    """The client's id names the response, behind the endpoint's prefix, as in vLLM; the
    header is echoed only by a server run with ``--enable-request-id-headers``."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, **GREEDY}
    by_field = http.post("/v1/completions", json=body | {"request_id": "job-17"})
    assert by_field.json()["id"] == "cmpl-job-17"
    by_header = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": CHAT, **GREEDY},
                          headers={"X-Request-Id": "trace-9"})
    assert by_header.json()["id"] == "chatcmpl-trace-9" and "x-request-id" not in by_header.headers
    with http.stream("POST", "/v1/completions", json=body | {"stream": True},
                     headers={"X-Request-Id": "trace-10"}) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert {e["id"] for e in events} == {"cmpl-trace-10"}


def test_logit_bias(client: openai.OpenAI, http: httpx.Client, server: LiveServer) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, **GREEDY, extra_body={"ignore_eos": True,
                                                                         "return_token_ids": True})
    forced = client.completions.create(**kwargs, logit_bias={"7": 100}).choices[0]
    assert forced.token_ids == [7] * 4
    first = client.completions.create(**kwargs).choices[0].token_ids[0]
    banned = client.completions.create(**kwargs, logit_bias={str(first): -100}).choices[0]
    assert first not in banned.token_ids
    bad_key = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT,
                                                 "logit_bias": {"not_a_token_id": 1}})
    assert bad_key.status_code == 400 and "not_a_token_id" in bad_key.json()["error"]["message"]
    vocab = server.engine.vocab_size
    outside = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT,
                                                 "logit_bias": {str(vocab): 1}})
    assert outside.status_code == 400 and str(vocab) in outside.json()["error"]["message"]


# ------------------------------------------------------------------ server options


@pytest.fixture()
def serving_options(server: LiveServer) -> Iterator[Callable[..., None]]:
    """Switches server options of the running server for one test."""
    ctx: ServingContext = server.app.state.serving
    original = ctx.options

    def switch(**options: bool) -> None:
        ctx.options = ServingOptions(**options)

    yield switch
    ctx.options = original


def test_enable_prompt_tokens_details(client: openai.OpenAI, serving_options: Callable[..., None]) -> None:
    assert client.completions.create(model=MODEL_NAME, prompt=IDS, **GREEDY).usage.prompt_tokens_details is None
    serving_options(enable_prompt_tokens_details=True)
    client.completions.create(model=MODEL_NAME, prompt=IDS, **GREEDY)
    again = client.completions.create(model=MODEL_NAME, prompt=IDS, **GREEDY).usage
    assert 0 < again.prompt_tokens_details.cached_tokens < len(IDS)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, **GREEDY, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details is not None


def test_enable_force_include_usage(client: openai.OpenAI, serving_options: Callable[..., None]) -> None:
    serving_options(enable_force_include_usage=True)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY, stream=True))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_server_return_tokens_as_token_ids(client: openai.OpenAI, serving_options: Callable[..., None]) -> None:
    serving_options(return_tokens_as_token_ids=True)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY, logprobs=0)
    assert all(t.startswith("token_id:") for t in out.choices[0].logprobs.tokens)


def _model_with_bos(path: Path) -> Path:
    """A tiny model whose tokenizer puts a BOS in front of every text it encodes."""
    from tokenizers import Tokenizer, processors

    make_model_with_tokenizer("llama3", path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos = "<|endoftext|>"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def test_add_special_tokens(tmp_path: Path) -> None:
    """A text prompt gets the tokenizer's special tokens unless told not to; a chat prompt
    only the template's unless told to add them (the usage shows the prompt's length)."""
    config = EngineConfig(model=str(_model_with_bos(tmp_path)), device="cpu", dtype="float32", max_model_len=128,
                          num_kv_blocks=64)
    engine = AsyncLLM(config, core_in_thread=True)

    async def test(http: httpx.AsyncClient) -> None:
        async def prompt_tokens(path: str, body: dict) -> int:
            response = await http.post(path, json={"model": MODEL_NAME, **GREEDY, **body})
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens"]

        plain = await prompt_tokens("/v1/completions", {"prompt": PROMPT})
        assert await prompt_tokens("/v1/completions", {"prompt": PROMPT, "add_special_tokens": False}) == plain - 1
        chat = await prompt_tokens("/v1/chat/completions", {"messages": CHAT})
        assert await prompt_tokens("/v1/chat/completions", {"messages": CHAT, "add_special_tokens": True}) == chat + 1

    try:
        with_app(engine, test)
    finally:
        engine.close()
