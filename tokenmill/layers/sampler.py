"""Batched sampling on the device with per-row parameters.

Every row of the batch may have its own logit bias, temperature, top-k, top-p,
min-p, penalties and seed. Sampling uses the exponential race (``argmax(p / E)`` with
``E ~ Exp(1)``, ``ops.sample``), which draws from ``p`` exactly and lets each seeded row take
its noise from its own generator, so a seeded request gives the same tokens
whatever else shares the batch. Only the sampled ids and the requested
logprobs leave the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.layers import ops


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device tensors (built by the model runner)."""

    temperature: torch.Tensor  # [N] float32; 0 = greedy
    inv_temperature: torch.Tensor  # [N] float32: ``inverse_temperature`` of the temperatures
    top_k: torch.Tensor  # [N] int64; 0 = off
    top_p: torch.Tensor  # [N] float32; 1 = off
    min_p: torch.Tensor  # [N] float32; 0 = off
    repetition_penalty: torch.Tensor  # [N] float32; 1 = off
    presence_penalty: torch.Tensor  # [N] float32
    frequency_penalty: torch.Tensor  # [N] float32
    generators: list[torch.Generator | None]  # per row; None = the global generator
    num_logprobs: int  # the largest top-N any row asked for; -1 = none
    # Only when a row uses penalties: the token tables (output counts [R, V] float32, prompt mask
    # [R, V] bool) and each row's row in them [N].
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Tokens a row may not sample yet (stop tokens before min_tokens): (rows, token ids).
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    # Per-row logit_bias, added to the raw logits: (rows, token ids, float32 values).
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    all_greedy: bool = False
    # The largest top-k of a sampled row that cuts the vocabulary (the model runner's ``max_top_k``;
    # 0: none): only that many values of each row are put in order.
    max_top_k: int = 0
    # Rows whose generator's state is kept after their draw (speculative rows: the engine winds the
    # generator back to the last row it keeps, so each emitted token costs one draw, as in plain decoding).
    keep_generator_states: frozenset[int] = frozenset()


_MIN_TEMPERATURE = float(np.float32(1e-6))


def inverse_temperature(temperature: float) -> float:
    """``1 / temperature`` of a sampled row (a temperature below 1e-6 as 1e-6), 0 of a greedy one, as
    float32 computes it (the quotient of two float32 values, correctly rounded to float32, is what
    float64 division rounded to float32 gives): computed on the host once a sequence and sent with a
    step's other sampling columns."""
    t = float(np.float32(temperature))
    return float(np.float32(1.0 / max(t, _MIN_TEMPERATURE))) if t > 0 else 0.0


@dataclass
class SamplerOutput:
    """On the sampling device: the caller copies them out without waiting (see ModelRunner)."""

    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N, 1 + num_logprobs] float32 (sampled first)
    logprob_token_ids: torch.Tensor | None  # [N, 1 + num_logprobs] int64
    generator_states: dict[int, torch.Tensor] | None = None  # row -> its generator's state after its draw


def largest_logits(logits: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Each row's ``max_top_k`` largest logits in order (``[N, 0]`` when no row has a top-k): where
    each top-k row finds its threshold (``reference.kth_largest``)."""
    if max_top_k <= 0:
        return logits.new_empty((logits.shape[0], 0))
    return logits.topk(max_top_k, dim=-1).values


def exponential_noise(
    shape: tuple[int, int],
    generators: list[torch.Generator | None],
    device: torch.device,
    keep_states: frozenset[int] = frozenset(),
    states: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Exp(1) noise, each seeded row from its own generator, the rest in one draw; the generator
    state after the draw of each row in ``keep_states`` goes into ``states``."""
    noise = torch.empty(shape, device=device).exponential_()
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
            if row in keep_states and states is not None:
                states[row] = gen.get_state()
    return noise


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logprob of ``token_ids`` followed by its ``num_top`` best: ``[N, 1 + num_top]``."""
    chosen = logprobs.gather(-1, token_ids[:, None])
    if num_top <= 0:
        return chosen, token_ids[:, None]
    top = logprobs.topk(num_top, dim=-1)
    return torch.cat([chosen, top.values], dim=-1), torch.cat([token_ids[:, None], top.indices], dim=-1)


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        greedy_ids: torch.Tensor | None = None,
        finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """``greedy_ids``: the argmax of ``logits`` if already taken (inside a CUDA graph);
        used unless a logit bias, penalties or banned tokens change the logits first. ``finish``: an
        increasing map of ``logits`` to the model's logits, in place (the model's ``finish_logits_``),
        skipped where ``greedy_ids`` alone answer."""
        if batch.penalties is not None or batch.banned is not None or batch.logit_bias is not None:
            greedy_ids = None
        if batch.all_greedy and batch.num_logprobs < 0 and greedy_ids is not None:
            return SamplerOutput(greedy_ids, None, None)
        if finish is not None:
            logits = finish(logits)
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if batch.num_logprobs >= 0 else None
        if batch.logit_bias is not None:
            rows, token_ids, bias = batch.logit_bias
            # Out of place: ``logits`` may be the caller's tensor (a graph's static output). One scatter
            # of atomic adds (an accumulating ``index_put`` sorts its indices first).
            logits = logits.reshape(-1).scatter_add(0, rows * logits.shape[-1] + token_ids, bias).view_as(logits)
        if batch.penalties is not None:
            counts, prompt, rows = batch.penalties
            logits = ops.apply_penalties(
                logits, counts, prompt, rows, batch.repetition_penalty, batch.presence_penalty, batch.frequency_penalty
            )
        if batch.banned is not None:
            # The value made on the device: an item assignment (``logits[banned] = -inf``) copies it
            # there synchronously, and the host would wait for the step in flight.
            logits.index_put_(batch.banned, logits.new_full((), float("-inf")))
        if greedy_ids is None:
            greedy_ids = ops.argmax_rows(logits)
        states: dict[int, torch.Tensor] = {}
        if batch.all_greedy:
            token_ids = greedy_ids
        else:
            noise = exponential_noise(
                (logits.shape[0], logits.shape[1]), batch.generators, logits.device, batch.keep_generator_states, states
            )
            token_ids = ops.sample(
                logits,
                noise,
                batch.inv_temperature,
                batch.top_k,
                largest_logits(logits, batch.max_top_k),
                batch.top_p,
                batch.min_p,
                greedy_ids,
            )
        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None, states or None)
        values, ids = gather_logprobs(raw_logprobs, token_ids, batch.num_logprobs)
        return SamplerOutput(token_ids, values, ids, states or None)
