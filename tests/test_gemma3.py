"""Gemma 3 beyond the shared parity run (tests/test_parity.py covers the ``gemma3`` and
``gemma3-multimodal`` tiny configs): attention-logit softcapping, the config spellings
of older checkpoints, and what is refused.

transformers 5 reads ``attn_logit_softcapping`` for Gemma 3 but never passes it to its
attention function, so its output ignores it. We apply it, as the config states (and as
Gemma 2 does); the reference here is transformers' own eager Gemma 3 attention given the
softcap, registered as an attention implementation.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, Gemma3TextConfig
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

from helpers import GEMMA3_TEXT, TINY_CONFIGS, make_model_dir
from parity_helpers import assert_engine_matches
from tokenmill import LLM, SamplingParams
from tokenmill.engine.worker.model_runner import build_model
from tokenmill.loader.model_config import ModelLoadError
from tokenmill.models.registry import load_model_config

SOFTCAPPED = "softcapped_eager"


def _softcapped_eager(module: torch.nn.Module, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    return eager_attention_forward(module, *args, softcap=module.attn_logit_softcapping, **kwargs)


AttentionInterface.register(SOFTCAPPED, _softcapped_eager)
AttentionMaskInterface.register(SOFTCAPPED, eager_mask)


@pytest.mark.parametrize("final_softcap", [None, 5.0])
def test_attention_softcapping_parity(final_softcap: float | None, tmp_path) -> None:
    torch.manual_seed(0)
    config = Gemma3TextConfig(**GEMMA3_TEXT, sliding_window_pattern=2, attn_logit_softcapping=2.0,
                              final_logit_softcapping=final_softcap)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=SOFTCAPPED).eval()
    model.save_pretrained(tmp_path)
    assert_engine_matches(model, tmp_path)


def test_prompt_logprobs_take_the_final_softcap(tmp_path) -> None:
    """Greedy steps skip the final softcap (an increasing map: the head's argmax is the token), but a
    prompt's logprobs are read from the capped logits, as transformers' are. A cap of 2 moves every
    logprob far from the uncapped one."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(**GEMMA3_TEXT, sliding_window_pattern=2, final_logit_softcapping=2.0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    prompt = [(7 * i + 3) % config.vocab_size for i in range(40)]
    out = LLM(str(tmp_path), device="cpu", dtype="float32").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
    expected = expected[torch.arange(len(prompt) - 1), prompt[1:]]
    got = torch.tensor([lp[token] for token, lp in zip(prompt[1:], out.prompt_logprobs[1:])])
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def _write_config(path: Path, raw: dict) -> Path:
    (path / "config.json").write_text(json.dumps(raw))
    return path


def test_older_config_spellings_parse_alike(tmp_path) -> None:
    """``rope_theta`` + ``rope_scaling`` + ``rope_local_base_freq`` and ``sliding_window_pattern``
    (transformers 4) mean what transformers 5's ``rope_parameters`` and ``layer_types`` say."""
    new = TINY_CONFIGS["gemma3"]().to_dict()
    new["architectures"] = ["Gemma3ForCausalLM"]
    rope = new.pop("rope_parameters")
    old = {**new, "rope_theta": rope["full_attention"]["rope_theta"],
           "rope_scaling": {"rope_type": "linear", "factor": rope["full_attention"]["factor"]},
           "rope_local_base_freq": rope["sliding_attention"]["rope_theta"], "sliding_window_pattern": 2}
    del old["layer_types"]
    new["rope_parameters"] = rope
    (tmp_path / "new").mkdir()
    (tmp_path / "old").mkdir()
    parsed = load_model_config(_write_config(tmp_path / "new", new))
    assert parsed == load_model_config(_write_config(tmp_path / "old", old))
    assert parsed.sliding_windows == (24, None, 24)
    assert (parsed.rope_theta, parsed.local_rope_theta) == (100000.0, 1000.0)
    assert parsed.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_bidirectional_attention_is_refused(tmp_path) -> None:
    raw = {**TINY_CONFIGS["gemma3"]().to_dict(), "architectures": ["Gemma3ForCausalLM"],
           "use_bidirectional_attention": True}
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        load_model_config(_write_config(tmp_path, raw))


def test_vision_weights_are_skipped_with_one_log_line(tmp_path, caplog) -> None:
    make_model_dir("gemma3-multimodal", tmp_path)
    cfg = load_model_config(tmp_path)
    with caplog.at_level(logging.INFO, logger="tokenmill.models.gemma3"):
        build_model(cfg, tmp_path, torch.float32, torch.device("cpu"), max_positions=64)
    assert len([r for r in caplog.records if "vision" in r.getMessage()]) == 1
