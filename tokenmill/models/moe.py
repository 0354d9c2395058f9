"""The sparse mixture-of-experts families on the Llama decoder: Qwen3-MoE and Mixtral.

Their attention is Qwen3's (q/k norm) and Mistral's; what they add is the MLP: a router picks each
token's top-k of E experts (softmax over all of them, then top-k; Mixtral always divides the k weights
by their sum, Qwen3-MoE where ``norm_topk_prob`` says), and the experts' gated MLPs run as one op
(``layers/fused_moe.py``). Qwen3-MoE mixes dense and sparse layers: layer ``i`` is sparse unless it is
in ``mlp_only_layers``, and only where ``(i + 1) % decoder_sparse_step == 0``; its dense layers have
MLPs of ``intermediate_size`` rows, its experts ``moe_intermediate_size``. Mixtral's every layer is
sparse, its experts of ``intermediate_size``, with Mistral's sliding window where one is set.

Checkpoints store each expert apart (Qwen3-MoE ``mlp.experts.N.{gate,up,down}_proj``, Mixtral
``block_sparse_moe.experts.N.{w1,w3,w2}``, and the router ``mlp.gate`` / ``block_sparse_moe.gate``);
``checkpoint_target`` maps each onto its slice of the stacked parameters.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from tokenmill.layers import ops
from tokenmill.layers.fused_moe import GATE, UP, FusedExperts, SparseMoE
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.loader.model_config import ModelConfig, ModelLoadError, MoEConfig
from tokenmill.models.llama import DecoderLayer, LlamaForCausalLM, decoder_config, sliding_windows

# A checkpoint expert projection's name → (stacked parameter, piece of w13).
_EXPERT_PROJECTIONS = {
    "gate_proj": ("w13", GATE),
    "up_proj": ("w13", UP),
    "down_proj": ("w2", None),
    "w1": ("w13", GATE),  # Mixtral's names
    "w3": ("w13", UP),
    "w2": ("w2", None),
}


def _check_activation(raw: dict[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"hidden_act {act!r} is not supported for a mixture of experts (only silu)")


def _num_experts(raw: dict[str, Any]) -> int:
    """The expert count: Qwen3-MoE's checkpoints say ``num_experts``, Mixtral's ``num_local_experts``, and
    transformers 5 writes either family's under either name (the other null)."""
    return int(raw.get("num_experts") or raw.get("num_local_experts") or 0)


def parse_qwen3_moe(raw: dict[str, Any], arch: str) -> ModelConfig:
    """Qwen3MoeForCausalLM: Qwen3's attention (q/k norm; ``attention_bias`` on q/k/v and o; a window on
    every layer where ``use_sliding_window`` says), and which layers are sparse."""
    _check_activation(raw)
    bias = bool(raw.get("attention_bias", False))
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    config = decoder_config(raw, arch, qkv_bias=bias, o_bias=bias, qk_norm=True, windows=sliding_windows(raw, window))
    num_experts = _num_experts(raw)
    step = int(raw.get("decoder_sparse_step", 1))
    if step < 1:
        raise ModelLoadError(f"decoder_sparse_step {step} must be at least 1")
    dense_only = {int(i) for i in raw.get("mlp_only_layers") or ()}
    sparse = tuple(num_experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(config.num_layers))
    if not any(sparse):  # no layer has experts: a dense Qwen3 under another name
        return config
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw["moe_intermediate_size"]),
        renormalize=bool(raw.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )
    return replace(config, moe=moe)


def parse_mixtral(raw: dict[str, Any], arch: str) -> ModelConfig:
    """MixtralForCausalLM: Mistral's attention (no bias; ``sliding_window`` on every layer where set),
    every layer sparse with experts of ``intermediate_size`` rows, the top-k weights renormalised."""
    _check_activation(raw)
    config = decoder_config(
        raw, arch, qkv_bias=False, o_bias=False, qk_norm=False, windows=sliding_windows(raw, raw.get("sliding_window"))
    )
    moe = MoEConfig(
        num_experts=_num_experts(raw),
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=config.intermediate_size,
        renormalize=True,
        sparse_layers=(True,) * config.num_layers,
    )
    return replace(config, moe=moe)


class MoEDecoderLayer(DecoderLayer):
    """Llama's decoder layer, whose MLP is a ``SparseMoE`` where the config marks the layer sparse."""

    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        moe = config.moe
        mlp = None
        if moe is not None and moe.sparse_layers[layer]:
            mlp = SparseMoE(config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize)
        super().__init__(config, layer, rotary, mlp)
        self.sparse = mlp is not None

    def feed_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.sparse:
            return super().feed_forward(x, residual)
        norm = self.post_attention_layernorm
        if residual is None:  # the attention's projection brought the stream back whole
            normed, stream = ops.rms_norm(x, norm.weight, norm.eps), x
        else:
            normed, stream = ops.rms_norm(x, norm.weight, norm.eps, residual)
        assert isinstance(normed, torch.Tensor)
        return self.mlp(normed), stream  # the next norm adds the stream


class MoEForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE and Mixtral: the Llama decoder with ``MoEDecoderLayer``s."""

    make_layer = MoEDecoderLayer

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        """Mixtral's ``block_sparse_moe`` is the layer's ``mlp``; one expert's projection fills its slice
        of the stacked ``experts.w13`` / ``experts.w2`` (``FusedExperts.shard``)."""
        parts = name.replace(".block_sparse_moe.", ".mlp.").split(".")
        # model.layers.L.mlp.experts.N.<projection>.weight
        if len(parts) == 8 and parts[1] == "layers" and parts[4] == "experts" and parts[7] == "weight":
            slot = _EXPERT_PROJECTIONS.get(parts[6])
            if slot is not None and parts[5].isdigit():
                param, piece = slot
                expert = int(parts[5])
                experts = self.config.moe.num_experts if self.config.moe is not None else 0
                if expert >= experts:
                    raise ModelLoadError(
                        f"checkpoint tensor {name!r} names expert {expert}, but the model has {experts}"
                    )
                return ".".join([*parts[:5], param]), expert if piece is None else FusedExperts.part(expert, piece)
        return super().checkpoint_target(".".join(parts))
