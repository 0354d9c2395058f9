"""How a run of equal units (attention heads, KV heads, rows of an MLP) is divided among ranks.

Each rank takes an equal, contiguous share; where there are fewer units than ranks (a model with
fewer KV heads than GPUs), each rank holds the one unit its position falls in, so each KV head is
replicated on ``size / units`` ranks. Both rules need the counts to divide evenly.
"""

from __future__ import annotations


def units_per_rank(units: int, size: int) -> int:
    return units // size if units >= size else 1


def first_unit(units: int, rank: int, size: int) -> int:
    """The first unit rank ``rank`` holds (with fewer units than ranks: the one it holds)."""
    return rank * units // size


def check_divides(what: str, units: int, size: int) -> None:
    """A ValueError naming the numbers unless ``units`` of ``what`` split evenly over ``size`` ranks
    (or, when fewer, are each replicated on as many ranks)."""
    if units >= size and units % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {units} {what}")
    if units < size and size % units:
        raise ValueError(
            f"the model's {units} {what} cannot be replicated evenly over tensor_parallel_size "
            f"{size} (it must be a multiple of {units})"
        )
