"""Every script under benchmarks/ (suite/, profile/, studies/) loads on a machine without a GPU: what
it imports from the package (and from the scripts beside it) still exists, so a change to the package
cannot leave a benchmark that fails only when a GPU run reaches it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(path for folder in ("suite", "profile", "studies") for path in (BENCHMARKS / folder).glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_a_benchmark_script_loads(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(script.parent))  # scripts import the ones beside them, as when run
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # as an imported module is (dataclasses look it up)
    spec.loader.exec_module(module)
    assert module.__doc__, f"{script.name} says what it measures and how to run it"


def test_idle_gaps_count_only_time_no_kernel_covers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel profile's idle time: from the latest end so far to the next start, charged to the
    kernel that ended last; a kernel that overlaps another (PDL, a second stream) leaves no gap."""
    monkeypatch.syspath_prepend(str(BENCHMARKS / "profile"))
    from profile_kernels import idle_gaps

    spans = [("b", 12.0, 20.0), ("a", 0.0, 10.0), ("c", 15.0, 18.0), ("d", 25.0, 30.0), ("b", 31.0, 32.0)]
    assert idle_gaps(spans) == {("a", "b"): 2.0, ("b", "d"): 5.0, ("d", "b"): 1.0}
    assert idle_gaps([("x", 0.0, 5.0), ("y", 1.0, 3.0), ("z", 4.0, 6.0)]) == {}


def test_loops_counts_each_body_from_its_label_to_its_last_backward_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernel_sass's loop report: the instructions from a label to the last branch back to it, longest
    first; a forward branch is no loop, and a predicate is not an opcode."""
    monkeypatch.syspath_prepend(str(BENCHMARKS / "profile"))
    from kernel_sass import loops

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   FMUL R2, R2, R3 ;
        /*0020*/              @!P0 BRA `(.L_x_1) ;
        /*0030*/                   BRA `(.L_x_3) ;
.L_x_2:
        /*0040*/                   IMMA.16832.S8.S8.SAT R4, R6, R8, R4 ;
        /*0050*/                   FMUL R2, R2, R3 ;
        /*0060*/               @P1 FFMA R2, R2, R3, R4 ;
        /*0070*/              @!P0 BRA `(.L_x_2) ;
.L_x_3:
        /*0080*/                   EXIT ;
"""
    assert [dict(body) for body in loops(sass)] == [{"IMMA.16832.S8.S8.SAT": 1, "FMUL": 1, "FFMA": 1, "BRA": 1},
                                                    {"FMUL": 1, "BRA": 1}]
    assert not loops(sass.replace("`(.L_x_2)", "`(.L_x_3)").replace("`(.L_x_1)", "`(.L_x_3)"))
