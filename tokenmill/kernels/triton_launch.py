"""Programmatic dependent launch (PDL) for the Triton kernels.

A decode step at small batch is a chain of a few hundred kernels, most of them
small, and between two kernels the GPU pays the launch of the second and the
ramp-down of the first. Launched with PDL (Hopper and later), a kernel may be
scheduled while its predecessor still runs: it calls ``wait_for_previous_kernel``
before it reads or writes anything an earlier kernel touches, so what overlaps
the predecessor is only its launch and whatever precedes the wait (a GEMV's
first weight tile, which no kernel writes). Waiting is transitive: a kernel
that waited has seen everything its predecessor waited for, so every kernel
must wait, even one that reads nothing the previous one wrote.

``TOKENMILL_PDL=0`` turns it off (for measuring it); call
``pdl_supported.cache_clear()`` after changing it in a running process.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter, which runs no PTX."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def pdl_supported(device_index: int) -> bool:
    if interpreted() or os.environ.get("TOKENMILL_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch_args(device: torch.device) -> dict[str, Any]:
    """The kernel's ``PDL`` flag and, when on, the launch option that goes with it."""
    if device.type == "cuda" and pdl_supported(
        device.index if device.index is not None else torch.cuda.current_device()
    ):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        # Past the wait this kernel needs nothing more from the one before: let the next one launch.
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors, which a launch's grid is sized to fill (1 on the CPU:
    the interpreter has no parallelism to fill)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
