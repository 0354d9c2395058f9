"""The official openai client drives completions and chat against the live server."""

from __future__ import annotations

import openai
import pytest

from .conftest import MODEL_NAME, LiveServer

PROMPT = "def add(a, b):"
MESSAGES = [{"role": "system", "content": "You write code."}, {"role": "user", "content": "Add two numbers."}]


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


def test_models_and_health(client: openai.OpenAI, http) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert http.get("/health").json() == {"status": "ok"}


def test_completion_n_and_usage(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=3, temperature=1.0,
                                    seed=1, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 18
    assert out.usage.total_tokens == out.usage.prompt_tokens + 18


def test_completion_prompt_batch_of_ids(client: openai.OpenAI, server: LiveServer) -> None:
    vocab = server.engine.vocab_size
    prompts = [[5, 6, 7], [(i * 7) % vocab for i in range(1, 20)]]
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=4, n=2, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 3 + 19
    assert out.usage.completion_tokens == 16


def test_same_seed_same_text(client: openai.OpenAI) -> None:
    def run(seed: int) -> list[str]:
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=1.0,
                                        n=2, seed=seed, extra_body={"ignore_eos": True})
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    assert run(1234) == run(1234)
    assert run(1234) != run(4321)


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    stop = next((full[i:i + 2] for i in range(3, len(full) - 1) if full[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip("the greedy text has no usable stop string")
    cut = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[:full.index(stop)]


def test_completion_logprobs_and_echo(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    # Greedy: the sampled token is the most likely one.
    assert all(lp.token_logprobs[i] == pytest.approx(max(top.values())) for i, top in enumerate(lp.top_logprobs))

    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                       logprobs=1, extra_body={"ignore_eos": True}).choices[0]
    assert echoed.text == PROMPT + out.choices[0].text
    assert echoed.logprobs.token_logprobs[0] is None
    assert echoed.logprobs.token_logprobs[-5:] == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_completion_stream_matches_whole(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=6, n=2,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.message.role == "assistant"
        assert choice.finish_reason == "length"
        content = choice.logprobs.content
        assert len(content) == 6
        assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
                   for t in content)
        assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy
    assert out.choices[0].message.content == out.choices[1].message.content
    assert out.usage.completion_tokens == 12


def test_chat_stream(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].delta.role == "assistant"
    assert deltas[-1].finish_reason == "length"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert "".join(d.delta.content or "" for d in deltas) == whole
    assert chunks[-1].usage.completion_tokens == 7
