"""Every script under benchmarks/ loads on a machine without a GPU: what it imports from the package
(and from the scripts beside it) still exists, so a change to the package cannot leave a benchmark
that fails only when a GPU run reaches it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", sorted(BENCHMARKS.glob("*.py")), ids=lambda path: path.name)
def test_a_benchmark_script_loads(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the studies import each other, as when run from there
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.__doc__, f"{script.name} says what it measures and how to run it"
