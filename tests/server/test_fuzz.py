"""Random request bodies against the live server: valid-looking fields mixed with JSON of
the wrong type or range (NaN, 10**400, negatives, lone surrogates, nested junk, unknown
fields). Every body gets a 200 or a 4xx with an OpenAI error body, never a 5xx, and good
requests streaming beside the fuzzer all finish with exactly their tokens."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import MAX_MODEL_LEN, MODEL_NAME, LiveServer

EXAMPLES = 250
GOOD_MAX_TOKENS = 6
QUICK_TOKENS = 8
QUICK_CHOICES = 4
ERROR_KEYS = {"message", "type", "param", "code"}

SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

texts = st.text(max_size=12)
surrogates = st.tuples(st.text(max_size=4), st.characters(categories=["Cs"])).map("".join)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), texts, surrogates)
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                    max_leaves=6)
"""Any JSON value (and the NaN/Infinity literals Python's parser takes)."""

# Values wrong in the way a type invites, which lax parsing lets through to the engine.
TEXT_EDGES = st.sampled_from(["ab\ud800", "\udfff", ""])
FLOAT_EDGES = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, True, "0.5"])
INT_EDGES = st.sampled_from([10**400, -10**400, 2**64, 2**63, -2**63 - 1, -1, 0, True, 2.0, "3"])
BOOL_EDGES = st.sampled_from([1, 0, "true", None])


