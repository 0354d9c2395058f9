"""Writes a tiny Hugging Face model and its tokenizer as a GGUF file, as llama.cpp's converter lays
one out (metadata keys, tensor names, q/k rows permuted for Llama, Gemma's norms offset by one), with
``gguf``'s writer: the GGUF loading tests read it back with the engine and with ``transformers``."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file

# The GGUF architecture of each model_type where llama.cpp names it otherwise.
_ARCHITECTURES = {"mistral": "llama", "gemma3_text": "gemma3"}
_LAYER_TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                  "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
# Where an architecture's layer tensors are named otherwise: Gemma 3's sandwich norms, whose
# post_attention_layernorm follows attention (Llama's is the MLP's input norm).
_ARCHITECTURE_LAYER_TENSORS = {
    "gemma3": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
}
_TOP_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# llama.cpp stores Gemma's norm weights as the factor they scale by (1 + w).
_NORM_OFFSETS = {"gemma3": 1.0}
# Metadata only some architectures carry.
_SLIDING_WINDOW_ARCHITECTURES = {"gemma3"}

QK_K = 256  # values in a K-quant super-block


def _permute(x: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for Llama's q and k (each head's two rotary halves interleaved)."""
    return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """``x`` ``[N, K]`` (K a multiple of 256) as Q6_K blocks, the layout ``gguf.quants`` dequantizes
    (``gguf`` has no K-quant quantizer). Per 256 values: a float16 scale ``d``, an int8 scale per 16
    values and a 6-bit ``q`` per value, the value being ``d * scale * (q - 32)``. Each 16's scale is
    rounded up from its largest magnitude over 31, so no value clips: a valid encoding, within half
    a step of ``x``, not llama.cpp's search for the most accurate one."""
    rows, cols = x.shape
    sub_blocks = x.astype(np.float32).reshape(-1, QK_K // 16, 16)
    wanted = np.abs(sub_blocks).max(axis=-1) / 31  # each 16's step
    d = (wanted.max(axis=-1, keepdims=True) / 127).astype(np.float16)
    scales = np.ceil(np.divide(wanted, d, out=np.zeros_like(wanted), where=d > 0)).clip(0, 127)
    step = (d.astype(np.float32) * scales)[..., None]
    q = np.round(np.divide(sub_blocks, step, out=np.zeros_like(sub_blocks), where=step > 0)).clip(-32, 31)
    halves = (q + 32).astype(np.uint8).reshape(-1, 2, 128)  # each half: 64 low nibbles, 32 high bit pairs
    low = (halves[..., :64] & 0x0F) | ((halves[..., 64:] & 0x0F) << 4)
    high = np.bitwise_or.reduce([(halves[..., 32 * i:32 * (i + 1)] >> 4) << (2 * i) for i in range(4)])
    blocks = np.concatenate([low.reshape(-1, 128), high.reshape(-1, 64), scales.astype(np.int8).view(np.uint8),
                             d.view(np.uint8)], axis=-1)
    return blocks.reshape(rows, -1)


def _quantize(x: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """``x`` in ``kind``, by this module's Q6_K quantizer where ``gguf`` has none."""
    return quantize_q6_k(x) if kind == gguf.GGMLQuantizationType.Q6_K else gguf.quants.quantize(x, kind)


def write_gguf(model_dir: Path, out: Path, matrix_type: str, name: str | None = None) -> Path:
    """``model_dir``'s model (Llama, Mistral, Qwen2, Qwen3 or Gemma 3's text model) and tokenizer as
    ``out``: matrices in ``matrix_type`` (F16, or a type ``gguf`` can quantize to: F32, Q8_0, Q4_0,
    BF16…, or Q6_K), vectors in F32. ``name`` (``general.name``) is "Tiny <model_type>" unless given: the
    name alone tells a Mistral file from a Llama one."""
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = _ARCHITECTURES.get(cfg["model_type"], cfg["model_type"])
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name or f"Tiny {cfg['model_type']}")
    _write_hyperparameters(writer, arch, cfg)
    _write_tokenizer(writer, json.loads((model_dir / "tokenizer.json").read_text()))
    layer_tensors = {**_LAYER_TENSORS, **_ARCHITECTURE_LAYER_TENSORS.get(arch, {})}
    for hf_name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        x = tensor.float().numpy()
        stem, kind = hf_name.rsplit(".", 1)
        if stem.endswith("norm"):
            x = x + _NORM_OFFSETS.get(arch, 0.0)
        if stem in _TOP_TENSORS:
            gguf_name = f"{_TOP_TENSORS[stem]}.{kind}"
        else:
            layer, module = stem.split(".")[2], ".".join(stem.split(".")[3:])
            gguf_name = f"blk.{layer}.{layer_tensors[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg["num_attention_heads"] if module == "self_attn.q_proj" else cfg["num_key_value_heads"]
                x = _permute(x, heads)
        if x.ndim == 2 and matrix_type != "F16":
            quant = gguf.GGMLQuantizationType[matrix_type]
            writer.add_tensor(gguf_name, _quantize(x, quant), raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name, x.astype(np.float16 if x.ndim == 2 else np.float32))
    return _finish(writer, out)


def write_architecture_only(out: Path, arch: str) -> Path:
    """A GGUF file that states an architecture and a layer count, and holds nothing else."""
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(1)
    return _finish(writer, out)


def _write_hyperparameters(writer: gguf.GGUFWriter, arch: str, cfg: dict) -> None:
    """The model's shape, as llama.cpp's keys state it (the rope base is the global layers' where the
    layer kinds differ)."""
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg["vocab_size"])
    if arch in _SLIDING_WINDOW_ARCHITECTURES:
        writer.add_sliding_window(cfg["sliding_window"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))


def _write_tokenizer(writer: gguf.GGUFWriter, tok: dict) -> None:
    """A byte-level BPE tokenizer (tests/helpers.py's) as GGUF's ``gpt2`` tokenizer."""
    vocab = tok["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {added["content"] for added in tok["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    writer.add_eos_token_id(vocab["<|endoftext|>"])
    writer.add_bos_token_id(vocab["<|endoftext|>"])


def _finish(writer: gguf.GGUFWriter, out: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
