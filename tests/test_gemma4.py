"""Gemma 4 beyond the shared engine parity run (tests/test_parity.py, over the ``gemma4*`` tiny
configs): the model itself against transformers through paged caches laid out from
``kv_layout`` (each layer's own shape, KV-shared layers handed their source's cache), as the
engine will lay them out; the config spellings of released checkpoints and of transformers 5.17+;
proportional RoPE; the checkpoint tensors skipped; what is refused.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import pytest
import torch
from helpers import GEMMA4_TEXT, TINY_CONFIGS, VOCAB, make_model_dir
from safetensors.torch import load_file, save_file
from transformers import Gemma4TextConfig
from transformers.modeling_rope_utils import _compute_proportional_rope_parameters

from tokenmill.engine.worker.model_runner import build_model
from tokenmill.kernels import reference
from tokenmill.layers.attention import AttentionMetadata, KVCache
from tokenmill.layers.rotary import inverse_frequencies
from tokenmill.loader.model_config import ModelLoadError
from tokenmill.models.registry import load_model_config
from tokenmill.loader.kv_layout import KVSpec

GEMMA4_CONFIGS = sorted(name for name in TINY_CONFIGS if name.startswith("gemma4"))
LOGIT_ATOL = 1e-4
BLOCK_SIZE = 8
CHUNKS = (7, 16, 1, 3)  # query tokens per step, in turn: prefill chunks and decode-sized steps


def paged_caches(model: torch.nn.Module, num_blocks: int) -> list[KVCache]:
    """One ``(k, v)`` pair per cache-owning layer in its own shape; each layer gets its source's."""
    layout = model.config.kv_layout()
    owned = {i: KVCache(*(torch.zeros(num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim) for _ in range(2)))
             for i, spec in enumerate(layout.layers) if layout.source[i] == i}
    return [owned[src] for src in layout.source]


