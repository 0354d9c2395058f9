"""Word of every Triton kernel variant this process compiles from now on.

The engine compiles every variant a step can take at start-up (its warm-up and graph captures); a
variant first met inside a step makes that step wait for Triton, a second or more for the attention
kernel. Such a compile is a shape the warm-up missed: the engine counts and logs each one, so that a
user sees it in the log and in ``/metrics`` rather than as one slow request.

Triton's ``jit_cache_hook`` runs before each compile or load from its on-disk cache (not when a
variant is already in memory): one hook for the whole process, so the last watcher set wins.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import triton


def watch_compiles(on_compile: Callable[[str, str], None] | None) -> None:
    """From now on call ``on_compile`` with the kernel's name and the variant (Triton's account of it:
    each argument's type and what it was specialized on, e.g. ``*bf16D`` for a pointer on a 16-byte
    boundary, ``i32D`` for a multiple of 16, a constant for an integer of 1) before each variant is
    compiled (None: stop watching). The compile goes ahead either way. A bound method is held weakly:
    the hook lives as long as the process, and must not keep its object (an engine, with its KV cache)
    alive; once that is gone the hook does nothing."""
    if on_compile is None:
        triton.knobs.runtime.jit_cache_hook = None
        return
    target = weakref.WeakMethod(on_compile) if inspect.ismethod(on_compile) else lambda: on_compile

    def hook(*, fn: Any, repr: str, **_: Any) -> bool:
        call = target()
        if call is not None:
            call(fn.name, repr)
        return False  # a true answer would skip the compile

    triton.knobs.runtime.jit_cache_hook = hook
