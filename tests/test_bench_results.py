"""A benchmark's result file says where, when and how it was measured beside its rows."""

from __future__ import annotations

import json
import sys

from tokenmill.bench.hardware import Ceilings, write_rows


def test_a_result_file_carries_its_environment_and_rows(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_COMMIT", "abc1234")
    rows = [{"name": "study/x/m8", "floor_us": 6.3, "fraction_of_floor": 0.33}]
    path = tmp_path / "result.json"
    write_rows(str(path), Ceilings(bandwidth=4.2e12, matmul_rate=7.5e14), rows)
    written = json.loads(path.read_text())
    assert written["rows"] == rows
    env = written["environment"]
    assert env["commit"] == "abc1234" and env["command"] == " ".join(sys.argv) and env["date"]
    assert env["ceilings"] == {"bandwidth": 4.2e12, "matmul_rate": 7.5e14, "fp8_matmul_rate": None}
