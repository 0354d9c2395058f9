"""Rotary position embeddings, with linear and Llama 3 frequency scaling, and Gemma 4's
proportional (partial) RoPE.

The cos/sin table is computed once at start-up for every position the engine
can see, in float32 and with the same arithmetic as transformers, so that
positions index a table instead of recomputing trigonometry each step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenmill.kernels.reference import rotary_cos_sin


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair rotation frequencies; ``scaling`` of type linear divides them all by its factor
    (position interpolation, Gemma 3's global layers), llama3 stretches the low ones, proportional
    rotates only the leading pairs (Gemma 4's global layers)."""
    if scaling is not None and scaling["rope_type"] == "proportional":
        return proportional_inverse_frequencies(head_dim, theta, scaling)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def proportional_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Partial RoPE kept at full width, as transformers computes it: the first
    ``partial_rotary_factor`` of the pairs get the frequencies a full-width head would give them
    (exponents over ``head_dim``, not over the rotated width), the remaining pairs frequency zero, so
    they pass unrotated (cos 1, sin 0); every frequency is then divided by ``factor``. Pairs are
    rotate-half pairs ``(j, j + head_dim / 2)``, so the unrotated dims are the tail of each half."""
    rotated_pairs = int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    exponents = torch.arange(0, 2 * rotated_pairs, 2, dtype=torch.int64, device="cpu").float() / head_dim
    unrotated = torch.zeros(head_dim // 2 - rotated_pairs, dtype=torch.float32, device="cpu")
    inv_freq = torch.cat([1.0 / (theta**exponents), unrotated])
    return inv_freq / float(scaling.get("factor", 1.0))


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table; attention applies it (fused with the KV-cache write)."""

    cos_sin_cache: torch.Tensor  # a buffer

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        # Computed on the CPU whatever the model's device, so every device sees the same table.
        table = rotary_cos_sin(inverse_frequencies(head_dim, theta, scaling), max_positions)
        self.register_buffer("cos_sin_cache", table.to(torch.empty(0).device), persistent=False)
