"""Which KV cache each layer of a model reads, and how those caches group by shape.

Layers differ: Gemma's sliding layers see only a window of recent tokens, Gemma 4's
global layers have wider heads and fewer of them, and Gemma 4's last layers read
the cache of an earlier layer instead of keeping their own. A KV group is the set
of layers sharing one ``KVSpec`` (KV heads, head dim, window): the engine keeps one
block pool and one block table per sequence for each group, so that a sliding
group can free the blocks its window has passed while a full group keeps them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from tokenmill.distributed import units_per_rank

# ``kv_cache_dtype`` names (vLLM's) → the dtype K and V are stored in; ``auto`` is the model's dtype.
QUANTIZED_KV_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_scale_dtype(head_dim: int) -> torch.dtype:
    """What a quantized cache stores its scales in: one a token and KV head, for K and for V, each a
    bfloat16 value (``quantize_kv`` rounds it so). Heads of 128 dims and more hold them as float32:
    four bytes are the narrowest the attention kernel's pipeline copies asynchronously with the K/V
    tiles (two-byte ones cost it four barriers an iteration), at 3% of the token's bytes. Narrower
    heads keep two bytes, within 53% of a bfloat16 cache's bytes at 64 dims."""
    return torch.float32 if head_dim >= 128 else torch.bfloat16


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_KV_DTYPES.values()


@dataclass(frozen=True)
class KVSpec:
    """The shape of one layer's cache: ``sliding_window`` None is a full-context layer."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one layer for one token stored in ``dtype``, with their scales where it is quantized."""
        scale = kv_scale_dtype(self.head_dim).itemsize if is_quantized(dtype) else 0
        return 2 * self.num_kv_heads * (self.head_dim * dtype.itemsize + scale)


@dataclass(frozen=True)
class KVLayout:
    """``layers[i]``: the spec of the cache layer ``i`` reads; ``source[i]``: the layer that owns
    that cache (``i`` itself, or an earlier layer of the same spec whose KV it shares)."""

    layers: tuple[KVSpec, ...]
    source: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.layers) != len(self.source):
            raise ValueError("a KV layout needs one source per layer")
        for i, src in enumerate(self.source):
            if not (0 <= src <= i and self.source[src] == src and self.layers[src] == self.layers[i]):
                raise ValueError(f"layer {i} cannot read the cache of layer {src}")

    @classmethod
    def uniform(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, sliding_windows: Sequence[int | None]
    ) -> KVLayout:
        """Every layer owns its cache, all of one head shape (windows may differ per layer)."""
        return cls(tuple(KVSpec(num_kv_heads, head_dim, w) for w in sliding_windows), tuple(range(num_layers)))

    def sharded(self, size: int) -> KVLayout:
        """One rank's share under tensor parallelism over ``size`` ranks: each spec with the KV heads a
        rank holds (one, replicated, where a spec has fewer heads than ranks), the groups unchanged."""
        if size == 1:
            return self
        local = KVLayout(
            tuple(replace(spec, num_kv_heads=units_per_rank(spec.num_kv_heads, size)) for spec in self.layers),
            self.source,
        )
        if len(local.groups) != len(self.groups):
            raise ValueError(
                f"KV cache groups {self.groups} would merge when split over {size} ranks: "
                "tensor parallelism does not support this layout"
            )
        return local

    @property
    def groups(self) -> tuple[KVSpec, ...]:
        """The distinct specs, in the order of the first layer of each."""
        return tuple(dict.fromkeys(self.layers))

    @property
    def layer_group(self) -> tuple[int, ...]:
        """The group of each layer."""
        index = {spec: g for g, spec in enumerate(self.groups)}
        return tuple(index[spec] for spec in self.layers)

    def owners(self, group: int) -> list[int]:
        """The layers of ``group`` that keep a cache of their own, in layer order."""
        spec = self.groups[group]
        return [i for i, s in enumerate(self.layers) if s == spec and self.source[i] == i]

    def group_bytes_per_token(self, group: int, dtype: torch.dtype) -> int:
        """K and V of every cache-owning layer of ``group``, for one token."""
        return len(self.owners(group)) * self.groups[group].bytes_per_token(dtype)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return sum(self.group_bytes_per_token(g, dtype) for g in range(len(self.groups)))

    def bytes_held(self, context: int, dtype: torch.dtype) -> int:
        """What one sequence of ``context`` tokens keeps: each cache-owning layer the tokens its
        window can still see (block rounding aside)."""
        return sum(
            spec.bytes_per_token(dtype)
            * (context if spec.sliding_window is None else min(context, spec.sliding_window))
            for i, spec in enumerate(self.layers)
            if self.source[i] == i
        )

    def full_length_bytes_per_token(self, dtype: torch.dtype) -> int:
        """What one token would take if every layer kept its own full-length cache (the
        baseline the savings of windows and sharing are measured against)."""
        return sum(spec.bytes_per_token(dtype) for spec in self.layers)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What K and V are stored in for ``kv_cache_dtype`` ``name`` (already one of ``auto`` and
    ``QUANTIZED_KV_DTYPES``' keys). float8 e4m3 needs a GPU that converts to it (compute capability
    8.9 or later: Ada, Hopper); older ones are told at start-up, not by a kernel that fails to build."""
    if name == "auto":
        return model_dtype
    dtype = QUANTIZED_KV_DTYPES[name]
    if device.type == "cuda" and dtype == torch.float8_e4m3fn:
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(
                f"kv_cache_dtype {name!r} needs a GPU of compute capability 8.9 or later "
                f"(this one is {capability[0]}.{capability[1]}): use 'int8' or 'fp8_e5m2'"
            )
    return dtype
