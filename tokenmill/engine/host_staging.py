"""One host-to-device copy per step.

A step needs a dozen small arrays on the device (ids, positions, slots, block
tables, sampling parameters...). Copied one by one, each pays a pinned
allocation and a launch; packed into one pinned buffer they cross in a single
non-blocking copy and are sliced into typed views on the device.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16


class HostStaging:
    def __init__(self, device: torch.device, capacity: int = 1 << 20) -> None:
        self.device = device
        self._pinned: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._pinned = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)

    def send(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The arrays as device tensors of the same names, dtypes and shapes."""
        if self._pinned is None:
            return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
        offsets, total = [], 0
        for a in arrays.values():
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy must have left the buffer
        if total > self._pinned.numel():
            self._pinned = torch.empty(2 * total, dtype=torch.uint8, pin_memory=True)
        host = self._pinned.numpy()
        for a, off in zip(arrays.values(), offsets):
            host[off:off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        on_device = self._pinned[:total].to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return {name: on_device[off:off + a.nbytes].view(torch.from_numpy(a[:0].reshape(-1)).dtype).view(a.shape)
                for (name, a), off in zip(arrays.items(), offsets)}
