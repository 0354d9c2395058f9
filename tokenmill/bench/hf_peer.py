"""transformers on the same GPU, in the same run: the peer every figure stands beside."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from tokenmill.bench.shapes import shape_dir


def _model(shape: str) -> Any:
    """A transformers causal LM (its class is picked at run time from the shape's config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(shape_dir(shape)))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def _free(model: torch.nn.Module) -> None:
    del model
    gc.collect()
    torch.cuda.empty_cache()


@torch.inference_mode()
def decode_ms_per_step(shape: str, batch: int, context: int, new_tokens: int = 33) -> float:
    """Eager ``generate``'s decode step: (time for n tokens - time for 1) / (n - 1), so the
    prefill is left out as it is for tokenmill's figure."""
    model = _model(shape)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(2)  # warm-up
    ms = (run(new_tokens) - run(1)) / (new_tokens - 1) * 1e3
    _free(model)
    return ms


def generate_batch(shape: str, workload: list[tuple[list[int], int]]) -> dict:
    """transformers' continuous batching (``generate_batch``, paged sdpa) on a subset of the
    workload; one ``max_new_tokens`` serves all, so it is the subset's mean output length.
    (No inference mode here: its worker thread updates tensors created in this one.)"""
    from transformers import GenerationConfig

    model = _model(shape)
    prompts = [p for p, _ in workload]
    new_tokens = round(sum(n for _, n in workload) / len(workload))
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=config)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    generated = sum(len(out.generated_tokens) for out in outputs.values())
    _free(model)
    return {
        "requests": len(prompts),
        "max_new_tokens": new_tokens,
        "seconds_including_warmup": seconds,
        "output_tokens": generated,
        "output_tok_per_s": generated / seconds,
    }
