"""GGUF files: tiny models of each family written with ``gguf``'s writer (F16, BF16, Q8_0, Q4_0 and
the K-quant Q6_K) load, and give ``transformers``' greedy tokens on the same file; bad files are
clear errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from gguf_writer import quantize_q6_k, write_architecture_only, write_gguf
from helpers import make_model_with_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.layers.q8_linear import Q8Weights
from tokenmill.loader.gguf_checkpoint import read_gguf_config
from tokenmill.loader.model_config import ModelLoadError

PROMPTS = ["def fibonacci(n):", "héllo wörld", "the quick brown fox"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("arch,matrix_type", [
    ("llama3", "F16"), ("llama3", "Q8_0"), ("llama3", "Q4_0"), ("llama-wide", "Q6_K"),
    ("mistral-window", "F16"), ("mistral-window", "Q8_0"), ("qwen2", "BF16"), ("qwen2", "Q8_0"),
    ("qwen3", "F16"), ("qwen3", "Q8_0"), ("gemma3-six-layers", "F16"), ("gemma3-six-layers", "Q8_0")])
def test_a_gguf_file_gives_transformers_tokens(arch: str, matrix_type: str, tmp_path) -> None:
    """Q8_0 stays packed; F16, BF16, Q4_0 and Q6_K are dequantized as they load."""
    hf_dir = make_model_with_tokenizer(arch, tmp_path / "hf")
    path = write_gguf(hf_dir, tmp_path / "model.gguf", matrix_type)
    llm = LLM(str(path), device="cpu", dtype="float32")
    packed = matrix_type == "Q8_0"
    assert llm.engine.core.quantization == ("q8_0" if packed else None)
    assert any(isinstance(m, Q8Weights) for m in llm.engine.core.runner.model.modules()) == packed
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    # transformers' GGUF config leaves the head size at hidden / heads (Qwen3's is not): give it the file's.
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    config.head_dim = read_gguf_config(path)["head_dim"]
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, config=config,
                                                     dtype=torch.float32)
    assert llm.engine.core.model_config.architecture == type(reference).__name__
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:]
        assert out.outputs[0].token_ids == expected.tolist()
    # The tokenizer and eos come from the file's metadata.
    assert llm.get_tokenizer().encode(PROMPTS[0]) == outs[0].prompt_token_ids
    assert llm.engine.core.model_config.eos_token_ids


def test_a_file_named_mistral_loads_as_mistral(tmp_path) -> None:
    """transformers reads a "llama" file named exactly "mistral" as Mistral, then cannot load its weights
    (it asks gguf for the tensor names of a "mistral" architecture, which gguf has not); the engine
    loads it, with the tokens of the same model named otherwise (read as Llama, and checked above)."""
    hf_dir = make_model_with_tokenizer("mistral-window", tmp_path / "hf")
    as_mistral = write_gguf(hf_dir, tmp_path / "mistral.gguf", "Q8_0", name="mistral")
    as_llama = write_gguf(hf_dir, tmp_path / "llama.gguf", "Q8_0")
    assert read_gguf_config(as_mistral)["architectures"] == ["MistralForCausalLM"]
    assert read_gguf_config(as_llama)["architectures"] == ["LlamaForCausalLM"]
    assert greedy_tokens(as_mistral) == greedy_tokens(as_llama)


def greedy_tokens(path: Path) -> list[list[int]]:
    """The engine's greedy continuations of PROMPTS from the file at ``path``."""
    outs = LLM(str(path), device="cpu", dtype="float32").generate(PROMPTS, GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outs]


def test_gemma3_reads_as_transformers_fills_it_in(tmp_path) -> None:
    """A Gemma 3 file states its global rope base and its window, not its layer pattern or local rope
    base: the engine takes transformers' defaults for those (every sixth layer global); the
    attention scale is llama.cpp's, the head size's (256 here, as transformers' default)."""
    path = write_gguf(make_model_with_tokenizer("gemma3-six-layers", tmp_path / "hf"), tmp_path / "model.gguf", "F16")
    config = read_gguf_config(path)
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["sliding_window"] == 8 and config["head_dim"] == 256
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1000.0
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["query_pre_attn_scalar"] == 256


