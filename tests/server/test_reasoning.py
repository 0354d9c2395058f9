"""Reasoning parsers through the server and the official client: thinking split off whole and
streamed, the prompt's state read from its ids (a template that opens the block, one that closes
it), a thought that never closes, deepseek_r1, default chat template kwargs, earlier thoughts sent
back to the template, and tools read from the answer only.

The model follows a fixed script: its layers add nothing (zero output projections), so each
logit row depends only on the current token, and the output head maps each token of the script
to the next one: ``<|assistant|>`` → ``<think>`` → the quick → ``</think>`` → ``\\n`` brown fox
→ end. Whatever the prompt leaves open, the reply carries on from its last token."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tokenmill.engine.config import EngineConfig
from tokenmill.entrypoints.openai.chat import _message, _StreamedReply
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.reasoning_parsers import PromptState, Qwen3ReasoningParser
from tokenmill.entrypoints.openai.serving import ServingContext, ServingOptions
from tokenmill.entrypoints.openai.tool_parsers import HermesToolParser
from tokenmill.entrypoints.openai.tools import ToolPlan
from tokenmill.outputs import CompletionOutput

from .conftest import MODEL_NAME, LiveServer, live_server

QWEN3_LIKE = (
    "{%- for m in messages -%}<|{{ m.role }}|>"
    "{%- if m.reasoning_content is defined and m.reasoning_content -%}<think>{{ m.reasoning_content }}</think>"
    "{%- endif -%}{{ m.content }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking is false -%}<think></think>{%- endif -%}{%- endif -%}"
)
OPENS_THINKING = (  # DeepSeek-R1's way (and Qwen3's thinking-only models'): the prompt opens the block
    "{%- for m in messages -%}<|{{ m.role }}|>{{ m.content }}<|end|>{%- endfor -%}<|assistant|><think>"
)
SCRIPT = ["<|assistant|>", "<think>", "the", " quick", "</think>", "\n", " brown", " fox", "<|endoftext|>"]
ASK = [{"role": "user", "content": "the fox?"}]
REASONING, CONTENT = "the quick", "brown fox"
QWEN3 = ServingOptions(reasoning_parser="qwen3", trust_request_chat_template=True,
                       enable_auto_tool_choice=True)


def build_scripted_model(directory: Path) -> Path:
    """A one-layer Llama that writes SCRIPT's next token after each of its tokens (greedy), with a
    tokenizer that has ``<think>`` and ``</think>`` as tokens of their own (not special ones, as in
    Qwen3: they show in the text) and a Qwen3-like chat template."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog\n"] * 8, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    bpe.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tokenizer.chat_template = QWEN3_LIKE
    tokenizer.save_pretrained(directory)
    ids = [tokenizer.encode(piece, add_special_tokens=False) for piece in SCRIPT]
    assert all(len(i) == 1 for i in ids), ids
    script = [i[0] for i in ids]

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=None, eos_token_id=script[-1], pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.normal_(0, 0.02)
        model.lm_head.weight.zero_()
        for k, (token, following) in enumerate(itertools.pairwise(script)):
            model.model.embed_tokens.weight[token] = 0
            model.model.embed_tokens.weight[token, k] = 1.0
            model.lm_head.weight[following, k] = 10.0
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    directory = build_scripted_model(tmp_path_factory.mktemp("scripted"))
    config = EngineConfig(model=str(directory), device="cpu", dtype="float32", max_num_seqs=8, max_model_len=256,
                          num_kv_blocks=128)
    with live_server(config, options=QWEN3) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture()
def options(server: LiveServer) -> Iterator[ServingContext]:
    """The server's context, whose options a test may switch; they are put back after it."""
    ctx: ServingContext = server.app.state.serving
    yield ctx
    ctx.options = QWEN3


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL_NAME, messages=kwargs.pop("messages", ASK), temperature=0,
                                          max_tokens=kwargs.pop("max_tokens", 16), **kwargs)


def streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, str, list[str], str | None]:
    """(reasoning, content, the kinds of the deltas in order with repeats collapsed, finish_reason) of a
    stream (a slow reader may get two steps' deltas merged into one chunk)."""
    reasoning = content = ""
    kinds: list[str] = []
    finish = None
    for chunk in chat(client, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        if extra.get("reasoning"):
            reasoning += extra["reasoning"]
            kinds += [] if kinds[-1:] == ["reasoning"] else ["reasoning"]
        if delta.content:
            content += delta.content
            kinds += [] if kinds[-1:] == ["content"] else ["content"]
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, kinds, finish


def thought(message: Any) -> str | None:
    extra = message.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")
    return extra.get("reasoning")


def test_the_reply_is_split_whole_and_streamed(client: openai.OpenAI) -> None:
    out = chat(client)
    message = out.choices[0].message
    assert (thought(message), message.content, out.choices[0].finish_reason) == (REASONING, CONTENT, "stop")
    reasoning, content, kinds, finish = streamed(client)
    assert (reasoning, content, finish) == (REASONING, CONTENT, "stop")
    assert kinds == ["reasoning", "content"]


def test_a_prompt_that_opens_the_block(client: openai.OpenAI) -> None:
    out = chat(client, extra_body={"chat_template": OPENS_THINKING})
    assert (thought(out.choices[0].message), out.choices[0].message.content) == (REASONING, CONTENT)
    assert streamed(client, extra_body={"chat_template": OPENS_THINKING})[:2] == (REASONING, CONTENT)


def test_a_prompt_that_closes_the_block(client: openai.OpenAI) -> None:
    """enable_thinking false: the template writes an empty block, and the reply is the answer."""
    body = {"chat_template_kwargs": {"enable_thinking": False}}
    out = chat(client, extra_body=body)
    assert (thought(out.choices[0].message), out.choices[0].message.content) == (None, CONTENT)
    assert "reasoning" not in out.choices[0].message.model_dump()
    assert streamed(client, extra_body=body)[:3] == ("", CONTENT, ["content"])


def test_a_thought_that_never_closes(client: openai.OpenAI) -> None:
    out = chat(client, max_tokens=3)
    choice = out.choices[0]
    assert (thought(choice.message), choice.message.content, choice.finish_reason) == (REASONING, None, "length")
    assert streamed(client, max_tokens=3) == (REASONING, "", ["reasoning"], "length")


def test_deepseek_r1(client: openai.OpenAI, options: ServingContext) -> None:
    options.options = ServingOptions(reasoning_parser="deepseek_r1", trust_request_chat_template=True)
    out = chat(client, extra_body={"chat_template": OPENS_THINKING})
    assert (thought(out.choices[0].message), out.choices[0].message.content) == (REASONING, CONTENT)
    assert streamed(client, extra_body={"chat_template": OPENS_THINKING})[:2] == (REASONING, CONTENT)
    cut = chat(client, max_tokens=2, extra_body={"chat_template": OPENS_THINKING})  # no </think> yet
    assert (thought(cut.choices[0].message), cut.choices[0].message.content) == (REASONING, None)


def test_without_a_parser_the_thinking_stays_in_content(client: openai.OpenAI, options: ServingContext) -> None:
    options.options = ServingOptions()
    message = chat(client).choices[0].message
    assert message.content == f"<think>{REASONING}</think>\n {CONTENT}" and thought(message) is None


def test_include_reasoning_false(client: openai.OpenAI) -> None:
    message = chat(client, extra_body={"include_reasoning": False}).choices[0].message
    assert (thought(message), message.content) == (None, CONTENT)
    assert streamed(client, extra_body={"include_reasoning": False})[:2] == ("", CONTENT)


def test_default_chat_template_kwargs_and_the_request_s_own(client: openai.OpenAI, options: ServingContext) -> None:
    options.options = ServingOptions(reasoning_parser="qwen3", default_chat_template_kwargs={"enable_thinking": False})
    off = chat(client).choices[0].message
    assert (thought(off), off.content) == (None, CONTENT)
    on = chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": True}}).choices[0].message
    assert (thought(on), on.content) == (REASONING, CONTENT)


def test_earlier_thoughts_reach_the_template(http: httpx.Client, server: LiveServer) -> None:
    think_id = server.engine.tokenizer.convert_tokens_to_ids("<think>")

    def tokens(**assistant: str) -> list[int]:
        messages = [*ASK, {"role": "assistant", "content": "fine", **assistant}, *ASK]
        response = http.post("/tokenize", json={"messages": messages})
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    plain = tokens()
    assert think_id not in plain
    for field in ("reasoning", "reasoning_content"):
        assert think_id in tokens(**{field: "the quick"})
    assert tokens(reasoning="x", reasoning_content="x") == tokens(reasoning="x")
    conflict = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [
        {"role": "assistant", "content": "a", "reasoning": "x", "reasoning_content": "y"}]})
    assert conflict.status_code == 400 and conflict.json()["error"]["param"].startswith("messages")


def test_tools_run_on_the_answer_only(client: openai.OpenAI) -> None:
    """The server's reply (no call in it) under tool_choice auto; and on its own, a call written in
    the thinking is not one."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    out = chat(client, tools=tools, tool_choice="auto")
    choice = out.choices[0]
    assert (thought(choice.message), choice.message.content, choice.finish_reason) == (REASONING, CONTENT, "stop")

    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    text = f"<think>maybe {call}</think>\n\nSure.\n{call}"
    req = ChatCompletionRequest(messages=ASK)
    plan = ToolPlan(parser=HermesToolParser, names=("f",))
    thinking = lambda: Qwen3ReasoningParser(PromptState.NONE)
    message = _message(req, plan, thinking, CompletionOutput(0, text, [], None, None, "stop"))
    assert (message.reasoning, message.content) == (f"maybe {call}", "Sure.")
    assert [c.function.name for c in message.tool_calls or []] == ["f"]
    reply = _StreamedReply(plan, thinking, True)
    deltas = [d for i in range(len(text)) for d in reply.deltas(text[i], i == len(text) - 1)]
    assert "".join(d.reasoning or "" for d in deltas) == f"maybe {call}"
    assert "".join(d.content or "" for d in deltas) == "Sure."
    assert [c.function.name for d in deltas for c in d.tool_calls or [] if c.function.name] == ["f"]
    assert json.loads("".join(c.function.arguments or "" for d in deltas for c in d.tool_calls or [])) == {}


def test_a_model_without_the_markers_is_refused_at_start() -> None:
    from types import SimpleNamespace

    from tokenmill.entrypoints.openai.server import build_app

    with pytest.raises(ValueError, match="--reasoning-parser qwen3 needs a tokenizer with <think>"):
        build_app(SimpleNamespace(tokenizer=None), MODEL_NAME, options=QWEN3)  # type: ignore[arg-type]
