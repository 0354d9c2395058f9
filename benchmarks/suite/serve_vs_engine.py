"""The server against the engine it serves, on one model directory and one workload.

For each shape: a model directory with real safetensors written by
``transformers`` (random values, the real shape) and the embedded tokenizer;
then, on the standard workload (256 requests, prompt and output lengths
uniform in [100, 1024], random token ids, greedy, ``ignore_eos``):

1. ``LLM.generate`` with every request at once (the engine's own figure; its
   metered steps give the workload's floor);
2. the same engine fed at the Poisson arrival times of ``--request-rate`` (the
   offline figure a paced load can reach);
3. ``tokenmill serve`` under ``tokenmill bench serve``: a burst of all requests,
   and the paced load;
4. ``tokenmill bench serve --stub``: the load generator's own ceiling.

    python benchmarks/suite/serve_vs_engine.py --shape qwen3-0.6b --out serve.json   # GPU
    python benchmarks/suite/serve_vs_engine.py --device cpu --num-prompts 32 ...      # the embedded model, CPU

Rows carry ``name``, the measured figures, ``floor_seconds`` and ``fraction_of_floor``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

from tokenmill.bench.hardware import environment, measure_ceilings
from tokenmill.bench.offline import run_metered
from tokenmill.bench.serve import arrival_offsets
from tokenmill.bench.shapes import shape_dir
from tokenmill.default_model import DEFAULT_MODEL_DIR
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.frontend.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_model_dir(shape: str, into: Path) -> Path:
    """config.json, random bf16 weights saved by transformers, and the embedded tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(shape_dir(shape))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(into)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, into / name)
    return into


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """The requests ``tokenmill bench serve`` sends for the same options (same seed, same order)."""
    from tokenmill.bench.serve import build_workload

    ns = argparse.Namespace(**{**vars(args), "vocab_size": vocab, "prompt_file": None,
                               "min_input_len": args.min_len, "max_input_len": args.max_len,
                               "min_output_len": args.min_len, "max_output_len": args.max_len})
    return [(r.prompt, r.max_tokens) for r in build_workload(ns)]


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len)


