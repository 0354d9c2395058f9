"""Every Triton kernel under the Triton CPU interpreter, against the torch reference.

``TRITON_INTERPRET=1`` only takes effect if set before triton is imported, and in
a full pytest run triton may already be imported; so each kernel's cases run in
a fresh subprocess (``_kernel_cases.py``) with the variable set. Inputs are fp16
and fp32: the interpreter computes bf16 dots wrongly.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

CASES = Path(__file__).with_name("_kernel_cases.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


def _interpreter_env() -> dict[str, str]:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.parametrize(
    "kernel",
    ["gemv", "skinny_matmul", "fp8_matmul", "fused_experts", "paged_attention", "paged_attention_gemma", "paged_attention_edge_masks", "paged_attention_combinations", "rms_norm", "offset_rms_norm", "gemma_norms", "quantized_kv",
     "rotary_embedding_and_write_kv", "softcap", "silu_and_mul", "gelu_tanh_and_mul",
     "sample", "penalties", "argmax_rows"],
)
def test_kernel_under_interpreter(kernel: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(CASES), kernel], env=_interpreter_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{kernel} failed under the interpreter:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("script,checks", [("study_q8_a8.py", 6), ("study_warp_keys.py", 4),
                                           ("study_prompt_attention.py", 3)])
def test_study_candidate_kernels_under_interpreter(script: str, checks: int) -> None:
    """Kernels that a study measures before any enters the engine (benchmarks/studies/study_q8_a8.py: Q8_0
    projections on rows quantized to int8, by dp4a and by int8 tensor cores; study_warp_keys.py: int8
    decode attention with each warp owning its keys, and the shared tile it is measured against;
    study_prompt_attention.py: a new prompt's causal attention over its
    contiguous keys), so a study's timing is of a kernel known to be right."""
    proc = subprocess.run([sys.executable, script, "--check"], cwd=REPO_ROOT / "benchmarks" / "studies",
                          env=_interpreter_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.count("rel err") == checks, proc.stdout
