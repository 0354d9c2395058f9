"""The architecture registry: every registered family parses and builds, unsupported
names fail with the supported list, and nested ``text_config`` configs are read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import TINY_CONFIGS, make_model_dir
from tokenmill.engine.worker.model_runner import build_model
from tokenmill.loader.model_config import ModelLoadError
from tokenmill.models.registry import load_model_config
from tokenmill.models.registry import SUPPORTED_ARCHITECTURES, model_class


def tiny_config_dir(name: str, path: Path) -> Path:
    """``config.json`` of tiny config ``name`` alone (no weights), named by its architecture."""
    config = TINY_CONFIGS[name]()
    raw = {**config.to_dict(), "architectures": [type(config).__name__.replace("Config", "ForCausalLM")]}
    (path / "config.json").write_text(json.dumps(raw))
    return path


def test_unsupported_architecture_lists_the_supported_ones(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError) as err:
        load_model_config(tmp_path)
    assert "GPT2LMHeadModel" in str(err.value)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


def test_missing_field_names_it(tmp_path) -> None:
    raw = json.loads((tiny_config_dir("llama3", tmp_path) / "config.json").read_text())
    del raw["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="lacks the field 'hidden_size'"):
        load_model_config(tmp_path)


def test_nested_text_config_is_read(tmp_path) -> None:
    flat = load_model_config(tiny_config_dir("qwen3", tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    nested = {"architectures": raw["architectures"], "text_config": raw}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert load_model_config(tmp_path) == flat


def test_every_registered_architecture_is_covered_and_builds(tmp_path) -> None:
    built = set()
    for name in TINY_CONFIGS:
        model_dir = tmp_path / name
        make_model_dir(name, model_dir)
        cfg = load_model_config(model_dir)
        model = build_model(cfg, model_dir, torch.float32, torch.device("cpu"), max_positions=64)
        assert isinstance(model, model_class(cfg))
        built.add(cfg.architecture)
    assert built == set(SUPPORTED_ARCHITECTURES)
