"""The process group of one engine's tensor-parallel ranks.

A process belongs to at most one group (torch.distributed's default group). Layers learn which
rank they are built for from ``current_group()``, which is the group only inside ``sharding_for``:
an unsplit engine built in the same process while a split one runs still builds whole layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This process's rank among ``size``; ``size`` 1 is an unsplit model, with no process group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None


SINGLE = TPGroup()
_current = SINGLE


def current_group() -> TPGroup:
    """The group the layers being built now are split for."""
    return _current


@contextlib.contextmanager
def sharding_for(tp: TPGroup) -> Iterator[None]:
    """Layers built inside hold ``tp.rank``'s share of ``tp.size``."""
    global _current
    previous, _current = _current, tp
    try:
        yield
    finally:
        _current = previous


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(device: torch.device, rank: int, size: int, init_method: str, timeout: timedelta) -> TPGroup:
    """Join the group of ``size`` ranks that meet at ``init_method`` (a ``file://`` store on one host,
    or a ``tcp://`` address); NCCL on CUDA, gloo on the CPU. Raises ValueError if this process is
    already in a group (one tensor-parallel engine per process)."""
    if dist.is_initialized():
        raise ValueError(
            "this process already belongs to a torch.distributed process group: a tensor-parallel "
            "engine needs one of its own (shut the other engine down first)"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    return TPGroup(rank, size, dist.group.WORLD)


def destroy_group(abort: bool = False) -> None:
    """Leave this process's group, if it is in one. ``abort``: a peer died, so NCCL's communicator may
    hold collectives that never finish; abort it rather than wait for them."""
    if not dist.is_initialized():
        return
    if abort and dist.get_backend() == "nccl":
        with contextlib.suppress(Exception):  # best effort: the engine is going down either way
            world = dist.group.WORLD
            assert world is not None  # set while initialized
            world._get_backend(torch.device("cuda")).abort()
    dist.destroy_process_group()
