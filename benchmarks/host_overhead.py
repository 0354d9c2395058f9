"""The engine's host work per step, with the model's forward stubbed out: what the
GPU must hide (or wait for) at large batch. Runs on the CPU; no GPU needed.

python benchmarks/host_overhead.py [--batch 256] [--steps 100] [--no-async]
Prints ms per step and the share of its phases (schedule, input preparation,
sampling, completion).
"""

import argparse
import collections
import functools
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import make_model_dir  # noqa: E402

from tokenmill import SamplingParams  # noqa: E402
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--no-async", action="store_true")
    args = parser.parse_args()
    model_dir = Path(tempfile.mkdtemp())
    make_model_dir("llama3", model_dir)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=args.batch,
                                    num_kv_blocks=64 * args.batch, async_scheduling=not args.no_async))
    model, cfg = engine.core.runner.model, engine.model_config
    model.forward = lambda ids, positions, kv, meta: torch.zeros(ids.shape[0], cfg.hidden_size)
    model.compute_logits = lambda hidden, out=None: torch.zeros(hidden.shape[0], cfg.vocab_size)
    phases: collections.Counter[str] = collections.Counter()

    def timed(obj, name: str) -> None:
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            started = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phases[name] += time.perf_counter() - started
        setattr(obj, name, wrapper)

    core = engine.core
    for obj, name in ((core.scheduler, "schedule"), (core.runner, "_prepare"), (core.runner, "_sampling_batch"),
                      (core.runner, "sampler"), (core, "_complete"), (engine.outputs, "process")):
        timed(obj, name)
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - 128, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [1 + i % 50] * 128, params, stream=False)
    for _ in range(20):
        engine.step()
    phases.clear()
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    per_step = (time.perf_counter() - started) / args.steps
    print(f"batch {args.batch}, async {not args.no_async}: host {per_step * 1e3:.3f} ms per step")
    for name, seconds in phases.most_common():
        print(f"  {name:16s} {seconds / args.steps * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