def paged_logits(model: torch.nn.Module, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every position's logits, the prompts run side by side in steps of ``CHUNKS`` tokens each, their
    blocks scattered over the pool."""
    blocks_per_seq = -(-max(map(len, prompts)) // BLOCK_SIZE)
    num_blocks = blocks_per_seq * len(prompts)
    kv_caches = paged_caches(model, num_blocks)
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).int().reshape(len(prompts), -1)
    done, rows = [0] * len(prompts), [[] for _ in prompts]
    for chunk in itertools.cycle(CHUNKS):
        if done == list(map(len, prompts)):
            return [torch.cat(r) for r in rows]
        spans = [(start, min(start + chunk, len(p))) for start, p in zip(done, prompts)]
        positions = torch.cat([torch.arange(lo, hi) for lo, hi in spans])
        slots = torch.cat([tables[b, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
                           for b, pos in enumerate(torch.arange(lo, hi) for lo, hi in spans)])
        lens = torch.tensor([hi - lo for lo, hi in spans])
        groups = len(model.config.kv_layout().groups)  # each its own caches: the same block ids serve all
        meta = AttentionMetadata(slot_mapping=(slots,) * groups,
                                 query_start_loc=torch.cat([torch.zeros(1), lens.cumsum(0)]).int(),
                                 seq_lens=torch.tensor([hi for _, hi in spans], dtype=torch.int32),
                                 block_tables=(tables,) * groups, max_query_len=int(lens.max()))
        ids = torch.cat([torch.tensor(p[lo:hi], dtype=torch.int64) for p, (lo, hi) in zip(prompts, spans)])
        logits = model.compute_logits(model(ids, positions, kv_caches, meta))
        for b, part in enumerate(logits.split(lens.tolist())):
            rows[b].append(part)
        done = [hi for _, hi in spans]


@pytest.mark.parametrize("name", GEMMA4_CONFIGS)
@torch.inference_mode()
def test_model_matches_transformers_through_paged_caches(name: str, tmp_path) -> None:
    """Two prompts longer than the sliding window, batched, in prefill chunks and one-token steps:
    every position's logits against transformers' forward over the whole prompt, run in float64.
    Ours, in float32, must stay within 1e-4 of that answer, or within twice transformers' own float32
    forward's distance from it where that is larger: the KV-sharing config is ill-conditioned enough
    that transformers' float32 logits are 3.5e-4 off on one of these prompts, and ours, with the same
    code and libraries, under 1e-4 on one CPU and 2.4e-4 on another."""
    reference_model = make_model_dir(name, tmp_path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (61, 38)]
    theirs_float32 = [reference_model(torch.tensor([prompt])).logits[0].double() for prompt in prompts]
    reference_model.double()
    model = build_model(load_model_config(tmp_path), tmp_path, torch.float32, torch.device("cpu"), max_positions=128)
    for prompt, ours, theirs32 in zip(prompts, paged_logits(model, prompts), theirs_float32):
        theirs = reference_model(torch.tensor([prompt])).logits[0]
        atol = max(LOGIT_ATOL, 2 * (theirs32 - theirs).abs().max().item())
        torch.testing.assert_close(ours.double(), theirs, atol=atol, rtol=0)


def test_kv_layout_gives_each_layer_its_shape_and_shared_layers_their_source(tmp_path) -> None:
    make_model_dir("gemma4-kv-shared", tmp_path)
    cfg = load_model_config(tmp_path)
    local, wide = KVSpec(2, 16, 24), KVSpec(2, 32, None)
    layout = cfg.kv_layout()
    assert layout.layers == (local, wide, local, local, wide)
    assert layout.source == (0, 1, 2, 2, 1)
    model = build_model(cfg, tmp_path, torch.float32, torch.device("cpu"), max_positions=64)
    for i in (3, 4):  # KV-shared: q alone, and a double-wide MLP
        names = {n for n, _ in model.model.layers[i].named_parameters()}
        assert "self_attn.q_proj.weight" in names and not any("k_norm" in n or "qkv" in n for n in names)
        assert model.model.layers[i].mlp.down_proj.in_features == 2 * cfg.intermediate_size


def _raw(name: str) -> dict:
    config = TINY_CONFIGS[name]()
    return {**config.to_dict(), "architectures": ["Gemma4ForCausalLM"]}


def _load(path: Path, raw: dict):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return load_model_config(path)


def test_released_config_spelling_parses_as_transformers_writes_it(tmp_path) -> None:
    """Released checkpoints give ``global_head_dim`` and ``num_global_key_value_heads``; transformers
    5.17+ writes ``per_layer_config`` overrides instead. Both mean the same layers."""
    written = _raw("gemma4")
    assert "per_layer_config" in written and "global_head_dim" not in written
    released = {k: v for k, v in written.items() if k != "per_layer_config"}
    released |= {"global_head_dim": 32, "num_global_key_value_heads": 1}
    parsed = _load(tmp_path / "written", written)
    assert parsed == _load(tmp_path / "released", released)
    assert (parsed.layer_head_dims, parsed.layer_kv_heads) == ((16, 32, 16, 32), (2, 1, 2, 1))


def test_global_kv_heads_apply_only_with_k_eq_v(tmp_path) -> None:
    """As in transformers: ``num_global_key_value_heads`` is read only where k is v."""
    raw = {k: v for k, v in _raw("gemma4").items() if k != "per_layer_config"}
    raw |= {"global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": False}
    assert _load(tmp_path, raw).layer_kv_heads == (2, 2, 2, 2)
    assert Gemma4TextConfig(**{**GEMMA4_TEXT, "global_head_dim": 32, "num_global_key_value_heads": 1}).to_dict()[
        "per_layer_config"]["1"] == {"head_dim": 32}


def test_last_layer_is_global_whatever_layer_types_say(tmp_path) -> None:
    raw = _raw("gemma4") | {"layer_types": ["sliding_attention"] * 4, "per_layer_config": {}}
    assert _load(tmp_path, raw).sliding_windows == (24, 24, 24, None)


def test_proportional_rope_frequencies_are_transformers() -> None:
    cases = [(32, 0.25, 1.0), (512, 0.25, 1.0), (32, 0.3, 2.0), (20, 0.5, 1.0), (16, 1.0, 1.0)]
    for head_dim, fraction, factor in cases:
        params = {"rope_type": "proportional", "partial_rotary_factor": fraction, "rope_theta": 10000.0,
                  "factor": factor}
        config = Gemma4TextConfig(**{**GEMMA4_TEXT, "global_head_dim": head_dim, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": params}})
        expected, _ = _compute_proportional_rope_parameters(config, layer_type="full_attention")
        assert torch.equal(inverse_frequencies(head_dim, 10000.0, params), expected)


def test_query_only_rotation_is_the_query_half_of_rotary_embedding() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    table = reference.rotary_cos_sin(inverse_frequencies(16, 100.0, None), 32)
    positions = torch.tensor([0, 3, 7, 8, 31])
    assert torch.equal(reference.rotary_embedding_query(positions, q, table),
                       reference.rotary_embedding(positions, q, k, table)[0])


@pytest.mark.parametrize(("key", "value", "message"), [
    ("enable_moe_block", True, "enable_moe_block"),
    ("use_bidirectional_attention", "all", "use_bidirectional_attention"),
    ("num_kv_shared_layers", 4, "KV-shared"),
    ("hidden_activation", "gelu", "hidden_activation"),
])
def test_unsupported_variants_are_refused(key: str, value, message: str, tmp_path) -> None:
    with pytest.raises(ModelLoadError, match=message):
        _load(tmp_path, _raw("gemma4") | {key: value})


def test_vision_and_audio_weights_are_skipped_with_one_log_line(tmp_path, caplog) -> None:
    make_model_dir("gemma4-multimodal", tmp_path)
    with caplog.at_level(logging.INFO, logger="tokenmill.models"):
        build_model(load_model_config(tmp_path), tmp_path, torch.float32, torch.device("cpu"), max_positions=64)
    assert len([r for r in caplog.records if "vision and audio" in r.getMessage()]) == 1


@torch.inference_mode()
def test_kv_tensors_of_shared_layers_in_a_checkpoint_are_dropped(tmp_path) -> None:
    """Some checkpoints carry k/v projections and norms for the KV-shared layers, which nothing reads."""
    make_model_dir("gemma4-kv-shared", tmp_path)
    path = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(path)
    cleaned = build_model(load_model_config(tmp_path), tmp_path, torch.float32, torch.device("cpu"), max_positions=64)
    for layer, source in ((3, 2), (4, 1)):
        for part in ("k_proj", "v_proj", "k_norm"):
            name = f"model.layers.{source}.self_attn.{part}.weight"
            tensors[name.replace(f"layers.{source}.", f"layers.{layer}.")] = tensors[name] + 1.0
    save_file(tensors, path, metadata={"format": "pt"})
    loaded = build_model(load_model_config(tmp_path), tmp_path, torch.float32, torch.device("cpu"), max_positions=64)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), cleaned.state_dict().values()))
