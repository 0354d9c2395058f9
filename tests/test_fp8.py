"""FP8 weights: checkpoints written as compressed-tensors and transformers' fine-grained FP8 write them
load as FP8 with their scales; the engine on them matches transformers in float32 carrying the same
dequantized weights and quantizing its projections' inputs the same way; ``quantization="fp8"``
keeps the embedded model's greedy tokens; other schemes are clear errors; two CPU ranks split the
values and scales."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from safetensors.torch import load_file, save_file
from fp8_writer import FORMATS, fp8_model_dir
from helpers import make_model_dir
from parity_helpers import parity_prompts, reference_generate

from tokenmill import LLM, SamplingParams
from tokenmill.engine.worker.model_runner import build_model
from tokenmill.kernels import reference
from tokenmill.layers.fp8_linear import FP8Weights
from tokenmill.layers.linear import ColumnParallelLinear, RowParallelLinear
from tokenmill.loader.model_config import ModelLoadError
from tokenmill.models.registry import load_model_config


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_loaded_weights_are_the_checkpoints_fp8_values_and_scales(fmt: str, tmp_path) -> None:
    """Each projection is an FP8 layer whose dequantized weight is the checkpoint's (q|k|v and gate|up
    fused, each part with its own scales); the LM head and the embeddings stay dense."""
    _, dequantized = fp8_model_dir("llama3", tmp_path, fmt)
    config = load_model_config(tmp_path)
    model = build_model(config, tmp_path, torch.float32, torch.device("cpu"), 64)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FP8Weights)}
    assert len(layers) == 4 * config.num_layers
    for name, layer in layers.items():
        assert layer.qweight.dtype == torch.float8_e4m3fn
        parts = model.checkpoint_projections(name)
        want = torch.cat([dequantized[p] for p in parts])
        torch.testing.assert_close(layer.weight.dequantize(torch.float32), want, rtol=0, atol=0)
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32


def test_an_fp8_checkpoint_never_holds_its_dense_projections(tmp_path, monkeypatch) -> None:
    """Its projections are built on the meta device and made FP8 before the checkpoint loads (a model
    that fits only in FP8 must never hold them dense); a projection it leaves dense, and every bias,
    gets memory for the checkpoint to fill, and nothing is left on the meta device."""
    _, dequantized = fp8_model_dir("llama3", tmp_path, "ct-channel-dynamic")
    tensors = load_file(str(tmp_path / "model.safetensors"))  # the down projections left dense
    for name in [n for n in dequantized if n.endswith("down_proj")]:
        tensors[f"{name}.weight"] = dequantized[name]
        del tensors[f"{name}.weight_scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["re:.*down_proj"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    built = []
    for kind in (ColumnParallelLinear, RowParallelLinear):
        def init(self, *args, __init__=kind.__init__, **kwargs) -> None:
            __init__(self, *args, **kwargs)
            built.append(self.weight.device.type)
        monkeypatch.setattr(kind, "__init__", init)
    model = build_model(load_model_config(tmp_path), tmp_path, torch.float32, torch.device("cpu"), 64)
    assert built and set(built) == {"meta"}
    assert not [name for name, p in model.named_parameters() if p.is_meta]
    dense = [name for name, m in model.named_modules() if isinstance(m, RowParallelLinear)
             and not isinstance(m, FP8Weights) and name.endswith("down_proj")]
    assert len(dense) == len(model.model.layers)


# Greedy tokens equal transformers' up to a near-tie (logits within TIE_TOL), and the chosen tokens'
# logprobs agree to float32 noise: median within LOGPROB_TOL, each within FLIP_TOL. With the inputs
# quantized, both sides quantize each projection's input to e4m3 the same way, but float32 noise
# (another summation order) can move a value across a rounding boundary, a step of 1/16 of it (llama3,
# 60 tokens a format: median 2e-7, the largest 1e-6 to 0.034), where a wrong scale or block moves most
# tokens.
LOGPROB_TOL = 1e-5
FLIP_TOL = 0.1
TIE_TOL = 0.05


@pytest.mark.parametrize("arch,fmt", [("llama3", f) for f in FORMATS] + [("qwen3", "ct-channel-dynamic"),
                                      ("qwen3", "fp8-block"), ("gemma3", "ct-tensor-static"), ("gemma3", "ct-block")])
@pytest.mark.parametrize("inputs", ["as-is", "quantized"])
def test_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(arch: str, fmt: str, inputs: str, tmp_path,
                                                                        monkeypatch) -> None:
    """The CPU reads FP8 weights against inputs as they are (``reference.fp8_weight_linear``); the GPU's
    FP8 tensor cores quantize the inputs first (``reference.fp8_linear``), which the engine here takes
    in its place against transformers quantizing its projections' inputs as the format says: the
    checkpoint's static scales or each token's (block's) own."""
    model, _ = fp8_model_dir(arch, tmp_path, fmt, quantize_inputs=inputs == "quantized")
    if inputs == "quantized":
        monkeypatch.setattr(reference, "fp8_weight_linear", reference.fp8_linear)
    prompts = parity_prompts()[:5]
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=48)
    assert llm.engine.core.quantization == "fp8"
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    diffs = []
    for prompt, out in zip(prompts, outs):
        ours, ours_logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs
        ref, ref_logits = reference_generate(model, prompt)
        ref_logprobs = ref_logits.log_softmax(-1)
        for i, (a, b) in enumerate(zip(ours, ref)):
            if a != b:
                gap = (ref_logits[i, b] - ref_logits[i, a]).abs().item()
                assert gap < TIE_TOL, f"token {i}: ours {a}, transformers {b}, logit gap {gap} is no tie"
                break
            diffs.append(abs(ours_logprobs[i][a] - ref_logprobs[i, a].item()))
    assert len(diffs) >= 30 and statistics.median(diffs) < LOGPROB_TOL and max(diffs) < FLIP_TOL


