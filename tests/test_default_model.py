"""The embedded default model: in the package, loadable by tokenmill and transformers
alike, with matching logits and a deterministic greedy continuation."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.default_model import DEFAULT_MODEL_DIR
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.frontend.llm_engine import LLMEngine
from tokenmill.entrypoints.cli import main as cli_main

PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "class Stack:\n    def push(self, item):"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_num_seqs=4)


def test_the_model_ships_in_the_package_under_32_mb() -> None:
    files = list(DEFAULT_MODEL_DIR.iterdir())
    names = {f.name for f in files}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert sum(f.stat().st_size for f in files) < 32 * 1024 * 1024
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]


def test_greedy_continuation_is_deterministic(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=24)
    first = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    again = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert first == again
    assert all(text.strip() for text in first)


def test_logits_match_transformers() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    ref = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32"))
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
        engine.add_request(prompt, ids, params)
        while engine.has_unfinished_requests():
            outs = engine.step()
        ours = outs[0].outputs[0]
        with torch.no_grad():
            logits = ref(torch.tensor([ids + ours.token_ids])).logits[0, len(ids) - 1:-1].float()
        ref_logprobs = logits.log_softmax(-1)
        for step, (token, top) in enumerate(zip(ours.token_ids, ours.logprobs)):
            assert token == int(ref_logprobs[step].argmax())
            for t, value in top.items():
                assert abs(value - ref_logprobs[step, t].item()) < 1e-4


def test_chat_stops_at_end_of_turn(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "Write a Python function `add(a, b)` that returns a + b."}],
                   SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert out.text.strip()
    assert out.finish_reason in ("stop", "length")


def test_chat_offers_tools_to_the_template(llm: LLM) -> None:
    """The tools reach the template's system turn (the output stays raw text: parsing calls is the server's)."""
    tool = {"type": "function", "function": {"name": "lookup_symbol", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "Where is os.path.join defined?"}]
    params = SamplingParams(temperature=0, max_tokens=8)
    with_tools = llm.chat(messages, params, use_tqdm=False, tools=[tool])[0]
    prompt = llm.get_tokenizer().decode(with_tools.prompt_token_ids)
    assert prompt.startswith("<|system|>") and json.dumps(tool["function"]) in prompt
    plain = llm.chat(messages, params, use_tqdm=False)[0]
    assert llm.get_tokenizer().decode(plain.prompt_token_ids).startswith("<|user|>")


def test_cli_generate_streams_python(capsys) -> None:
    assert cli_main(["generate", "def fibonacci(n):", "--max-tokens", "40", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("def fibonacci(n):")
    assert len(printed) > len("def fibonacci(n):") + 20


def test_cli_chat_answers_each_line(capsys, monkeypatch) -> None:
    import io

    from tokenmill.entrypoints import cli

    prompts = []
    real_stream = cli.stream_text

    def recording_stream(engine, prompt, params):
        prompts.append(engine.tokenizer.decode(prompt))
        return real_stream(engine, prompt, params)

    monkeypatch.setattr(cli, "stream_text", recording_stream)
    monkeypatch.setattr("sys.stdin", io.StringIO("Write a function that adds two numbers.\n\nNow multiply.\n"))
    assert cli_main(["chat", "--max-tokens", "16", "--temperature", "0", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip()
    # Two user turns (the blank line is skipped); the second prompt carries the whole conversation.
    assert len(prompts) == 2
    assert "adds two numbers" in prompts[1] and prompts[1].count("<|assistant|>") == 2


def test_cli_reports_bad_input_without_a_traceback(capsys) -> None:
    assert cli_main(["generate", "def f():", "--max-tokens", "0", "--device", "cpu"]) == 2
    assert "max_tokens must be in [1, " in capsys.readouterr().err


def test_a_corrupt_tokenizer_file_is_a_clear_error(tmp_path) -> None:
    """A tokenizer file that cannot be parsed fails the engine's construction with an error naming
    the directory and what failed, not a bare decoder error from inside transformers."""
    for name in DEFAULT_MODEL_DIR.iterdir():
        (tmp_path / name.name).write_bytes(name.read_bytes())
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ValueError, match=f"cannot load the tokenizer of {tmp_path}: JSONDecodeError"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", max_num_seqs=2))
