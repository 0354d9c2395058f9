"""The mixture-of-experts pieces on their own: the reference ``fused_experts`` (both its forms) against a
naive per-token loop, the routing, and the clear errors of bad configs and checkpoints. Parity of whole
models with transformers is in test_parity.py (the qwen3-moe and mixtral tiny configs)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import TINY_CONFIGS, make_model_dir
from safetensors.torch import load_file, save_file

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import reference
from tokenmill.layers.fused_moe import FusedExperts, SparseMoE
from tokenmill.loader.model_config import ModelLoadError
from tokenmill.models.registry import load_model_config


def naive_experts(x, w13, w2, ids, weights) -> torch.Tensor:
    """Each token through each of its experts, one at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t]):
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += w * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("grouped", [True, False])
def test_fused_experts_match_a_per_token_loop(grouped: bool) -> None:
    g = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, k = 9, 16, 12, 5, 2
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.3
    # Expert 4 takes every token, expert 0 none; the others share the second slot.
    ids = torch.stack([torch.full((tokens,), 4), torch.tensor([1, 2, 3] * 3)], dim=1)
    weights = torch.rand(tokens, k, generator=g)
    got = reference.fused_experts(x, w13, w2, ids, weights, grouped=grouped)
    torch.testing.assert_close(got, naive_experts(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)
    # No token at all, and the first slot's order not the experts' order.
    assert reference.fused_experts(x[:0], w13, w2, ids[:0], weights[:0], grouped=grouped).shape == (0, hidden)
    flipped = reference.fused_experts(x, w13, w2, ids.flip(1), weights.flip(1), grouped=grouped)
    torch.testing.assert_close(flipped, got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_is_softmax_then_top_k(renormalize: bool) -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.0]], dtype=torch.bfloat16)
    weights, ids = reference.moe_routing(logits, 2, renormalize)
    assert ids.tolist() == [[1, 3], [0, 2]] and weights.dtype == torch.float32
    probs = logits.float().softmax(-1).gather(1, ids)
    torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True) if renormalize else probs)


def test_too_many_experts_per_token_is_refused(tmp_path) -> None:
    config = TINY_CONFIGS["qwen3-moe-norm"]()
    raw = {**config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"], "num_experts_per_tok": 5}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="experts per token <= experts, got 5 of 4 experts"):
        load_model_config(tmp_path)
    with pytest.raises(ValueError, match="top_k 5"):
        SparseMoE(16, 4, 5, 8, True)


def test_layers_are_sparse_as_decoder_sparse_step_and_mlp_only_layers_say(tmp_path) -> None:
    make_model_dir("qwen3-moe", tmp_path)
    cfg = load_model_config(tmp_path)
    assert cfg.moe is not None and cfg.moe.sparse_layers == (False, False, False, True, False, True)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size, cfg.moe.renormalize) == (4, 2, 32, False)


def test_a_checkpoint_missing_an_expert_or_naming_too_many_is_refused(tmp_path) -> None:
    make_model_dir("mixtral-window", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.block_sparse_moe.experts.2.w3.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="experts.w13"):
        LLM(str(tmp_path), device="cpu", dtype="float32")
    tensors["model.layers.0.block_sparse_moe.experts.4.w3.weight"] = tensors[name].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="names expert 4, but the model has 4"):
        LLM(str(tmp_path), device="cpu", dtype="float32")


def test_an_fp8_checkpoint_of_a_mixture_of_experts_is_refused(tmp_path) -> None:
    make_model_dir("qwen3-moe-norm", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="FP8 checkpoints of a mixture of experts are not supported"):
        load_model_config(tmp_path)


def test_q8_0_leaves_the_experts_dense_and_says_so(tmp_path, caplog) -> None:
    make_model_dir("qwen3-moe", tmp_path)
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", quantization="q8_0")
    assert "leaves the experts and routers of this mixture of experts' 2 sparse layers dense" in caplog.text
    model = llm.engine.core.runner.model
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert len(experts) == 2 and all(m.w13.dtype == torch.float32 for m in experts)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