def run_offline(model: Path, args: argparse.Namespace) -> tuple[list[dict], int]:
    """``LLMEngine`` (what ``LLM.generate`` drives) with every request at once, then paced."""
    engine = LLMEngine(EngineConfig(model=str(model), **engine_options(args)))
    vocab = engine.model_config.vocab_size
    requests = workload(args, vocab)
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    for i, (prompt, _) in enumerate(requests[:16]):  # warm-up
        engine.add_request(f"warm{i}", prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                           stream=False)
    while engine.has_unfinished_requests():
        engine.step()
    out_tokens = sum(n for _, n in requests)
    rows = []
    for i, ((prompt, _), params) in enumerate(zip(requests, greedy)):
        engine.add_request(f"burst{i}", prompt, params, stream=False)
    ceilings = measure_ceilings() if args.device == "cuda" else None
    if ceilings is not None:
        records, seconds, _ = run_metered(engine, ceilings)
        floor = sum(r.floor for r in records)
    else:
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        seconds, floor = time.perf_counter() - started, None
    rows.append({"name": f"{args.label}/offline/burst", "seconds": seconds, "output_tok_per_s": out_tokens / seconds,
                 "floor_seconds": floor, "fraction_of_floor": floor / seconds if floor else None})
    if args.request_rate:
        offsets = arrival_offsets(len(requests), args.request_rate, args.seed)
        started = time.perf_counter()
        i = 0
        while i < len(requests) or engine.has_unfinished_requests():
            now = time.perf_counter() - started
            while i < len(requests) and offsets[i] <= now:
                engine.add_request(f"paced{i}", requests[i][0], greedy[i], stream=False)
                i += 1
            if engine.has_unfinished_requests():
                engine.step()
            elif i < len(requests):
                time.sleep(max(0.0, offsets[i] - now))
        seconds = time.perf_counter() - started
        # Nothing can end before the last request arrives.
        paced_floor = max(floor, offsets[-1]) if floor else None
        rows.append({"name": f"{args.label}/offline/rate{args.request_rate:g}", "seconds": seconds,
                     "output_tok_per_s": out_tokens / seconds, "floor_seconds": paced_floor,
                     "last_arrival_s": offsets[-1], "fraction_of_floor": paced_floor / seconds if floor else None})
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, vocab


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cli(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.entrypoints.cli", *arguments]


def bench_client(args: argparse.Namespace, vocab: int, out: Path, *options: str) -> dict:
    """One ``tokenmill bench serve`` run in its own process (the client never shares an
    interpreter with what it measures)."""
    command = _cli("bench", "serve", "--num-prompts", str(args.num_prompts), "--min-input-len", str(args.min_len),
                   "--max-input-len", str(args.max_len), "--min-output-len", str(args.min_len),
                   "--max-output-len", str(args.max_len), "--vocab-size", str(vocab), "--seed", str(args.seed),
                   "--no-progress", "--out", str(out), *options)
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    print(result.stdout[-3000:], result.stderr[-2000:], flush=True)
    return json.loads(out.read_text())


@contextmanager
def served(*arguments: str, ready_timeout: float = 600) -> Iterator[tuple[str, subprocess.Popen]]:
    """``tokenmill serve`` with ``arguments`` in a process of its own on a free port: (its base URL, the
    process) once ``/health`` answers; stopped with SIGTERM (as a service manager would) after."""
    port = _free_port()
    server = subprocess.Popen(_cli("serve", "--port", str(port), *arguments),
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield base, server
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def run_server(model: Path, args: argparse.Namespace, vocab: int, work: Path) -> list[dict]:
    options = engine_options(args)
    rows = []
    with served(str(model), "--uvicorn-log-level", "warning",
                *[f"--{k.replace('_', '-')}={v}" for k, v in options.items()]) as (base, _):
        warm = argparse.Namespace(**{**vars(args), "num_prompts": 16})
        bench_client(warm, vocab, work / "warm.json", "--base-url", base)
        loads = [("burst", ["--request-rate", "inf"])]
        if args.request_rate:
            loads.append((f"rate{args.request_rate:g}", ["--request-rate", str(args.request_rate)]))
        for label, extra in loads:
            summary = bench_client(args, vocab, work / f"{label}.json", "--base-url", base, *extra)
            rows.append({"name": f"{args.label}/serve/{label}", **_figures(summary)})
    stub = bench_client(args, vocab, work / "stub.json", "--stub")
    rows.append({"name": f"{args.label}/client_against_stub/burst", **_figures(stub)})
    return rows


def _figures(summary: dict) -> dict:
    keys = ("completed", "failed", "duration_s", "total_output_tokens", "output_throughput", "ttft", "itl", "tpot",
            "e2e_latency", "errors")
    return {k: summary[k] for k in keys if k in summary}


def compare(rows: list[dict]) -> None:
    """Server rows get the matching offline figure, the ratio, and the offline run's floor."""
    offline = {r["name"].split("/")[-1]: r for r in rows if "/offline/" in r["name"]}
    for row in rows:
        if "/serve/" not in row["name"]:
            continue
        base = offline.get(row["name"].split("/")[-1])
        if base is None:
            continue
        row["offline_output_tok_per_s"] = base["output_tok_per_s"]
        row["ratio_to_offline"] = row["output_throughput"] / base["output_tok_per_s"]
        row["floor_seconds"] = base["floor_seconds"]
        row["fraction_of_floor"] = base["floor_seconds"] / row["duration_s"] if base["floor_seconds"] else None


def print_table(rows: list[dict]) -> None:
    print(f"{'name':40s} {'out tok/s':>10s} {'vs offline':>10s} {'of floor':>8s} {'TTFT p50/p99 ms':>18s} "
          f"{'ITL p50/p99 ms':>16s}")
    for row in rows:
        tok = row.get("output_throughput", row.get("output_tok_per_s", 0.0))
        ratio = f"{row['ratio_to_offline']:.0%}" if "ratio_to_offline" in row else ""
        frac = f"{row['fraction_of_floor']:.0%}" if row.get("fraction_of_floor") else ""
        ttft = f"{row['ttft']['median_ms']:.0f}/{row['ttft']['p99_ms']:.0f}" if "ttft" in row else ""
        itl = f"{row['itl']['median_ms']:.1f}/{row['itl']['p99_ms']:.1f}" if "itl" in row else ""
        print(f"{row['name']:40s} {tok:10.0f} {ratio:>10s} {frac:>8s} {ttft:>18s} {itl:>16s}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None, help="a benchmark shape (GPU); unset: the embedded model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100, help="shortest prompt and output")
    parser.add_argument("--max-len", type=int, default=1024, help="longest prompt and output")
    parser.add_argument("--request-rate", type=float, default=32.0, help="the paced load (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.label = args.shape or "default-model"
    work = Path(tempfile.mkdtemp(prefix="tokenmill-serve-bench-"))
    model = write_model_dir(args.shape, work / "model") if args.shape else DEFAULT_MODEL_DIR
    rows, vocab = run_offline(model, args)
    print_table(rows)
    rows += run_server(model, args, vocab, work)
    compare(rows)
    print_table(rows)
    if args.out:
        ceilings = measure_ceilings() if args.device == "cuda" else None
        Path(args.out).write_text(json.dumps({"environment": environment(ceilings, " ".join(sys.argv)),
                                              "args": {k: v for k, v in vars(args).items()}, "rows": rows},
                                             indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
