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
        a variant the warm-up cannot foresee. Arrays of one dtype lie side by side and are cut apart
        with one ``split``: a torch call costs the host microseconds, and a step sends about twenty
        arrays."""
        if self._pinned is None:
            return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
        by_dtype: dict[np.dtype, list[str]] = {}
        for name, a in arrays.items():
            by_dtype.setdefault(a.dtype, []).append(name)
        regions, total = [], 0  # (dtype, names, byte offset, each one's elements with its padding)
        slices: dict[str, tuple[int, int, int]] = {}  # each array's slices, their elements, and with padding
        for dtype, names in by_dtype.items():
            per_align = _ALIGN // dtype.itemsize
            for name in names:
                a = arrays[name]
                count, each = (a.shape[0], int(np.prod(a.shape[1:]))) if a.ndim > 1 else (1, a.size)
                slices[name] = (count, each, -(-each // per_align) * per_align)
            spans = [count * padded for count, _, padded in map(slices.__getitem__, names)]
            regions.append((dtype, names, total, spans))
            total += sum(spans) * dtype.itemsize
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy must have left the buffer
        if total > self._pinned.numel():
            self._pinned = torch.empty(2 * total, dtype=torch.uint8, pin_memory=True)
        host = self._pinned.numpy()
        for dtype, names, offset, spans in regions:
            view = host[offset:offset + sum(spans) * dtype.itemsize].view(dtype)
            at = 0
            for name, span in zip(names, spans):
                count, each, padded = slices[name]
                view[at:at + span].reshape(count, padded)[:, :each] = arrays[name].reshape(count, each)
                at += span
        on_device = self._pinned[:total].to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        out = {}
        for dtype, names, offset, spans in regions:
            region = on_device[offset:offset + sum(spans) * dtype.itemsize].view(_torch_dtype(dtype))
            for name, part in zip(names, region.split(spans)):
                count, each, padded = slices[name]
                shape = arrays[name].shape
                if len(shape) <= 1:
                    out[name] = part[:each].view(shape)
                else:  # each slice contiguous, one padded stride apart
                    out[name] = part.view(count, padded)[:, :each].unflatten(1, shape[1:])
        return {name: out[name] for name in arrays}
