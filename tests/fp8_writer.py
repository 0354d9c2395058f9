"""FP8 checkpoints written as their tools write them, from a tiny transformers model: compressed-tensors'
FP8, FP8_DYNAMIC and FP8_BLOCK presets, transformers' fine-grained FP8 (DeepSeek-V3, Qwen3-FP8) and
AutoFP8's per-tensor one; and the transformers model made their float32 reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import make_model_dir
from parity_helpers import parity_prompts
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
BLOCK = 128
FP8_ARGS = dict(num_bits=8, type="float", symmetric=True)

# How each tool writes its quantization_config: compressed-tensors' FP8 (static per-tensor), FP8_DYNAMIC
# (per channel, per token) and FP8_BLOCK presets; transformers' fine-grained FP8 (DeepSeek-V3,
# Qwen3-FP8) and AutoFP8's per-tensor one.
def _ct(weights: dict, inputs: dict) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized", "output_activations": None,
                                          "weights": {**FP8_ARGS, "dynamic": False, **weights},
                                          "input_activations": {**FP8_ARGS, **inputs}}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


FORMATS = {
    "ct-tensor-static": _ct({"strategy": "tensor"}, {"strategy": "tensor", "dynamic": False}),
    "ct-channel-dynamic": _ct({"strategy": "channel"}, {"strategy": "token", "dynamic": True}),
    "ct-block": _ct({"strategy": "block", "block_structure": [BLOCK, BLOCK]},
                    {"strategy": "group", "group_size": BLOCK, "dynamic": True}),
    "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [BLOCK, BLOCK]},
    "fp8-tensor-dynamic": {"quant_method": "fp8", "activation_scheme": "dynamic"},
}


def _quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _quantize_weight(w: torch.Tensor, strategy: str, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor,
                                                                                          torch.Tensor]:
    """(fp8 values, the stored scale, the dequantized weight) as the tools compute them: the scale is a
    largest magnitude over 448, rounded to its stored dtype before the values are divided by it."""
    n, k = w.shape
    if strategy == "block":
        rows, cols = -(-n // BLOCK), -(-k // BLOCK)
        padded = torch.nn.functional.pad(w, (0, cols * BLOCK - k, 0, rows * BLOCK - n))
        amax = padded.view(rows, BLOCK, cols, BLOCK).abs().amax(dim=(1, 3))
        scale = (amax / FP8_MAX).to(scale_dtype)
        full = scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    else:
        amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
        scale = (amax / FP8_MAX).to(scale_dtype)
        full = scale.float().reshape(-1, 1) if strategy == "channel" else scale.float()
    q = _quantize(w, full)
    return q, scale, q.float() * full


def _fake_quant_input(x: torch.Tensor, group: int | None, static: torch.Tensor | None) -> torch.Tensor:
    """What an FP8 GEMM reads of ``x``: each token's (group's) values over their largest magnitude / 448,
    or over the static scale, rounded to e4m3, scaled back."""
    if static is not None:
        return _quantize(x, static).float() * static
    k = x.shape[-1]
    width = group or k
    g = -(-k // width)
    padded = torch.nn.functional.pad(x, (0, g * width - k)).unflatten(-1, (g, width))
    scale = padded.abs().amax(-1, keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (_quantize(padded, scale).float() * scale).flatten(-2)[..., :k]


def write_fp8_checkpoint(model: torch.nn.Module, path: Path, fmt: str, quantize_inputs: bool = False
                         ) -> dict[str, torch.Tensor]:
    """Rewrite the dense checkpoint of ``model`` at ``path`` in ``fmt``, and make ``model`` the reference:
    its projections hold the dequantized weights and, with ``quantize_inputs``, quantize their inputs as
    the format says (as an FP8 GEMM reads them). Returns the dequantized weight of every FP8
    projection, by checkpoint name."""
    config = FORMATS[fmt]
    ct = config["quant_method"] == "compressed-tensors"
    group = config["config_groups"]["group_0"] if ct else None
    strategy = (group["weights"]["strategy"] if ct else
                "block" if config.get("weight_block_size") else "tensor")
    static = group["input_activations"]["dynamic"] is False if ct else config["activation_scheme"] == "static"
    scale_dtype = torch.bfloat16 if ct else torch.float32  # compressed-tensors keeps the model's dtype
    scale_name = "weight_scale_inv" if not ct and strategy == "block" else "weight_scale"
    tensors = load_file(str(path / "model.safetensors"))
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and ".layers." in name and not name.endswith("lm_head")}
    calibration = {}
    if static:  # the static input scales: each projection's largest input magnitude over a calibration run
        hooks = [m.register_forward_pre_hook(
            lambda m, args, name=name: calibration.__setitem__(name, max(calibration.get(name, 0.0),
                                                                         args[0].abs().max().item())))
            for name, m in linears.items()]
        with torch.no_grad():
            model(torch.tensor([parity_prompts(seed=7)[-2]]))
        for hook in hooks:
            hook.remove()
    dequantized = {}
    for name, module in linears.items():
        q, scale, deq = _quantize_weight(tensors[f"{name}.weight"], strategy, scale_dtype)
        tensors[f"{name}.weight"], tensors[f"{name}.{scale_name}"] = q, scale
        with torch.no_grad():
            module.weight.copy_(deq)
        dequantized[name] = deq
        input_scale = None
        if static:
            input_scale = torch.tensor([calibration[name] / FP8_MAX]).to(scale_dtype)
            tensors[f"{name}.input_scale"] = input_scale
            input_scale = input_scale.float()
        block = BLOCK if strategy == "block" else None
        if quantize_inputs:
            module.register_forward_pre_hook(
                lambda m, args, s=input_scale, b=block: (_fake_quant_input(args[0], b, s),))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "quantization_config": config, "dtype": "bfloat16"}))
    return dequantized


def fp8_model_dir(arch: str, path: Path, fmt: str, quantize_inputs: bool = False
                  ) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = make_model_dir(arch, path)
    return model, write_fp8_checkpoint(model, path, fmt, quantize_inputs)