def test_gemma3_runs_as_llama_cpp_means_it(tmp_path) -> None:
    """What transformers' reading of a Gemma 3 file leaves out (the global layers' linear rope scaling
    of the 4B-27B; an attention scale of the head size, not 256): the engine runs the model that was
    written, token for token (float32 matrices, so nothing is rounded on the way)."""
    hf_dir = make_model_with_tokenizer("gemma3-rope-scaled", tmp_path / "hf")
    original = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    path = write_gguf(hf_dir, tmp_path / "model.gguf", "F32")
    config = read_gguf_config(path)
    assert config["rope_parameters"]["full_attention"]["factor"] == 8.0 and config["query_pre_attn_scalar"] == 32
    for out in LLM(str(path), device="cpu", dtype="float32").generate(PROMPTS, GREEDY, use_tqdm=False):
        ids = torch.tensor([out.prompt_token_ids])
        expected = original.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:]
        assert out.outputs[0].token_ids == expected.tolist()


def test_gemma3_27b_scales_queries_by_hidden_over_heads(tmp_path) -> None:
    """llama.cpp knows the 27B by its 62 layers: 5376 / 32 = 168 before the square root."""
    path = write_gguf(make_model_with_tokenizer("gemma3-62-layers", tmp_path / "hf"), tmp_path / "model.gguf", "F16")
    config = read_gguf_config(path)
    assert config["query_pre_attn_scalar"] == config["hidden_size"] // config["num_attention_heads"] == 16


def test_the_q6_k_writer_is_the_inverse_of_ggufs_reader() -> None:
    """Read back by ``gguf``, each value is within half a step of what was written (the step: its 16
    values' largest magnitude over 31, plus the rounding of that to an int8 multiple of the block's
    scale): a layout slip would be off by far more."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 512)).astype(np.float32) * np.array([[1.0], [1e-3], [30.0], [0.0]], np.float32)
    x[0, 7] = 50.0  # one block whose scale its outlier sets
    back = gguf.quants.dequantize(quantize_q6_k(x), gguf.GGMLQuantizationType.Q6_K)
    largest = np.abs(x).reshape(4, -1, 16).max(axis=-1)
    block_scale = np.repeat(largest.reshape(4, -1, 16).max(axis=-1), 16, axis=1) / 31 / 127
    error = np.abs(back - x).reshape(4, -1, 16).max(axis=-1)
    assert np.all(error <= (largest / 31 + block_scale) / 2 * (1 + 1e-3))


def test_bad_gguf_files_are_clear_errors(tmp_path) -> None:
    """Each error says what is wrong with which file, where gguf's reader would fail on some array."""
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"), device="cpu")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ModelLoadError, match="not a GGUF file this engine can read"):
        LLM(str(broken), device="cpu")
    with pytest.raises(ModelLoadError, match="GGUF architecture 'phi3' is not supported"):
        LLM(str(write_architecture_only(tmp_path / "phi3.gguf", "phi3")), device="cpu")
    whole = write_gguf(make_model_with_tokenizer("llama3", tmp_path / "hf"), tmp_path / "whole.gguf", "Q8_0")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(whole.read_bytes()[:whole.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"truncated\.gguf is not a GGUF file .*, truncated or corrupt"):
        LLM(str(truncated), device="cpu")


def test_the_head_size_comes_from_the_file(tmp_path) -> None:
    """Qwen3's head size is not hidden / heads, and transformers' GGUF config leaves it out."""
    path = write_gguf(make_model_with_tokenizer("qwen3", tmp_path / "hf"), tmp_path / "model.gguf", "Q8_0")
    assert read_gguf_config(path)["head_dim"] == 32
    out = LLM(str(path), device="cpu", dtype="float32").generate(["héllo"], SamplingParams(max_tokens=4),
                                                                  use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
