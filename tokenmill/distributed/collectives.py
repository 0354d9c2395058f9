"""The collectives of a tensor-parallel forward, each a no-op for an unsplit model.

All work in place on device tensors and never read them on the host, so they can be captured in
CUDA graphs. ``all_reduce`` is the one a decode step pays twice per layer: a faster small-message
implementation (torch's symmetric-memory one-shot/two-shot all-reduce) would be chosen here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tokenmill.distributed.group import TPGroup

# torch 2.10 renamed all_gather_into_tensor (whose old name now warns); older versions have only that.
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The sum of ``x`` over the ranks, in place; returns ``x``."""
    if tp.size > 1:
        dist.all_reduce(x, group=tp.group)
    return x


def all_gather(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Every rank's ``x`` joined along the last dimension, in rank order."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((tp.size * x.shape[0], *x.shape[1:]))
    _gather_into(out, x, group=tp.group)
    return torch.cat(out.view(tp.size, *x.shape).unbind(0), dim=-1)


def broadcast(x: torch.Tensor, tp: TPGroup, src: int = 0) -> torch.Tensor:
    """``x`` of rank ``src`` on every rank, in place; returns ``x``."""
    if tp.size > 1:
        dist.broadcast(x, src, group=tp.group)
    return x
