"""``tokenmill`` command line: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from typing import Any

from tokenmill.bench.offline import BENCHMARKS, add_bench_args, run_bench
from tokenmill.bench.serve import add_bench_serve_args, run_serve_bench
from tokenmill.engine.llm_engine import EngineConfig, LLMEngine
from tokenmill.entrypoints.openai.server import add_serve_args, run_server
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import apply_chat_template


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that starts an engine."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="Hugging Face model directory (default: the embedded model)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="read each step's tokens before launching the next (no host/GPU overlap)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, seed=getattr(args, "seed", None) or 0,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching, enforce_eager=args.enforce_eager,
        async_scheduling=not args.no_async_scheduling,
    )


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed gives the same text)")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def stream_text(engine: LLMEngine, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
    """Text deltas of one request, as the engine produces them."""
    engine.add_request("cli", prompt, params)
    sent = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            if len(text) > sent:
                yield text[sent:]
                sent = len(text)


def _write_stream(chunks: Iterator[str]) -> None:
    for chunk in chunks:
        sys.stdout.write(chunk)
        sys.stdout.flush()
    sys.stdout.write("\n")


def cmd_generate(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_config_from_args(args))
    sys.stdout.write(args.prompt)
    _write_stream(stream_text(engine, args.prompt, _sampling_params(args)))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """A conversation on stdin: each line is a user turn; the reply streams back."""
    engine = LLMEngine(engine_config_from_args(args))
    messages: list[dict[str, Any]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        prompt = apply_chat_template(engine.tokenizer, messages)
        reply = []
        for chunk in stream_text(engine, prompt, _sampling_params(args)):
            reply.append(chunk)
            sys.stdout.write(chunk)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference and serving engine")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt, streaming to stdout")
    gen.add_argument("prompt")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat on stdin/stdout through the model's chat template")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    add_serve_args(serve)
    serve.set_defaults(func=run_server)

    bench = sub.add_parser("bench", help="benchmarks: engine on the GPU, or load against a server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name in BENCHMARKS:
        engine_bench = bench_sub.add_parser(name, help=f"{name} benchmark on the GPU (random weights, real shapes)")
        add_bench_args(engine_bench)
        engine_bench.set_defaults(func=run_bench)
    serve_bench = bench_sub.add_parser("serve", help="load generator against an OpenAI-compatible server")
    add_bench_serve_args(serve_bench)
    serve_bench.set_defaults(func=run_serve_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, KeyboardInterrupt) as exc:
        if isinstance(exc, KeyboardInterrupt):
            return 130
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
