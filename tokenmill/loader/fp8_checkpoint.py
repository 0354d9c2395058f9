"""An FP8 checkpoint's ``quantization_config`` (config.json), read into a ``CheckpointQuantization``.

Two ways of writing one are read, each as its tools write it:

- ``quant_method: "compressed-tensors"`` (llm-compressor): ``config_groups``, each with ``weights``
  and ``input_activations`` arguments and the ``targets`` they apply to, and an ``ignore`` list. FP8
  here is float 8-bit symmetric weights per tensor, per channel or in 128 x 128 blocks (tensors
  ``weight`` in float8 e4m3 and ``weight_scale``: ``[1]``, ``[out, 1]`` or ``[out / 128, in / 128]``)
  with activations static per tensor (``input_scale`` ``[1]``; compressed-tensors' FP8 preset),
  dynamic per token (FP8_DYNAMIC) or, with block weights, dynamic per token and group of 128
  (FP8_BLOCK).
- ``quant_method: "fp8"`` (transformers' fine-grained FP8, DeepSeek-V3, Qwen3-FP8): ``fmt`` e4m3,
  ``weight_block_size`` [128, 128] with ``activation_scheme`` dynamic and scales named
  ``weight_scale_inv``; without a block size, AutoFP8's per-tensor ``weight_scale`` with static
  (``input_scale``) or dynamic activations. ``modules_to_not_convert`` (or ``ignored_layers``) stay dense.

Any other scheme (integer or 4-bit weights, e5m2, other block sizes, weight-only FP8...) is a
ModelLoadError that names it, before anything is built.
"""

from __future__ import annotations

from typing import Any

from tokenmill.kernels.fp8 import BLOCK_SHAPE, FP8Scheme
from tokenmill.loader.model_config import CheckpointQuantization, ModelLoadError

_SUPPORTED = (
    "compressed-tensors FP8 (float 8-bit weights per tensor, channel or 128x128 block; activations static "
    "per tensor or dynamic per token) and quant_method 'fp8' (e4m3, 128x128 blocks or per tensor)"
)


def checkpoint_quantization(config: dict[str, Any]) -> CheckpointQuantization | None:
    """The quantization of the checkpoint whose config.json is ``config`` (its top level, where
    ``quantization_config`` sits also for multimodal models); None for dense weights."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fine_grained_fp8(qc)
    raise ModelLoadError(f"quantization_config quant_method {method!r} is not supported; supported: {_SUPPORTED}")


def _names(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelLoadError(f"quantization_config {field} must be a list of module names, got {value!r}")
    return tuple(value)


def _fine_grained_fp8(qc: dict[str, Any]) -> CheckpointQuantization:
    fmt = qc.get("fmt", "e4m3")
    activations = qc.get("activation_scheme", "dynamic")
    block = qc.get("weight_block_size")
    described = f"quant_method 'fp8' (fmt {fmt}, weight_block_size {block}, activation_scheme {activations})"
    if fmt != "e4m3":
        raise ModelLoadError(f"{described}: only e4m3 FP8 weights are supported; supported: {_SUPPORTED}")
    if activations not in ("dynamic", "static"):
        raise ModelLoadError(f"{described}: activation_scheme must be dynamic or static")
    if block is not None and list(block) != list(BLOCK_SHAPE):
        raise ModelLoadError(f"{described}: only weight_block_size {list(BLOCK_SHAPE)} is supported")
    if block is not None and activations != "dynamic":
        raise ModelLoadError(f"{described}: block-wise weights take dynamic activations only")
    if block is None:
        scheme = FP8Scheme("tensor", activations == "static", f"fp8 per-tensor, {activations} activations")
    else:
        scheme = FP8Scheme("block", False, "fp8 block-wise 128x128, dynamic activations")
    ignore = qc.get("modules_to_not_convert") or qc.get("ignored_layers")
    return CheckpointQuantization("fp8", scheme, None, _names(ignore, "modules_to_not_convert"))


def _describe(args: dict[str, Any]) -> str:
    strategy = args.get("strategy")
    extra = f" {args['block_structure']}" if args.get("block_structure") else ""
    extra += f" of {args['group_size']}" if args.get("group_size") else ""
    dynamic = " dynamic" if args.get("dynamic") else ""
    return f"{args.get('type')} {args.get('num_bits')}-bit{dynamic} ({strategy}{extra})"


def _group_scheme(name: str, group: dict[str, Any], default_format: Any) -> FP8Scheme:
    """A config group's scheme, if it is one this engine runs."""
    if not isinstance(group, dict):
        raise ModelLoadError(f"compressed-tensors config group {name!r} must be an object")
    weights, inputs = group.get("weights"), group.get("input_activations")
    fmt = group.get("format") or default_format
    described = (
        f"compressed-tensors group {name!r}: weights {_describe(weights) if isinstance(weights, dict) else weights}, "
        f"input activations {_describe(inputs) if isinstance(inputs, dict) else inputs}, format {fmt}"
    )
    refuse = ModelLoadError(f"{described} is not supported; supported: {_SUPPORTED}")
    if not isinstance(weights, dict) or not isinstance(inputs, dict) or group.get("output_activations") is not None:
        raise refuse
    if fmt not in (None, "float-quantized"):
        raise refuse

    def fp8(args: dict[str, Any]) -> bool:
        return args.get("num_bits") == 8 and args.get("type") == "float" and args.get("symmetric", True) is True

    strategy, dynamic = inputs.get("strategy"), inputs.get("dynamic")
    if not fp8(weights) or not fp8(inputs) or weights.get("dynamic", False) is not False:
        raise refuse
    if weights.get("strategy") in ("tensor", "channel"):
        if (strategy, dynamic) == ("tensor", False):
            return FP8Scheme(weights["strategy"], True, f"compressed-tensors FP8 {weights['strategy']}, static")
        if (strategy, dynamic) == ("token", True):
            return FP8Scheme(weights["strategy"], False, f"compressed-tensors FP8 {weights['strategy']}, dynamic")
    block_ok = list(weights.get("block_structure") or []) == list(BLOCK_SHAPE)
    if weights.get("strategy") == "block" and block_ok and (strategy, dynamic) == ("group", True):
        if inputs.get("group_size") == BLOCK_SHAPE[1]:
            return FP8Scheme("block", False, "compressed-tensors FP8 block-wise 128x128, dynamic")
    raise refuse


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointQuantization:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError("a compressed-tensors quantization_config must have config_groups")
    schemes = {name: _group_scheme(name, group, qc.get("format")) for name, group in groups.items()}
    if len(set(schemes.values())) > 1:
        raise ModelLoadError(
            "compressed-tensors config groups of different FP8 schemes are not supported: "
            + "; ".join(f"{name}: {scheme.name}" for name, scheme in schemes.items())
        )
    targets = tuple(t for name, group in groups.items() for t in _names(group.get("targets"), f"{name} targets"))
    return CheckpointQuantization(
        "compressed-tensors", next(iter(schemes.values())), targets, _names(qc.get("ignore"), "ignore")
    )
