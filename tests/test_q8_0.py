"""Q8_0 weights: the quantizer's bounds, what a Q8Weight refuses, and decoding on them."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import q8_0


def test_quantize_rounds_each_value_to_its_blocks_step() -> None:
    weight = torch.randn(24, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 96)
    packed = q8_0.quantize(weight)
    step = packed.scales.float().repeat_interleave(32, dim=1)
    assert packed.qweight.abs().max() <= 127
    assert ((packed.dequantize(torch.float32) - weight).abs() <= step * 0.5 + 1e-6 * weight.abs()).all()
    zero = q8_0.quantize(torch.zeros(2, 32))
    assert not zero.dequantize(torch.float32).any()


@pytest.mark.parametrize("qweight,scales,message", [
    (torch.zeros(4, 40, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.float16), "multiple of 32"),
    (torch.zeros(4, 64), torch.zeros(4, 2, dtype=torch.float16), "int8"),
    (torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 2), "float16"),
    (torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 3, dtype=torch.float16), "scales must be"),
])
def test_a_malformed_q8_weight_is_refused(qweight, scales, message) -> None:
    with pytest.raises(ValueError, match=message):
        q8_0.Q8Weight(qweight, scales)


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "gemma3"])
def test_q8_0_quantization_gives_transformers_tokens_on_the_quantized_weights(arch: str, tmp_path) -> None:
    """``quantization="q8_0"`` keeps every projection packed; transformers, given the same values
    dequantized, decodes the same tokens."""
    from helpers import make_model_dir
    from parity_helpers import parity_prompts, reference_generate
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.q8_linear import Q8Weights

    model = make_model_dir(arch, tmp_path)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head") and module.in_features % 32 == 0:
                module.weight.copy_(q8_0.quantize(module.weight).dequantize(torch.float32))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", quantization="q8_0")
    assert any(isinstance(m, Q8Weights) for m in llm.engine.core.runner.model.modules())
    prompts = parity_prompts()[:4]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        expected, _ = reference_generate(model, prompt)
        assert out.outputs[0].token_ids == expected[:10]


def test_an_unknown_quantization_is_refused() -> None:
    from tokenmill import LLM

    with pytest.raises(ValueError, match="quantization must be"):
        LLM(device="cpu", quantization="q4")


def test_packed_layers_project_as_their_dense_kinds() -> None:
    """A column-split layer, a row-split one and a plain ``nn.Linear``, each packed, called directly:
    what the dense layer computes on the dequantized weight."""
    from tokenmill.layers.linear import ColumnParallelLinear, RowParallelLinear, Split
    from tokenmill.layers.q8_linear import Q8ColumnParallelLinear, Q8Linear, Q8RowParallelLinear, quantize_linears

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.col = ColumnParallelLinear(64, [Split(96)], bias=True)
    model.row = RowParallelLinear(Split(64), 48, bias=True)
    model.plain = torch.nn.Linear(64, 40, bias=False)
    x = torch.randn(2, 3, 64)
    dense = {name: (layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone())
             for name, layer in model.named_children()}
    assert quantize_linears(model) == 3
    assert (type(model.col), type(model.row), type(model.plain)) == (Q8ColumnParallelLinear, Q8RowParallelLinear,
                                                                      Q8Linear)
    for name, layer in model.named_children():
        weight, bias = dense[name]
        want = torch.nn.functional.linear(x, q8_0.quantize(weight).dequantize(torch.float32), bias)
        torch.testing.assert_close(layer(x), want)
