"""``tokenmill`` command line: generate, chat, serve, bench.

Each command's options are added only when that command is parsed, so the server
(FastAPI) and the benchmark modules are imported only by ``serve`` and ``bench``:
``generate`` and the engine benchmarks run where FastAPI is not installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import tokenmill
from tokenmill.engine.config import add_engine_args, engine_config_from_args
from tokenmill.engine.frontend.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import apply_chat_template

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_FORMATTER = argparse.ArgumentDefaultsHelpFormatter


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser that adds its options (``populate``) the first time it is
    used: parsing the command or printing its help."""

    def __init__(
        self, *args: Any, populate: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._populate = populate

    def _ensure_populated(self) -> None:
        if self._populate is not None:
            populate, self._populate = self._populate, None
            populate(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[Any, list[str]]:
        self._ensure_populated()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._ensure_populated()
        return super().format_help()


def _log_level(value: str) -> str:
    level = value.lower()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)} (any case), got {value!r}")
    return level


def _add_command(commands: Any, name: str, help_text: str, populate: Callable[[argparse.ArgumentParser], None]) -> None:
    parser = commands.add_parser(
        name, help=help_text, description=help_text, formatter_class=_FORMATTER, populate=populate
    )
    # SUPPRESS: when absent here, a --log-level given before the command stands.
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default=argparse.SUPPRESS,
        metavar="LEVEL",
        help="logging level, also accepted before the command (default: warning)",
    )


def _version() -> str:
    try:
        return importlib.metadata.version("tokenmill")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return tokenmill.__version__


# ------------------------------------------------------------ generate / chat
def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Sampling options; the engine's --seed is also the sampling seed."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.7, help="randomness of sampling; 0 is greedy")
    g.add_argument(
        "--top-p",
        type=float,
        default=0.95,
        help="sample from the smallest set of tokens whose probabilities add up to this",
    )
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 or -1: all")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )


def stream_text(engine: LLMEngine, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
    """Text deltas of one request, as the engine produces them. The request is queued
    at once, so a bad prompt fails here rather than after output has begun."""
    engine.add_request("cli", prompt, params)
    return _deltas(engine)


def _deltas(engine: LLMEngine) -> Iterator[str]:
    sent = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            if len(text) > sent:
                yield text[sent:]
                sent = len(text)


def _write_stream(chunks: Iterator[str]) -> str:
    """Print the chunks as they come, then a newline; returns the whole text."""
    written = []
    for chunk in chunks:
        written.append(chunk)
        sys.stdout.write(chunk)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(written)


def cmd_generate(args: argparse.Namespace) -> int:
    # Everything is checked before the model loads and before anything is printed.
    if not args.prompt:
        raise ValueError("the prompt is empty")
    config = engine_config_from_args(args)
    params = _sampling_params(args)
    engine = LLMEngine(config)
    chunks = stream_text(engine, args.prompt, params)
    sys.stdout.write(args.prompt)
    _write_stream(chunks)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """A conversation on stdin: each line is a user turn; the reply streams back."""
    config = engine_config_from_args(args)
    params = _sampling_params(args)
    engine = LLMEngine(config)
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
        reply = _write_stream(stream_text(engine, prompt, params))
        messages.append({"role": "assistant", "content": reply})


def _generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the text to complete")
    add_engine_args(parser)
    _add_sampling_args(parser)
    parser.set_defaults(func=cmd_generate)


def _chat_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default=None, help="system message at the start of the conversation")
    add_engine_args(parser)
    _add_sampling_args(parser)
    parser.set_defaults(func=cmd_chat)


# ---------------------------------------------------------------------- serve
def _serve_args(parser: argparse.ArgumentParser) -> None:
    from tokenmill.entrypoints.openai.server import add_serve_args, run_server

    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model directory, as with --model (give one or the other)",
    )
    add_engine_args(parser)
    add_serve_args(parser)
    parser.set_defaults(func=run_server)


def _merge_model_tag(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``serve MODEL`` is ``serve --model MODEL``; two different models is an error."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        parser.error(f"serve got two models: {tag!r} as MODEL and {args.model!r} as --model; give one")
    args.model = tag


# ---------------------------------------------------------------------- bench
def _bench_args(parser: argparse.ArgumentParser) -> None:
    from tokenmill.bench.offline import BENCHMARKS

    benchmarks = parser.add_subparsers(
        dest="bench_command", required=True, metavar="BENCHMARK", parser_class=_CommandParser
    )
    for name in BENCHMARKS:
        _add_command(
            benchmarks, name, f"engine benchmark '{name}' on a GPU (random weights, real shapes)", _engine_bench_args
        )
    _add_command(benchmarks, "serve", "load generator against an OpenAI-compatible server", _serve_bench_args)


def _engine_bench_args(parser: argparse.ArgumentParser) -> None:
    from tokenmill.bench.offline import add_bench_args, run_bench

    add_bench_args(parser)
    parser.set_defaults(func=run_bench)


def _serve_bench_args(parser: argparse.ArgumentParser) -> None:
    from tokenmill.bench.serve import add_bench_serve_args, run_serve_bench

    add_bench_serve_args(parser)
    parser.set_defaults(func=run_serve_bench)


# ----------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill", description="LLM inference and serving engine", formatter_class=_FORMATTER
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default="warning",
        metavar="LEVEL",
        help="logging level: " + ", ".join(LOG_LEVELS),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_CommandParser)
    _add_command(commands, "generate", "complete one prompt, streaming to stdout", _generate_args)
    _add_command(commands, "chat", "chat on stdin/stdout through the model's chat template", _chat_args)
    _add_command(commands, "serve", "OpenAI-compatible HTTP server", _serve_args)
    _add_command(commands, "bench", "benchmarks: the engine on a GPU, or load against a server", _bench_args)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line; exits with status 2 and a usage message on bad options."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _merge_model_tag(parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
