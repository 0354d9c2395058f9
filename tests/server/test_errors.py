"""A table of bad inputs: each gets its documented status and OpenAI error body, and the
server keeps answering afterwards."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from .conftest import MAX_MODEL_LEN, MODEL_NAME, LiveServer

CHAT = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


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


JSON = {"Content-Type": "application/json"}
SURROGATE = "ab\ud800"  # json.dumps writes it as the escape "ab\\ud800", which JSON parsers accept

# name: (path, raw body, param, code) for input the HTTP boundary refuses with a 400
# invalid_request_error; each of these was a 200 that ignored the field, or a 500.
BOUNDARY = {
    "response_format of an unknown type": ("/v1/chat/completions", chat(response_format={"type": "xml"}),
                                           "response_format", "invalid_value"),
    "response_format json_schema without a schema": ("/v1/completions",
                                                     completion(response_format={"type": "json_schema"}),
                                                     "response_format", "invalid_value"),
    "tool_choice without tools": ("/v1/chat/completions", chat(tool_choice="required"), "tool_choice",
                                  "invalid_value"),
    "tools without --enable-auto-tool-choice": ("/v1/chat/completions", chat(tools=TOOLS), "tool_choice",
                                                "invalid_value"),
    "tool_choice naming an unknown function": ("/v1/chat/completions",
                                               chat(tools=TOOLS, tool_choice={"type": "function",
                                                                              "function": {"name": "g"}}),
                                               "tool_choice", "invalid_value"),
    "tool_choice of an unknown kind": ("/v1/chat/completions", chat(tools=TOOLS, tool_choice="always"),
                                       "tool_choice", "invalid_value"),
    "tool_choice of a wrong type": ("/v1/chat/completions", chat(tools=TOOLS, tool_choice=1), "tool_choice",
                                    "invalid_type"),
    "a tool of another type": ("/v1/chat/completions", chat(tools=[{"type": "code", "function": {"name": "f"}}],
                                                            tool_choice="none"), "tools[0].type", "invalid_value"),
    "a function name with a space": ("/v1/chat/completions",
                                     chat(tools=[{"type": "function", "function": {"name": "get weather"}}],
                                          tool_choice="none"), "tools[0].function.name", "invalid_value"),
    "two functions of one name": ("/v1/chat/completions", chat(tools=TOOLS * 2, tool_choice="none"),
                                  "tools[1].function.name", "invalid_value"),
    "parameters not of type object": ("/v1/chat/completions",
                                      chat(tools=[{"type": "function", "function": {
                                          "name": "f", "parameters": {"type": "string"}}}], tool_choice="none"),
                                      "tools[0].function.parameters", "invalid_value"),
    "parameters that are no JSON schema": ("/v1/chat/completions",
                                           chat(tools=[{"type": "function", "function": {
                                               "name": "f", "parameters": {"type": "object", "properties": {
                                                   "a": {"type": "nonsense"}}}}}], tool_choice="required"),
                                           "tools[0].function.parameters", "invalid_value"),
    "tool_choice required beside response_format": ("/v1/chat/completions",
                                                     chat(tools=TOOLS, tool_choice="required",
                                                          response_format={"type": "json_object"}),
                                                     "response_format", "invalid_value"),
    "an assistant's tool call without its function": ("/v1/chat/completions", chat(messages=[
        *CHAT, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function"}]}]),
        "messages[1].tool_calls[0].function", "invalid_value"),
    "functions": ("/v1/chat/completions", chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
    "function_call": ("/v1/chat/completions", chat(function_call="auto"), "function_call", "unsupported_parameter"),
    "logit_bias key not a token id": ("/v1/completions", completion(logit_bias={"not_a_token_id": 1}),
                                      "logit_bias", "invalid_value"),
    "logit_bias value a string": ("/v1/chat/completions", chat(logit_bias={"5": "x"}), "logit_bias.5",
                                  "invalid_type"),
    "best_of": ("/v1/completions", completion(best_of=3), "best_of", "unsupported_parameter"),
    "use_beam_search": ("/v1/completions", completion(use_beam_search=True), "use_beam_search",
                        "unsupported_parameter"),
    "spaces_between_special_tokens false": ("/v1/completions", completion(spaces_between_special_tokens=False),
                                            "spaces_between_special_tokens", "unsupported_parameter"),
    "documents": ("/v1/chat/completions", chat(documents=[{"text": "x"}]), "documents", "unsupported_parameter"),
    "truncate_prompt_tokens zero": ("/v1/completions", completion(truncate_prompt_tokens=0),
                                    "truncate_prompt_tokens", "invalid_value"),
    "truncate_prompt_tokens -2": ("/v1/completions", completion(truncate_prompt_tokens=-2),
                                  "truncate_prompt_tokens", "invalid_value"),
    "prompt_logprobs while streaming": ("/v1/completions", completion(prompt_logprobs=1, stream=True),
                                        "prompt_logprobs", "invalid_value"),
    "priority without the priority policy": ("/v1/chat/completions", chat(priority=5), "priority",
                                             "invalid_value"),
    "top_logprobs -2": ("/v1/chat/completions", chat(logprobs=True, top_logprobs=-2), "top_logprobs",
                        "invalid_value"),
    "guided_json a number": ("/v1/completions", completion(guided_json=5), "guided_json", "invalid_value"),
    "guided_regex empty": ("/v1/chat/completions", chat(guided_regex=""), "guided_regex", "invalid_value"),
    "guided_choice empty": ("/v1/completions", completion(guided_choice=[]), "guided_choice", "invalid_value"),
    "guided_grammar not text": ("/v1/completions", completion(guided_grammar=["a"]), "guided_grammar",
                                "invalid_value"),
    "structured_outputs of two kinds": ("/v1/chat/completions", chat(structured_outputs={"regex": "a", "choice": ["b"]}),
                                        "structured_outputs", "invalid_value"),
    "two structured output fields": ("/v1/completions", completion(guided_regex="a", guided_choice=["b"]),
                                     "guided_choice", "invalid_value"),
    "stream_options without stream": ("/v1/completions", completion(stream_options={"include_usage": True}),
                                      "stream_options", "invalid_value"),
    "stream_options with stream false": ("/v1/chat/completions",
                                         chat(stream=False, stream_options={"include_usage": True}),
                                         "stream_options", "invalid_value"),
    "surrogate in prompt": ("/v1/completions", completion(prompt=SURROGATE), "prompt", "invalid_value"),
    "surrogate in a prompt batch": ("/v1/completions", completion(prompt=["ok", SURROGATE]), "prompt[1]",
                                    "invalid_value"),
    "surrogate in stop": ("/v1/completions", completion(stop=SURROGATE), "stop", "invalid_value"),
    "surrogate in a stop list": ("/v1/completions", completion(stop=["x", SURROGATE]), "stop[1]", "invalid_value"),
    "surrogate in chat content": ("/v1/chat/completions", chat(messages=[{"role": "user", "content": SURROGATE}]),
                                  "messages[0].content", "invalid_value"),
    "surrogate in a content part": ("/v1/chat/completions", chat(messages=[
        {"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]), "messages[0].content[0].text",
                                    "invalid_value"),
    "surrogate in role": ("/v1/chat/completions", chat(messages=[{"role": SURROGATE, "content": "x"}]),
                          "messages[0].role", "invalid_value"),
    "surrogate in model": ("/v1/completions", completion(model=SURROGATE), "model", "invalid_value"),
    "empty role": ("/v1/chat/completions", chat(messages=[{"role": "", "content": "x"}]), "messages[0].role",
                   "invalid_value"),
    "role not a string": ("/v1/chat/completions", chat(messages=[{"role": 1, "content": "x"}]), "messages[0].role",
                          "invalid_type"),
    "image content part": ("/v1/chat/completions", chat(messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]),
                           "messages[0].content[0].type", "unsupported_value"),
    "content a number": ("/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]),
                         "messages[0].content", "invalid_type"),
    "NaN temperature": ("/v1/completions", completion(temperature=float("nan")), "temperature", "invalid_value"),
    "Infinity top_p": ("/v1/chat/completions", chat(top_p=float("inf")), "top_p", "invalid_value"),
    "-Infinity presence_penalty": ("/v1/completions", completion(presence_penalty=float("-inf")),
                                   "presence_penalty", "invalid_value"),
    "temperature a boolean": ("/v1/completions", completion(temperature=True), "temperature", "invalid_type"),
    "temperature a numeric string": ("/v1/completions", completion(temperature="0.5"), "temperature",
                                     "invalid_type"),
    "seed above 2**64-1": ("/v1/completions", completion(seed=2**64), "seed", "invalid_value"),
    "seed below -2**63": ("/v1/completions", completion(seed=-2**63 - 1), "seed", "invalid_value"),
    "seed a float": ("/v1/completions", completion(seed=1.5), "seed", "invalid_type"),
    "seed huge": ("/v1/completions", completion(seed=10**400), "seed", "invalid_value"),
    "n a boolean": ("/v1/completions", completion(n=True), "n", "invalid_type"),
    "max_tokens a boolean": ("/v1/completions", completion(max_tokens=True), "max_tokens", "invalid_type"),
    "max_tokens a float": ("/v1/completions", completion(max_tokens=4.0), "max_tokens", "invalid_type"),
    "max_tokens Infinity": ("/v1/completions", completion(max_tokens=float("inf")), "max_tokens", "invalid_type"),
    "max_completion_tokens negative": ("/v1/chat/completions", chat(max_completion_tokens=-3),
                                       "max_completion_tokens", "invalid_value"),
    "min_tokens negative": ("/v1/completions", completion(min_tokens=-1), "min_tokens", "invalid_value"),
    "top_k below -1": ("/v1/completions", completion(top_k=-2), "top_k", "invalid_value"),
    "top_k a float": ("/v1/completions", completion(top_k=5.5), "top_k", "invalid_type"),
    "top_k beyond 64 bits": ("/v1/completions", completion(top_k=10**400), "top_k", "invalid_value"),
    "min_tokens beyond 64 bits": ("/v1/completions", completion(max_tokens=None, min_tokens=10**30), "min_tokens",
                                  "invalid_value"),
    "prompt id beyond 64 bits": ("/v1/completions", completion(prompt=[2**63]), "prompt[0]", "invalid_value"),
    "stop_token_ids negative": ("/v1/completions", completion(stop_token_ids=[3, -1]), "stop_token_ids[1]",
                                "invalid_value"),
    "stop_token_ids a boolean": ("/v1/completions", completion(stop_token_ids=[True]), "stop_token_ids[0]",
                                 "invalid_type"),
    "completion logprobs a boolean": ("/v1/completions", completion(logprobs=True), "logprobs", "invalid_type"),
    "chat logprobs a number": ("/v1/chat/completions", chat(logprobs=1), "logprobs", "invalid_type"),
    "stream a string": ("/v1/completions", completion(stream="true"), "stream", "invalid_type"),
    "ignore_eos a number": ("/v1/completions", completion(ignore_eos=1), "ignore_eos", "invalid_type"),
    "prompt ids with a boolean": ("/v1/completions", completion(prompt=[5, True]), "prompt[1]", "invalid_type"),
    "prompt ids with a float": ("/v1/completions", completion(prompt=[5, 6.0]), "prompt[1]", "invalid_type"),
    "prompt ids mixed with text": ("/v1/completions", completion(prompt=[5, "x"]), "prompt[1]", "invalid_type"),
    "prompt id lists with an empty one": ("/v1/completions", completion(prompt=[[5], []]), "prompt[1]",
                                          "invalid_value"),
    "prompt an object": ("/v1/completions", completion(prompt={"text": "x"}), "prompt", "invalid_type"),
    "body an array": ("/v1/completions", "[]", None, "invalid_type"),
    "body a string": ("/v1/chat/completions", '"x"', None, "invalid_type"),
    "body null": ("/v1/completions", "null", None, "invalid_type"),
}


def post(http: httpx.Client, path: str, body: str) -> tuple[httpx.Response, object]:
    """The response and the local address of the connection that carried it."""
    with http.stream("POST", path, content=body, headers=JSON) as response:
        local = response.extensions["network_stream"].get_extra_info("client_addr")
        response.read()
    return response, local


@pytest.mark.parametrize("name", list(BOUNDARY))
def test_refused_at_the_boundary(name: str, http: httpx.Client) -> None:
    path, body, param, code = BOUNDARY[name]
    response, local = post(http, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                          "param": param, "code": code}
    # The keep-alive connection survives and serves the next request.
    good, good_local = post(http, "/v1/completions", completion(max_tokens=2))
    assert good.status_code == 200, good.text
    assert good_local == local


NEUTRAL = {
    "response_format": {"type": "text"},
    "tool_choice": "none",
    "logit_bias": {},
    "tools": None,
    "guided_json": None,
    "stream_options": None,
}


@pytest.mark.parametrize("field", list(NEUTRAL))
def test_neutral_values_pass(field: str, server: LiveServer) -> None:
    """Values that ask for nothing beyond plain text are not refused as unsupported."""
    out = server.client().chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2,
                                                  extra_body={field: NEUTRAL[field]})
    assert out.choices[0].message.content is not None


@pytest.mark.parametrize("kwargs, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logit_bias": {"5": "x"}}, "logit_bias.5"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_openai_client_sees_bad_request(kwargs: dict[str, Any], param: str, server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, **kwargs)
    assert info.value.status_code == 400
    assert info.value.param == param
    assert info.value.type == "invalid_request_error"


def test_integer_for_a_float_field(server: LiveServer) -> None:
    out = server.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2, temperature=1, top_p=1)
    assert out.usage.completion_tokens <= 2


def test_any_role_reaches_the_template(http: httpx.Client) -> None:
    """The template, not the schema, decides which roles exist: it renders, or refuses with
    a 400 on ``messages`` (the schema would name ``messages[0].role``)."""
    response = http.post("/v1/chat/completions", content=chat(messages=[{"role": "narrator", "content": "x"}]),
                         headers=JSON)
    if response.status_code != 200:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("messages", "invalid_value"), error
