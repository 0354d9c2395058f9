"""The engine's host work per step, phase by phase: what the GPU must hide (or wait for) at
large batch.

python benchmarks/profile/host_overhead.py [--batch 256] [--waiting 0] [--steps 100] [--prompt-len 128] [--no-async] [--profile N]
    on the CPU, the model's forward stubbed out: the host's work alone, and the garbage collector's
    pauses within it (``--batch 1024 --prompt-len 2048 --steps 1000``: the long KV-bound workload's);
python benchmarks/profile/host_overhead.py --shape llama3.2-1b [--batch 256] ...
    on the GPU, the real forward of a shape with random weights: ``collect`` is then the time the
    host waits for the GPU, and a step that costs more than the graph's replay is host-bound.
"""

import argparse
import collections
import cProfile
import functools
import gc
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from helpers import make_model_dir  # noqa: E402

from tokenmill import SamplingParams  # noqa: E402
from tokenmill.bench.offline import make_engine  # noqa: E402
from tokenmill.engine.config import EngineConfig  # noqa: E402
from tokenmill.engine.frontend.llm_engine import LLMEngine  # noqa: E402


WARM_UP_STEPS = 20


def stubbed_engine(batch: int, async_scheduling: bool, max_model_len: int) -> LLMEngine:
    model_dir = Path(tempfile.mkdtemp())
    make_model_dir("llama3", model_dir)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=batch,
                                    max_model_len=max_model_len, num_kv_blocks=batch * (max_model_len // 16 + 1),
                                    async_scheduling=async_scheduling))
    model, cfg = engine.core.runner.model, engine.model_config
    model.forward = lambda ids, positions, kv, meta: torch.zeros(ids.shape[0], cfg.hidden_size)
    model.head_logits = lambda hidden, out=None: torch.zeros(hidden.shape[0], cfg.vocab_size)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--no-async", action="store_true")
    parser.add_argument("--waiting", type=int, default=0, help="requests queued behind the running batch")
    parser.add_argument("--shape", default=None, help="run this shape's real forward on the GPU (random weights)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the timed steps, the N functions with the most time of their own (cProfile)")
    args = parser.parse_args()
    if args.shape:
        engine = make_engine(args.shape, max_num_seqs=args.batch, async_scheduling=not args.no_async)
    else:
        # Room for the prompt, the warm-up, the timed and the profiled steps: no request ends inside.
        room = args.prompt_len + WARM_UP_STEPS + 2 * args.steps
        engine = stubbed_engine(args.batch, not args.no_async, max(512, room))
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
    for obj, name in ((core.scheduler, "schedule"), (core.runner, "_prepare"), (core.runner, "_forward"),
                      (core.runner, "_sampling_batch"), (core.runner, "sampler"), (core.runner, "collect"),
                      (core, "_complete"), (engine.outputs, "process")):
        timed(obj, name)
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - args.prompt_len, ignore_eos=True)
    for i in range(args.batch + args.waiting):
        engine.add_request(str(i), [1 + i % 50] * args.prompt_len, params, stream=False)
    for _ in range(WARM_UP_STEPS):
        engine.step()
    phases.clear()
    collections_ms: dict[int, list[float]] = collections.defaultdict(list)
    gc_started = [0.0]

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            collections_ms[info["generation"]].append((time.perf_counter() - gc_started[0]) * 1e3)
    gc.callbacks.append(on_collection)
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    per_step = (time.perf_counter() - started) / args.steps
    gc.callbacks.remove(on_collection)
    where = f"{args.shape} on the GPU" if args.shape else "forward stubbed"
    print(f"batch {args.batch}, {args.waiting} waiting, async {not args.no_async}, {where}: "
          f"{per_step * 1e3:.3f} ms per step")
    for name, seconds in phases.most_common():
        print(f"  {name:16s} {seconds / args.steps * 1e3:.3f} ms")
    for generation, pauses in sorted(collections_ms.items()):
        print(f"  garbage collections of generation {generation}: {len(pauses)}, {sum(pauses):.1f} ms in all, "
              f"the longest {max(pauses):.1f} ms")
    if args.shape:
        graph = core.runner.graphs.graph_for(args.batch, args.prompt_len + WARM_UP_STEPS + args.steps)
        replay = (lambda: [graph.replay() for _ in range(20)])
        replay()
        torch.cuda.synchronize()
        started = time.perf_counter()
        replay()
        torch.cuda.synchronize()
        print(f"  the step's graph replayed alone: {(time.perf_counter() - started) / 20 * 1e3:.3f} ms")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(lambda: [engine.step() for _ in range(args.steps)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