def test_quantization_fp8_keeps_the_embedded_models_greedy_tokens() -> None:
    """``quantization="fp8"`` (per-row weight scales, per-token activations) on the embedded model: teacher
    forced on the dense model's greedy continuations, its top token is the dense model's at 85% of the
    positions or more (measured: 133 of 144, 92%; this small model's top two are often close)."""
    prompts = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n", "Once upon a time",
               "SELECT * FROM", "The capital of France is"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    dense = LLM(device="cpu", dtype="float32").generate(prompts, greedy, use_tqdm=False)
    llm = LLM(device="cpu", dtype="float32", quantization="fp8")
    model = llm.engine.core.runner.model
    assert sum(isinstance(m, FP8Weights) for m in model.modules()) == 4 * llm.engine.core.model_config.num_layers
    sequences = [out.prompt_token_ids + out.outputs[0].token_ids for out in dense]
    forced = llm.generate(sequences, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    agree = total = 0
    for out, forced_out in zip(dense, forced):
        start = len(out.prompt_token_ids)
        for token, logprobs in zip(out.outputs[0].token_ids, forced_out.prompt_logprobs[start:]):
            agree += max(logprobs, key=logprobs.__getitem__) == token
            total += 1
    assert agree / total >= 0.85, f"{agree} of {total}"


@pytest.mark.parametrize("change,named", [
    ({"config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                                       "group_size": 128, "symmetric": True},
                                    "input_activations": None, "format": "pack-quantized"}}}, "int 4-bit"),
    ({"config_groups": {"group_0": {"targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
                                    "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                                          "dynamic": True, "symmetric": True}}}}, "int 8-bit"),
    ({"config_groups": {"group_0": {"targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                    "input_activations": None}}}, "input activations None"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64], "activation_scheme": "dynamic"}, "weight_block_size"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e5m2"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "dynamic activations"),
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
])
def test_an_unsupported_scheme_is_a_clear_error(change: dict, named: str, tmp_path) -> None:
    make_model_dir("llama3", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    base = FORMATS["ct-channel-dynamic"] if "config_groups" in change else {}
    raw["quantization_config"] = {**base, **change}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="not supported|only|must") as err:
        load_model_config(tmp_path)
    assert named in str(err.value)


def test_a_tensor_the_config_leaves_dense_but_stored_in_fp8_is_a_clear_error(tmp_path) -> None:
    fp8_model_dir("llama3", tmp_path, "ct-channel-dynamic")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"]["ignore"] = ["lm_head", "re:.*down_proj$"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="down_proj.*float8.*quantization_config does not describe it"):
        LLM(str(tmp_path), device="cpu")


def test_q8_0_of_an_fp8_checkpoint_is_refused(tmp_path) -> None:
    fp8_model_dir("llama3", tmp_path, "fp8-block")
    with pytest.raises(ValueError, match="FP8 already"):
        LLM(str(tmp_path), device="cpu", quantization="q8_0")
