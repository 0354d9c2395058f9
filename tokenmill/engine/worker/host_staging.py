"""One host-to-device copy per step.

A step needs a dozen small arrays on the device (ids, positions, slots, block
tables, sampling parameters...). Copied one by one, each pays a pinned
allocation and a launch; packed into one pinned buffer they cross in a single
non-blocking copy and are sliced into typed views on the device.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

_ALIGN = 16


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


def to_device(values: list | tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, without making the host wait: ``torch.tensor(values,
    device=...)`` copies synchronously, so it waits for every kernel queued before it (the step in
    flight, the forward just launched) and the host loses its lead on the GPU. From pageable memory
    the copy is staged at once and the buffer is free when this returns."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class HostStaging:
    def __init__(self, device: torch.device, capacity: int = 1 << 20) -> None:
        self.device = device
        self._pinned: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._pinned = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)

    def send(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The arrays as device tensors of the same names, dtypes and shapes, each starting on a
        16-byte boundary (Triton compiles a kernel again for a pointer that is not), and so does each
        slice along the first axis of an array of two or more dimensions: a model with several KV
        groups gives each group's slots and block tables to its layers as a tensor of its own, and
        slices packed end to end would start wherever the step's token or sequence count put them,
        a variant the warm-up cannot foresee. Each array is one strided view of the copied buffer
        (one torch call: a step sends about a dozen arrays, and each torch call costs the host
        microseconds)."""
        if self._pinned is None:
            return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
        layout = []  # (name, array, its slices, their elements, with padding, element offset)
        total = 0  # bytes, a multiple of 16 after every array
        for name, a in arrays.items():
            count, each = (a.shape[0], a.size // a.shape[0] if a.shape[0] else 0) if a.ndim > 1 else (1, a.size)
            per_align = _ALIGN // a.itemsize
            padded = -(-each // per_align) * per_align
            layout.append((name, a, count, each, padded, total // a.itemsize))
            total += count * padded * a.itemsize
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy must have left the buffer
        if total > self._pinned.numel():
            self._pinned = torch.empty(2 * total, dtype=torch.uint8, pin_memory=True)
        host_bytes = self._pinned.numpy()
        host: dict[np.dtype, np.ndarray] = {}
        for _, a, count, each, padded, at in layout:
            view = host.get(a.dtype)
            if view is None:
                view = host[a.dtype] = host_bytes[:total].view(a.dtype)
            if count == 1 or padded == each:
                view[at : at + count * each] = a.reshape(-1)
            else:
                view[at : at + count * padded].reshape(count, padded)[:, :each] = a.reshape(count, each)
        on_device = self._pinned[:total].to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        typed: dict[np.dtype, torch.Tensor] = {}
        out = {}
        for name, a, _, _, padded, at in layout:
            region = typed.get(a.dtype)
            if region is None:
                region = typed[a.dtype] = on_device.view(_torch_dtype(a.dtype))
            strides = [1] * a.ndim
            for d in range(a.ndim - 2, -1, -1):
                strides[d] = strides[d + 1] * a.shape[d + 1]
            if a.ndim > 1:
                strides[0] = padded  # each slice one padded stride apart
            out[name] = region.as_strided(a.shape, strides, at)
        return out
