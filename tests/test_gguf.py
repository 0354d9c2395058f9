"""GGUF files: tiny models of each family written with ``gguf``'s writer (F16, and Q8_0) load, and
give ``transformers``' greedy tokens on the same file; bad files are clear errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from gguf_writer import write_gguf
from helpers import make_model_with_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.loader.gguf_checkpoint import read_gguf_config
from tokenmill.loader.hf_config import ModelLoadError

PROMPTS = ["def fibonacci(n):", "héllo wörld", "the quick brown fox"]


@pytest.mark.parametrize("arch,matrix_type", [("llama3", "F16"), ("llama3", "Q8_0"), ("llama3", "Q4_0"),
                                               ("qwen2", "BF16"), ("qwen2", "Q8_0")])
def test_a_gguf_file_gives_transformers_tokens(arch: str, matrix_type: str, tmp_path) -> None:
    """Q8_0 stays packed; F16, BF16 and Q4_0 are dequantized as they load."""
    hf_dir = make_model_with_tokenizer(arch, tmp_path / "hf")
    path = write_gguf(hf_dir, tmp_path / "model.gguf", matrix_type)
    llm = LLM(str(path), device="cpu", dtype="float32")
    assert llm.engine.core.quantization == ("q8_0" if matrix_type == "Q8_0" else None)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:]
        assert out.outputs[0].token_ids == expected.tolist()
    # The tokenizer and eos come from the file's metadata.
    assert llm.get_tokenizer().encode(PROMPTS[0]) == outs[0].prompt_token_ids
    assert llm.engine.core.model_config.eos_token_ids


def test_the_head_size_comes_from_the_file(tmp_path) -> None:
    """Qwen3's head size is not hidden / heads, and transformers' GGUF config leaves it out."""
    path = write_gguf(make_model_with_tokenizer("qwen3", tmp_path / "hf"), tmp_path / "model.gguf", "Q8_0")
    assert read_gguf_config(path)["head_dim"] == 32
    out = LLM(str(path), device="cpu", dtype="float32").generate(["héllo"], SamplingParams(max_tokens=4),
                                                                  use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_bad_gguf_files_are_clear_errors(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"), device="cpu")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ModelLoadError, match="not a GGUF file this engine can read"):
        LLM(str(broken), device="cpu")