def listed(edges: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    return edges.map(lambda value: [value])


@dataclass(frozen=True)
class Spec:
    """A field's values: ``valid`` ones that could be right, ``edges`` that are wrong."""

    valid: st.SearchStrategy[Any]
    edges: st.SearchStrategy[Any]


Wrap = Callable[[Spec], st.SearchStrategy[Any]]
"""How wrong a field's values may be: ``exact``, ``mixed`` or ``wrong``."""


def exact(spec: Spec) -> st.SearchStrategy[Any]:
    return spec.valid


def mixed(spec: Spec) -> st.SearchStrategy[Any]:
    """Mostly a value that could be right, else an edge or anything."""
    return st.one_of(spec.valid, spec.valid, spec.edges, junk)


def wrong(spec: Spec) -> st.SearchStrategy[Any]:
    """Mostly an edge, which gets further than random junk."""
    return st.one_of(spec.edges, spec.edges, spec.edges, junk)


def floats(low: float, high: float) -> Spec:
    return Spec(st.floats(low, high), FLOAT_EDGES)


def ints(low: int, high: int) -> Spec:
    return Spec(st.integers(low, high), INT_EDGES)


BOOL = Spec(st.booleans(), BOOL_EDGES)
TEXT = Spec(texts, TEXT_EDGES)
token_ids = st.one_of(st.integers(0, 300), st.integers(0, 300), st.integers(0, 300), st.integers(0, 10**6))
TOKEN_IDS = Spec(st.lists(token_ids, max_size=2), listed(INT_EDGES))
PROMPT = Spec(
    st.one_of(st.text(min_size=1, max_size=12), st.lists(texts, min_size=1, max_size=2),
              st.lists(token_ids, min_size=1, max_size=8),
              st.lists(st.lists(token_ids, min_size=1, max_size=4), min_size=1, max_size=2)),
    st.one_of(TEXT_EDGES, listed(TEXT_EDGES), listed(INT_EDGES), st.sampled_from([[], [[]], [[1], []]])))


def chat_messages(wrap: Wrap) -> st.SearchStrategy[list[dict[str, Any]]]:
    """Message lists whose roles, contents and text parts are ``wrap``-ed."""
    part = st.fixed_dictionaries({"type": wrap(Spec(st.just("text"), st.sampled_from(["image_url", "", None]))),
                                  "text": wrap(TEXT)})
    content = Spec(st.one_of(texts, st.lists(part, max_size=2)), st.one_of(TEXT_EDGES, listed(TEXT_EDGES)))
    role = Spec(st.sampled_from(["system", "user", "assistant"]), TEXT_EDGES)
    message = st.fixed_dictionaries({"role": wrap(role), "content": wrap(content)}, optional={"name": wrap(TEXT)})
    return st.lists(message, min_size=1, max_size=3)


MESSAGES = Spec(chat_messages(exact), st.one_of(chat_messages(mixed), chat_messages(wrong), st.just([])))
STREAM_OPTIONS = Spec(st.fixed_dictionaries({"include_usage": st.booleans()}),
                      st.one_of(BOOL_EDGES, BOOL_EDGES.map(lambda value: {"include_usage": value})))
SHARED = {
    "model": Spec(st.just(MODEL_NAME), TEXT_EDGES),
    "temperature": Spec(st.one_of(st.floats(0, 2), st.integers(0, 2)), FLOAT_EDGES),
    "top_p": floats(0.05, 1),
    "top_k": ints(-1, 50),
    "min_p": floats(0, 1),
    "n": ints(1, 3),
    "stop": Spec(st.one_of(texts, st.lists(texts, max_size=2)), st.one_of(TEXT_EDGES, listed(TEXT_EDGES))),
    "stop_token_ids": TOKEN_IDS,
    "seed": ints(-2**63, 2**64 - 1),
    "presence_penalty": floats(-2, 2),
    "frequency_penalty": floats(-2, 2),
    "repetition_penalty": floats(0.5, 2),
    "ignore_eos": BOOL,
    "min_tokens": ints(0, 1),
    "include_stop_str_in_output": BOOL,
    "skip_special_tokens": BOOL,
    "user": TEXT,
    "response_format": Spec(st.just({"type": "text"}), st.just({"type": "json_object"})),
    "tool_choice": Spec(st.just("none"), st.just("auto")),
    "logit_bias": Spec(st.just({}), st.just({"1": float("nan")})),
}


def streaming(wrap: Wrap) -> st.SearchStrategy[dict[str, Any]]:
    """Whether to stream, with stream_options only beside ``stream: true`` (unless ``wrap``
    makes it wrong), which is where they are valid."""
    return st.one_of(
        st.just({}),
        st.fixed_dictionaries({"stream": wrap(BOOL)}),
        st.fixed_dictionaries({"stream": wrap(Spec(st.just(True), BOOL_EDGES)),
                               "stream_options": wrap(STREAM_OPTIONS)}))


def _within(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low < value < high


def quick(body: dict[str, Any]) -> bool:
    """Whether the engine, should it take ``body``, finishes it fast. A valid body that asks
    for many tokens (null: up to max_model_len) or many choices tests nothing more than a
    small one, only slowly."""
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    long_output = limit is None or _within(limit, QUICK_TOKENS, MAX_MODEL_LEN)
    many_choices = _within(body.get("n"), QUICK_CHOICES, 128 + 1)  # above 128 is refused at once
    return not (long_output or many_choices)


def objects(specs: dict[str, Spec], required: set[str], wrap: Wrap) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with the required fields, some others and some unknown names; ``wrap``
    decides how wrong the values may be."""
    return st.tuples(
        st.dictionaries(texts, junk, max_size=2),
        streaming(wrap),
        st.fixed_dictionaries({k: wrap(v) for k, v in specs.items() if k in required},
                              optional={k: wrap(v) for k, v in specs.items() if k not in required}),
    ).map(lambda layers: layers[0] | layers[1] | layers[2])


def with_one_wrong(specs: dict[str, Spec],
                   body: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """``body`` with one field (stream too) set to an edge or junk: the rest being right, the
    wrong value gets as far as anything lets it."""
    every = specs | {"stream": BOOL, "stream_options": STREAM_OPTIONS}
    one = st.sampled_from(sorted(every)).flatmap(lambda name: wrong(every[name]).map(lambda value: {name: value}))
    return st.tuples(body, one).map(lambda pair: pair[0] | pair[1])


def bodies(endpoint_specs: dict[str, Spec], required: set[str]) -> st.SearchStrategy[str | bytes]:
    """Raw request bodies, mostly objects: all values plausible (so that the engine runs
    many), one value wrong, or many; sometimes any JSON value, text or bytes."""
    specs = SHARED | endpoint_specs
    plausible = objects(specs, required, exact)
    one_wrong = with_one_wrong(specs, plausible)
    many_wrong = objects(specs, required, mixed)
    some = st.one_of(plausible, plausible, one_wrong, one_wrong, one_wrong, one_wrong, many_wrong)
    json_bodies = some.filter(quick).map(json.dumps)
    return st.one_of(json_bodies, json_bodies, json_bodies, json_bodies, json_bodies, json_bodies,
                     junk.map(json.dumps), st.text(max_size=20), st.binary(max_size=20))


MAX_TOKENS = ints(1, 4)
COMPLETION_BODIES = bodies(
    {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "logprobs": ints(0, 5), "echo": BOOL,
     "suffix": Spec(st.just(""), TEXT_EDGES)},
    required={"prompt", "max_tokens"})
CHAT_BODIES = bodies(
    {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "max_completion_tokens": MAX_TOKENS, "logprobs": BOOL,
     "top_logprobs": ints(0, 5)},
    required={"messages", "max_tokens"})


def check_response(http: httpx.Client, path: str, body: str | bytes) -> None:
    """A 200 with choices (a stream without error events), or a 4xx OpenAI error."""
    response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    status = response.status_code
    assert status == 200 or 400 <= status < 500, f"{status} for {body!r}: {response.text}"
    if status != 200:
        error = response.json()["error"]
        assert set(error) == ERROR_KEYS and error["message"], response.text
        assert error["type"] == "invalid_request_error", response.text
    elif response.headers["content-type"].startswith("text/event-stream"):
        # split("\n"), not splitlines(), which also breaks at U+0085 and U+2028 inside the JSON
        events = [line[len("data: "):] for line in response.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", response.text
        assert not [e for e in events[:-1] if "error" in json.loads(e)], f"{body!r}: {response.text}"
    else:
        assert response.json()["choices"], response.text


class GoodTraffic:
    """Well-formed streaming completions, one after another on a thread, while the fuzzer
    runs: each must end by length with exactly GOOD_MAX_TOKENS tokens."""

    def __init__(self, server: LiveServer) -> None:
        self.client = server.client()
        self.stop = threading.Event()
        self.results: list[tuple[int | None, int, str | None]] = []
        self.errors: list[BaseException] = []

    def one(self, i: int) -> tuple[int | None, int, str | None]:
        """(tokens by usage, tokens seen in logprobs, finish reason) of one stream."""
        stream = self.client.completions.create(
            model=MODEL_NAME, prompt=f"# good request {i}\n", max_tokens=GOOD_MAX_TOKENS, temperature=0.7, seed=i,
            logprobs=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage, seen, reason = None, 0, None
        for chunk in stream:
            for choice in chunk.choices:
                seen += len(choice.logprobs.tokens)
                reason = choice.finish_reason or reason
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return usage, seen, reason

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            try:
                self.results.append(self.one(i))
            except Exception as exc:  # reported by the test, which is what it is for
                self.errors.append(exc)
            i += 1


@contextmanager
def good_traffic(server: LiveServer) -> Iterator[GoodTraffic]:
    traffic = GoodTraffic(server)
    thread = threading.Thread(target=traffic.run, daemon=True)
    thread.start()
    try:
        yield traffic
    finally:
        traffic.stop.set()
        thread.join(60)
    assert not traffic.errors, traffic.errors
    assert traffic.results, "no good request finished while the fuzzer ran"
    assert set(traffic.results) == {(GOOD_MAX_TOKENS, GOOD_MAX_TOKENS, "length")}, traffic.results


def fuzz(server: LiveServer, http: httpx.Client, path: str, strategy: st.SearchStrategy[str | bytes]) -> None:
    """Runs the fuzzer inside good traffic. The property is an inner function so that one
    stream of good requests spans all its examples."""

    @SETTINGS
    @given(body=strategy)
    def property_(body: str | bytes) -> None:
        check_response(http, path, body)

    with good_traffic(server):
        property_()
    assert http.get("/health").status_code == 200


def test_fuzz_completions(server: LiveServer, http: httpx.Client) -> None:
    fuzz(server, http, "/v1/completions", COMPLETION_BODIES)


def test_fuzz_chat(server: LiveServer, http: httpx.Client) -> None:
    fuzz(server, http, "/v1/chat/completions", CHAT_BODIES)
