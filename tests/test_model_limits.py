"""What a model directory and the engine's size options may not do: a corrupt checkpoint is an error
that names the file and what is wrong with it, and a ``max_model_len`` beyond what the model
supports is refused before anything is allocated for it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from helpers import make_model_with_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.engine.core import builder
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.loader.model_config import ModelLoadError

MAX_POSITIONS = 512  # the tiny configs' max_position_embeddings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_with_tokenizer("llama2-tied", tmp_path_factory.mktemp("tiny-limits"))


def _copy(model_dir: Path, to: Path) -> Path:
    for path in model_dir.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    return to


def _header(data: bytes) -> tuple[dict, bytes]:
    """A safetensors file's JSON header and the bytes after it."""
    size = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + size]), data[8 + size:]


def _with_header(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _truncated(data: bytes) -> bytes:
    return data[:len(data) // 2]


def _garbage(data: bytes) -> bytes:
    return b"this is not a safetensors file"


def _unknown_dtype(data: bytes) -> bytes:
    header, body = _header(data)
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "Q9"
    return _with_header(header, body)


def _wrong_shape(data: bytes) -> bytes:
    header, body = _header(data)
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [dim * 2 for dim in header[name]["shape"]]
    return _with_header(header, body)


@pytest.mark.parametrize("corrupt", [_truncated, _garbage, _unknown_dtype, _wrong_shape],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_corrupt_safetensors_file_is_an_error_naming_it(model_dir: Path, tmp_path: Path, corrupt) -> None:
    broken = _copy(model_dir, tmp_path) / "model.safetensors"
    broken.write_bytes(corrupt(broken.read_bytes()))
    with pytest.raises(ModelLoadError) as info:
        LLM(str(tmp_path), device="cpu", dtype="float32")
    message = str(info.value)
    assert str(broken) in message and "not a safetensors file this engine can read" in message, message
    assert "Error while deserializing header" in message, message  # what the library found wrong


def test_a_broken_shard_index_is_an_error_naming_it(model_dir: Path, tmp_path: Path) -> None:
    index = _copy(model_dir, tmp_path) / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": ')
    with pytest.raises(ModelLoadError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        LLM(str(tmp_path), device="cpu", dtype="float32")
    index.write_text('{"weight_map": ["model.safetensors"]}')
    with pytest.raises(ModelLoadError, match=r"model\.safetensors\.index\.json must hold a weight_map object"):
        LLM(str(tmp_path), device="cpu", dtype="float32")


def test_a_max_model_len_beyond_the_model_is_refused_before_loading(model_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's rule: past ``max_position_embeddings`` the model was never trained, and the rotary
    table alone would be ``max_model_len`` rows (10**9: 128 GB here)."""
    def never(*args, **kwargs):
        raise AssertionError("the model was built for a max_model_len that is refused")

    monkeypatch.setattr(builder, "build_model", never)
    for asked in (10**9, MAX_POSITIONS + 1):
        with pytest.raises(ValueError) as info:
            LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=asked)
        message = str(info.value)
        assert message.startswith("max_model_len") and str(asked) in message, message
        assert f"max_position_embeddings {MAX_POSITIONS}" in message, message


def test_what_grows_with_max_model_len_is_sized_by_it(model_dir: Path) -> None:
    """The rotary tables hold ``max_model_len`` positions (the model's own length when unset), not more."""
    for asked, positions in ((64, 64), (None, MAX_POSITIONS), (MAX_POSITIONS, MAX_POSITIONS)):
        llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=asked, num_kv_blocks=64)
        tables = [m.cos_sin_cache for m in llm.engine.core.runner.model.modules() if isinstance(m, RotaryEmbedding)]
        assert tables and all(t.shape[0] == positions for t in tables), [t.shape for t in tables]
        assert llm.engine.max_model_len == positions
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        assert torch.isfinite(tables[0]).all()
