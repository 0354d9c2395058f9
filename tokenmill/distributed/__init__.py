"""Tensor parallelism's communication: each process's place among the ranks a model is split
over, the rule that splits a run of heads or rows among them, and the collectives the layers call.

Layers call ``all_reduce`` / ``all_gather`` / ``broadcast`` from here and nowhere else, so a faster
implementation (torch's symmetric-memory all-reduce on the GPU) is dispatched in one place.
"""

from tokenmill.distributed.collectives import all_gather, all_reduce, broadcast
from tokenmill.distributed.group import (
    SINGLE,
    TPGroup,
    backend_for,
    current_group,
    destroy_group,
    init_group,
    sharding_for,
)
from tokenmill.distributed.sharding import check_divides, first_unit, units_per_rank

__all__ = [
    "SINGLE",
    "TPGroup",
    "all_gather",
    "all_reduce",
    "backend_for",
    "broadcast",
    "check_divides",
    "current_group",
    "destroy_group",
    "first_unit",
    "init_group",
    "sharding_for",
    "units_per_rank",
]
