"""The ceilings every benchmark is measured against, taken on the GPU in the same run:
device-memory bandwidth, the bf16 matrix rate and, where the GPU has FP8 matrix units, theirs."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch


def time_cuda(fn, warmup: int = 3, repeat: int = 10) -> float:
    """Median seconds of ``fn`` on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


@dataclass
class Ceilings:
    bandwidth: float  # bytes/s, device-to-device copy counting bytes read + written
    matmul_rate: float  # FLOP/s, 8192^3 bf16 on random data
    fp8_matmul_rate: float | None = None  # FLOP/s, the same in float8 e4m3 (None: no FP8 matrix units)

    def floor(self, bytes_: float, flops: float, fp8_flops: float = 0.0) -> float:
        """The least time of work that moves ``bytes_`` and computes ``flops`` at the 16-bit matrix rate and
        ``fp8_flops`` at the FP8 one (``*StepCostModel.step(...)`` gives all three): the larger of the two."""
        fp8_rate = self.fp8_matmul_rate or self.matmul_rate
        return max(bytes_ / self.bandwidth, flops / self.matmul_rate + fp8_flops / fp8_rate)


def _copy_bandwidth() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / time_cuda(lambda: dst.copy_(src))


def _matmul_rate() -> float:
    """FLOP/s of an 8192^3 bf16 product on random data (never zeros: they run faster)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / time_cuda(lambda: a @ b)


def _fp8_matmul_rate() -> float | None:
    """FLOP/s of an 8192^3 float8 e4m3 product with a scale a row (bf16 out), as FP8 projections run;
    None on a GPU without FP8 matrix units."""
    if torch.cuda.get_device_capability() < (8, 9):
        return None
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    scale_a = torch.ones(8192, 1, device="cuda")
    scale_b = torch.ones(1, 8192, device="cuda")
    return (
        2
        * 8192**3
        / time_cuda(lambda: torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16))
    )


def measure_ceilings() -> Ceilings:
    ceilings = Ceilings(bandwidth=_copy_bandwidth(), matmul_rate=_matmul_rate(), fp8_matmul_rate=_fp8_matmul_rate())
    torch.cuda.empty_cache()
    return ceilings


def _git_commit() -> str:
    """The commit measured; TOKENMILL_COMMIT names it where the tree travels without .git."""
    if os.environ.get("TOKENMILL_COMMIT"):
        return os.environ["TOKENMILL_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment(ceilings: Ceilings | None, command: str) -> dict:
    """What a result file must say about where and how it was measured."""
    import transformers

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "commit": _git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "ceilings": asdict(ceilings) if ceilings else None,
    }


def study_setup(doc: str) -> tuple[argparse.Namespace, Ceilings]:
    """A study script's arguments (``--out FILE``; the first paragraph of its docstring ``doc`` as the
    description) and the ceilings measured for its run."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    return parser.parse_args(), measure_ceilings()


def time_graph(fn, repeat: int = 50) -> float:
    """Seconds a call of ``fn`` takes replayed from a CUDA graph, as the engine runs its steps (the
    GPU's time, not the launches'); one call first, outside the capture, compiles what it needs."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda(graph.replay, repeat=repeat)


def write_rows(path: str, ceilings: Ceilings | None, rows: list[dict]) -> None:
    """A benchmark's result file: its ``environment`` (the command: this process's) and ``rows``."""
    Path(path).write_text(
        json.dumps({"environment": environment(ceilings, " ".join(sys.argv)), "rows": rows}, indent=1)
    )
