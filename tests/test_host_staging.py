"""HostStaging's packing into one buffer, checked on the CPU (the buffer is not pinned and the copy
to the device is the buffer itself; tests/test_gpu_engine.py runs it on CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.engine.worker.host_staging import HostStaging

DTYPES = [np.int64, np.int32, np.float32, np.bool_]

shapes = st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple)
arrays_strategy = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=4),
                                  st.tuples(st.sampled_from(DTYPES), shapes), min_size=1, max_size=12)


class _Done:
    """A CUDA event's stand-in: the CPU's copy is done when it returns."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.fixture
def staging(monkeypatch: pytest.MonkeyPatch) -> HostStaging:
    monkeypatch.setattr(torch.cuda, "Event", _Done)
    staging = HostStaging(torch.device("cpu"))
    staging._pinned = torch.empty(1 << 16, dtype=torch.uint8)  # the CUDA path's buffer, unpinned
    return staging


# One staging for every example, as the engine sends every step through one.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=arrays_strategy, seed=st.integers(0, 2**32 - 1))
def test_every_array_comes_back_whole_and_aligned(staging: HostStaging, spec: dict, seed: int) -> None:
    """Any mix of dtypes and shapes, empty ones included: each array back under its name with its
    dtype, shape and values, on a 16-byte boundary, and so is each slice along its first axis (a KV
    group's table), which is contiguous."""
    rng = np.random.default_rng(seed)
    arrays = {name: (rng.integers(-1 << 40, 1 << 40, shape) if dtype is np.int64 else rng.random(shape) * 100)
              .astype(dtype) for name, (dtype, shape) in spec.items()}
    sent = staging.send(arrays)
    assert list(sent) == list(arrays)
    for name, a in arrays.items():
        got = sent[name]
        assert tuple(got.shape) == a.shape and got.dtype == torch.from_numpy(a).dtype
        np.testing.assert_array_equal(got.numpy(), a)
        if a.size:
            assert got.data_ptr() % 16 == 0
        if a.ndim > 1 and a.size:
            assert all(part.data_ptr() % 16 == 0 and part.is_contiguous() for part in got)


def test_arrays_do_not_overlap(staging: HostStaging) -> None:
    """Writing one sent array's memory leaves every other one as sent (each has its own bytes)."""
    arrays = {"ids": np.arange(5), "lens": np.arange(3, dtype=np.int32), "tables": np.ones((2, 3, 5), np.int32),
              "floats": np.full((7, 3), 0.5, np.float32), "top_k": np.arange(3)}
    sent = staging.send(arrays)
    for name in arrays:
        sent[name].fill_(0)
        for other, a in arrays.items():
            if other != name:
                np.testing.assert_array_equal(sent[other].numpy(), a)
        sent[name].copy_(torch.from_numpy(arrays[name]))
