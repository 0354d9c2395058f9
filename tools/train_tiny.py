#!/usr/bin/env python3
"""Build tokenmill's embedded default model: a tiny Python code-completion LM.

tokenmill ships a model of its own as package data so that ``generate``,
``chat``, ``serve`` and ``bench`` work with no ``--model`` and no download.
That model has to be small (package data, < 32 MB) yet write text that reads
as real, so it is trained on the one corpus every machine that runs tokenmill
already has and whose licence allows it: the Python standard library source of
the local interpreter.

Three steps, each a subcommand:

``prepare`` (CPU, here)
    Collect the stdlib ``*.py`` files, split train/validation by file with a
    fixed seed, train a byte-level BPE tokenizer, synthesise a small set of
    chat-formatted samples (so the chat template's tokens are not unseen), and
    write uint16 token arrays plus a manifest under ``.cache/tiny``.

``train`` (GPU, through the device tool; also runs on CPU with ``--smoke``)
    Train a ``LlamaForCausalLM`` for a fixed wall-clock budget: the step count
    is planned from the measured speed of the first steps so that the cosine
    schedule ends exactly when the budget does.  Saves a bf16 checkpoint that
    ``transformers`` (and so tokenmill's loader) can read, plus a manifest.

``check`` (CPU, here)
    Load the saved directory with ``transformers`` Auto classes, run greedy
    completions and the chat template: the acceptance test for the artefact.

Reproduce::

    python tools/train_tiny.py prepare
    # on the GPU machine, from the repository root:
    PYTHONUNBUFFERED=1 python3 tools/train_tiny.py train --data .cache/tiny \
        --out $OUT/default_model
    python tools/train_tiny.py check --model tokenmill/data/default_model
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import platform
import random
import shutil
import sysconfig
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any, Iterable

import numpy as np

# --------------------------------------------------------------------------
# Constants shared by every step.  They are the contract with tokenmill's
# runtime: the engine finds the special tokens and the template by these names.
# --------------------------------------------------------------------------

EOS = "<|endoftext|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"
#: Order fixes the ids: ``<|endoftext|>`` is 0, ``<|end|>`` is 4.
SPECIAL_TOKENS: list[str] = [EOS, SYSTEM, USER, ASSISTANT, END]

#: Jinja chat template.  Each message is ``<|role|>\ncontent<|end|>\n``; the
#: generation prompt opens an assistant turn.  The ``prepare`` step renders the
#: synthetic chat samples with :func:`render_chat`, which must stay identical.
#: With ``tools`` (Hermes style, for the server's ``hermes`` tool-call parser)
#: the system turn lists their signatures inside ``<tools></tools>``, an
#: assistant's ``tool_calls`` follow its content as ``<tool_call>`` blocks, and
#: consecutive ``tool`` messages share one user turn as ``<tool_response>`` blocks.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{%- set ns = namespace(text='# Tools\\n\\nYou can call the functions described inside <tools></tools>:"
    "\\n<tools>\\n') -%}"
    "{%- for tool in tools -%}"
    "{%- set ns.text = ns.text + ((tool.function if tool.function is defined else tool) | tojson) + '\\n' -%}"
    "{%- endfor -%}"
    "{%- set tools_text = ns.text + '</tools>\\n\\nTo call a function, write:\\n<tool_call>\\n"
    "{\"name\": <function name>, \"arguments\": <JSON object>}\\n</tool_call>' -%}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- '<|system|>\\n' + messages[0]['content'] + '\\n\\n' + tools_text + '<|end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|system|>\\n' + tools_text + '<|end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('Only system, user, assistant and tool roles are supported') -}}"
    "{%- endif -%}"
    "{%- set content = message['content'] if message['content'] is defined and message['content'] is not none"
    " else '' -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|user|>\\n' if loop.first or messages[loop.index0 - 1]['role'] != 'tool' else '\\n' -}}"
    "{{- '<tool_response>\\n' + content + '\\n</tool_response>' -}}"
    "{{- '<|end|>\\n' if loop.last or messages[loop.index0 + 1]['role'] != 'tool' else '' -}}"
    "{%- elif not (tools and loop.first and message['role'] == 'system') -%}"
    "{{- '<|' + message['role'] + '|>\\n' + content -}}"
    "{%- for call in (message.tool_calls if message.tool_calls is defined and message.tool_calls else []) -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{{- '\\n' if content or not loop.first else '' -}}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": '"
    " + (fn.arguments if fn.arguments is string else (fn.arguments | tojson)) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

DEFAULT_SYSTEM_PROMPT = "You are a helpful Python coding assistant."

#: Directories under the stdlib left out of the corpus, with the reason.
#: Everything else that is valid UTF-8 Python 3 source is kept, tests included:
#: test code is idiomatic Python and more than doubles the data.
EXCLUDED_DIRS: dict[str, str] = {
    "site-packages": "third-party packages, not the standard library",
    "encodings": "generated codec tables (mostly numeric data)",
    "pydoc_data": "one 750 KB string of documentation, not code",
    "lib2to3/tests/data": "deliberately Python 2 or broken samples",
    "test/tokenizedata": "deliberately odd encodings and syntax",
    "__pycache__": "bytecode caches",
}
#: Individual files larger than this are generated data, not code.
MAX_FILE_BYTES = 400_000

#: Model shape: ~12.8M parameters, ~25.6 MB in bf16 (see docs/DEFAULT_MODEL.md).
MODEL_SHAPE: dict[str, int] = dict(
    hidden_size=384,
    intermediate_size=704,
    num_hidden_layers=8,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
)
#: Shape for ``--smoke``: a CPU can run a few steps of it in seconds.
SMOKE_SHAPE: dict[str, int] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=2048,
)


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, streamed so big files cost no memory."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """Render ``messages`` exactly as :data:`CHAT_TEMPLATE` does.

    Written out in Python so ``prepare`` needs no jinja; ``check`` asserts
    that both renderings agree, so training data and runtime prompts match.
    """
    out = "".join(f"<|{m['role']}|>\n{m['content']}{END}\n" for m in messages)
    if add_generation_prompt:
        out += f"{ASSISTANT}\n"
    return out


# --------------------------------------------------------------------------
# prepare
# --------------------------------------------------------------------------


def collect_files(stdlib: Path) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """Return ``[(relative path, text)]`` sorted by path, and exclusion counts.

    A file is kept when it is outside :data:`EXCLUDED_DIRS`, at most
    :data:`MAX_FILE_BYTES`, strict UTF-8, and parses as Python with the local
    interpreter: the model should only ever see code that runs.
    """
    kept: list[tuple[str, str]] = []
    skipped: dict[str, int] = {}

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).as_posix()
        excluded = next(
            (d for d in EXCLUDED_DIRS if rel == d or rel.startswith(d + "/") or f"/{d}/" in f"/{rel}"),
            None,
        )
        if excluded is not None:
            skip(f"dir:{excluded}")
            continue
        if rel.startswith("config-") or rel.startswith("_sysconfigdata"):
            skip("build configuration")
            continue
        raw = path.read_bytes()
        if len(raw) > MAX_FILE_BYTES:
            skip("too large")
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skip("not utf-8")
            continue
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        if any(tok in text for tok in SPECIAL_TOKENS):
            skip("contains a special token")
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ast.parse(text, filename=rel)
        except (SyntaxError, ValueError):
            skip("does not parse")
            continue
        if not text.strip():
            skip("empty")
            continue
        kept.append((rel, text))
    return kept, skipped


def corpus_sha256(files: list[tuple[str, str]]) -> str:
    """Digest of the corpus: every ``path NUL text NUL`` in path order."""
    h = hashlib.sha256()
    for rel, text in files:
        h.update(rel.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def chat_samples(files: list[tuple[str, str]], rng: random.Random, limit: int) -> list[str]:
    """Synthesise chat transcripts from documented functions of ``files``.

    The user asks for a function by signature and the first line of its
    docstring; the assistant answers with the function's source and ``<|end|>``.
    Without this the chat tokens would be untrained embeddings and ``chat``
    would never see the model stop; with it (a few percent of the tokens) the
    model learns the turn structure while the corpus stays all stdlib.
    """
    out: list[str] = []
    for rel, text in files:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or not doc.strip() or node.name.startswith("test"):
                continue
            summary = doc.strip().splitlines()[0].strip()
            if len(summary) < 12:
                continue
            src = ast.get_source_segment(text, node)
            if not src:
                continue
            # Decorators and the first line's indentation are outside the segment.
            first = text.splitlines()[node.lineno - 1]
            indent = first[: len(first) - len(first.lstrip())]
            src = textwrap.dedent(indent + src)
            if len(src) > 2500 or len(src.splitlines()) < 3:
                continue
            try:
                args = ast.unparse(node.args)
            except Exception:  # noqa: BLE001 - unparse of odd nodes; skip them
                continue
            kind = "async function" if isinstance(node, ast.AsyncFunctionDef) else "function"
            asks = [
                f"Write a Python {kind} `{node.name}({args})`. {summary}",
                f"Implement `{node.name}({args})` in Python: {summary}",
                f"{summary} Write it as a Python {kind} named `{node.name}`.",
            ]
            messages = []
            if rng.random() < 0.5:
                messages.append({"role": "system", "content": DEFAULT_SYSTEM_PROMPT})
            messages.append({"role": "user", "content": rng.choice(asks)})
            messages.append({"role": "assistant", "content": src.rstrip("\n")})
            out.append(render_chat(messages, add_generation_prompt=False))
    rng.shuffle(out)
    return out[:limit]


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """Train a byte-level BPE (GPT-2 style pre-tokenisation) on ``texts``.

    Byte level means any input round-trips, which a code model needs (unicode
    in strings, odd whitespace).  The special tokens come first so their ids
    are fixed: ``<|endoftext|>`` = 0 ... ``<|end|>`` = 4.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict[str, Any]:
    """``tokenizer_config.json`` for ``transformers``' fast tokenizer class."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "additional_special_tokens": [SYSTEM, USER, ASSISTANT, END],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }


def encode_docs(tok: Any, docs: list[str]) -> np.ndarray:
    """Token ids of ``docs``, each followed by ``<|endoftext|>``, as uint16."""
    eos_id = tok.token_to_id(EOS)
    ids: list[int] = [eos_id]  # documents start after an eos, as at inference
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    arr = np.asarray(ids, dtype=np.int64)
    assert arr.max() < 65536
    return arr.astype(np.uint16)


def cmd_prepare(args: argparse.Namespace) -> None:
    """Build corpus, split, tokenizer and token arrays under ``args.out``."""
    t0 = time.time()
    stdlib = Path(args.stdlib).resolve()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files, skipped = collect_files(stdlib)
    digest = corpus_sha256(files)
    print(f"stdlib {stdlib}: kept {len(files)} files, skipped {skipped}")

    names = [rel for rel, _ in files]
    order = names[:]
    random.Random(args.seed).shuffle(order)
    n_val = max(1, round(len(order) * args.val_frac))
    val_names = set(order[:n_val])
    train_files = [(r, t) for r, t in files if r not in val_names]
    val_files = [(r, t) for r, t in files if r in val_names]

    tok = train_tokenizer((t for _, t in train_files), args.vocab_size)
    tok_dir = out / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")

    rng = random.Random(args.seed + 1)
    train_chat = chat_samples(train_files, rng, args.chat_limit)
    val_chat = chat_samples(val_files, rng, max(1, args.chat_limit // 20))

    train_docs = [t for _, t in train_files] + train_chat
    random.Random(args.seed + 2).shuffle(train_docs)
    train_ids = encode_docs(tok, train_docs)
    val_ids = encode_docs(tok, [t for _, t in val_files])
    val_chat_ids = encode_docs(tok, val_chat)
    chat_tokens = int(sum(len(e.ids) + 1 for e in tok.encode_batch(train_chat, add_special_tokens=False)))
    np.save(out / "train.npy", train_ids)
    np.save(out / "val.npy", val_ids)
    np.save(out / "val_chat.npy", val_chat_ids)
    (out / "files.txt").write_text(
        "".join(f"{'val' if r in val_names else 'train'}\t{r}\n" for r in names)
    )

    src_bytes = sum(len(t.encode()) for _, t in files)
    manifest = {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib_path": str(stdlib),
        "corpus_sha256": digest,
        "corpus_bytes": src_bytes,
        "files_total": len(files),
        "files_train": len(train_files),
        "files_val": len(val_files),
        "files_skipped": skipped,
        "excluded_dirs": EXCLUDED_DIRS,
        "max_file_bytes": MAX_FILE_BYTES,
        "split": {"by": "file", "seed": args.seed, "val_frac": args.val_frac},
        "file_list": "files.txt (split<TAB>path, sorted by path)",
        "file_list_sha256": sha256_file(out / "files.txt"),
        "tokenizer": {
            "type": "byte-level BPE (tokenizers)",
            "vocab_size": tok.get_vocab_size(),
            "special_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
            "sha256": sha256_file(tok_dir / "tokenizer.json"),
        },
        "chat_samples": {"train": len(train_chat), "val": len(val_chat), "train_tokens": chat_tokens},
        "tokens": {
            "train": int(train_ids.size),
            "val": int(val_ids.size),
            "val_chat": int(val_chat_ids.size),
        },
        "bytes_per_token": round(src_bytes / max(1, train_ids.size + val_ids.size - chat_tokens), 3),
        "arrays_sha256": {
            n: sha256_file(out / n) for n in ("train.npy", "val.npy", "val_chat.npy")
        },
        "prepare_seconds": round(time.time() - t0, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps({k: manifest[k] for k in ("python_version", "corpus_sha256", "files_total",
                                                "files_train", "files_val", "tokens",
                                                "bytes_per_token", "chat_samples")}, indent=2))


# --------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------


def build_model(vocab_size: int, shape: dict[str, int], eos_id: int) -> Any:
    """A ``LlamaForCausalLM`` with tied embeddings (RMSNorm, RoPE, GQA, SwiGLU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=0.02,
        **shape,
    )
    config.architectures = ["LlamaForCausalLM"]
    return LlamaForCausalLM(config)


def lr_at(step: int, total: int, peak: float, warmup: int, floor_frac: float) -> float:
    """Linear warm-up then cosine decay to ``floor_frac * peak`` at ``total``.

    Warm-up depends only on ``step``, so the first steps can run before
    ``total`` is known (it is planned from their timing).
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_frac + (1 - floor_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def cmd_train(args: argparse.Namespace) -> None:
    """Train for a wall-clock budget and save a bf16 ``transformers`` checkpoint."""
    import torch
    import torch.nn.functional as F

    t_start = time.time()
    data = Path(args.data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prep = json.loads((data / "manifest.json").read_text())
    eos_id = prep["tokenizer"]["special_tokens"][EOS]
    end_id = prep["tokenizer"]["special_tokens"][END]
    vocab = prep["tokenizer"]["vocab_size"]

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    gpu = torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"

    shape = SMOKE_SHAPE if args.smoke else MODEL_SHAPE
    model = build_model(vocab, shape, eos_id).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"device {dev} ({gpu}); torch {torch.__version__}; params {n_params:,}")

    train = torch.from_numpy(np.load(data / "train.npy").astype(np.int64)).to(dev)
    val = torch.from_numpy(np.load(data / "val.npy").astype(np.int64)).to(dev)
    val_chat = torch.from_numpy(np.load(data / "val_chat.npy").astype(np.int64)).to(dev)
    ctx, bsz = args.ctx, args.batch
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    offs = torch.arange(ctx + 1, device=dev)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows of the training stream (documents joined by eos)."""
        starts = torch.randint(0, train.numel() - ctx - 1, (bsz,), device=dev, generator=gen)
        win = train[starts[:, None] + offs]
        return win[:, :-1], win[:, 1:]

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda,
    )
    amp = torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=True)

    def forward_loss(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with amp:
            logits = m(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))

    step_fn = model
    if args.compile and cuda:
        try:
            step_fn = torch.compile(model)
        except Exception as exc:  # noqa: BLE001 - fall back to eager rather than lose the run
            print(f"torch.compile unavailable ({exc!r}); running eager")

    @torch.no_grad()
    def evaluate(stream: torch.Tensor, max_windows: int | None = None) -> float:
        """Mean next-token loss over non-overlapping ``ctx`` windows of ``stream``."""
        model.eval()
        n = (stream.numel() - 1) // ctx
        if max_windows is not None:
            n = min(n, max_windows)
        total, count = 0.0, 0
        for i in range(0, n, args.eval_batch):
            idx = torch.arange(i, min(n, i + args.eval_batch), device=dev)[:, None] * ctx
            win = stream[idx + offs]
            with amp:
                logits = model(input_ids=win[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                   win[:, 1:].reshape(-1), reduction="sum")
            total += float(loss)
            count += win[:, 1:].numel()
        model.train()
        return total / max(1, count)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    log_path = out / "train_log.jsonl"
    log_f = log_path.open("w")

    def log(rec: dict[str, Any]) -> None:
        print(json.dumps(rec), flush=True)
        log_f.write(json.dumps(rec) + "\n")
        log_f.flush()

    t_eval = time.time()
    v0 = evaluate(val, args.eval_windows)
    eval_seconds = time.time() - t_eval
    log({"step": 0, "val_loss": round(v0, 4), "eval_s": round(eval_seconds, 2)})

    planned = args.max_steps or 10**9
    budget_t0 = time.time()
    timing_from, timing_steps = 10, 30
    t_timing = 0.0
    step_seconds = float("nan")
    best = (float("inf"), -1)
    best_state: dict[str, torch.Tensor] | None = None
    train_hist: list[tuple[int, float]] = []
    loss_acc = torch.zeros((), device=dev)
    acc_n = 0
    step = 0
    stop_reason = "planned steps done"
    model.train()
    while step < planned:
        lr = lr_at(step, planned, args.lr, args.warmup, args.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch()
        try:
            loss = forward_loss(step_fn, x, y)
        except Exception as exc:  # noqa: BLE001 - a compile failure must not end the run
            if step_fn is model:
                raise
            print(f"compiled step failed ({exc!r}); falling back to eager")
            step_fn = model
            loss = forward_loss(step_fn, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        loss_acc += loss.detach()
        acc_n += 1
        step += 1

        if step == timing_from:
            sync()
            t_timing = time.time()
        if step == timing_from + timing_steps and not args.max_steps:
            sync()
            step_seconds = (time.time() - t_timing) / timing_steps
            elapsed = time.time() - budget_t0
            per_step = step_seconds + eval_seconds / args.eval_every
            planned = step + int(max(0.0, args.time_budget - elapsed) / per_step * 0.97)
            # Cap the epochs: past ~16 passes over 8.5M tokens a 13M model mostly
            # memorises (and the device time is better left to others).
            epoch_cap = int(args.max_epochs * train.numel() / (bsz * ctx))
            planned = max(min(planned, epoch_cap), step + 1)
            toks = bsz * ctx / step_seconds
            log({"event": "plan", "step": step, "step_s": round(step_seconds, 5),
                 "tokens_per_s": round(toks), "planned_steps": planned,
                 "planned_tokens": planned * bsz * ctx})

        if step % args.eval_every == 0 or step == planned:
            tl = float(loss_acc) / acc_n
            train_hist.append((step, tl))
            loss_acc.zero_()
            acc_n = 0
            vl = evaluate(val, args.eval_windows)
            if vl < best[0]:
                best = (vl, step)
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            log({"step": step, "lr": round(lr, 6), "train_loss": round(tl, 4),
                 "val_loss": round(vl, 4), "elapsed_s": round(time.time() - budget_t0, 1)})
        if not args.max_steps and time.time() - budget_t0 > args.time_budget + args.grace:
            stop_reason = f"hard deadline at step {step}"
            break
    sync()
    train_seconds = time.time() - budget_t0

    final_val = evaluate(val)
    restored = False
    if best_state is not None and best[0] < final_val - 1e-4 and best[1] != step:
        model.load_state_dict(best_state)
        restored = True
        final_val = evaluate(val)
    final_chat_val = evaluate(val_chat)
    # Train loss of the saved weights, on a fixed sample of training windows.
    g2 = torch.Generator(device=dev)
    g2.manual_seed(args.seed + 7)
    sample_starts = torch.randint(0, train.numel() - ctx - 1, (args.eval_windows or 256,),
                                  device=dev, generator=g2)
    sample = torch.cat([train[s:s + ctx + 1] for s in sample_starts.tolist()])
    final_train = evaluate(sample)
    log({"event": "final", "step": step, "val_loss": round(final_val, 4),
         "val_ppl": round(math.exp(final_val), 3), "val_chat_loss": round(final_chat_val, 4),
         "train_loss": round(final_train, 4), "restored_best": restored})

    # Save in bf16: half the bytes, and the dtype the engine serves in.
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    # Either token ends a reply: <|endoftext|> ends a document, <|end|> a turn.
    model.config.eos_token_id = [eos_id, end_id]
    model.save_pretrained(out, safe_serialization=True)
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=eos_id, eos_token_id=[eos_id, end_id], pad_token_id=eos_id,
        do_sample=False, max_new_tokens=256,
    ).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data / "tokenizer" / name, out / name)

    n_train_tokens = step * bsz * ctx
    manifest = {
        "model": "tokenmill-tiny-py",
        "architecture": "LlamaForCausalLM",
        "parameters": n_params,
        "shape": {**shape, "vocab_size": vocab, "tie_word_embeddings": True,
                  "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
        "corpus": {k: prep[k] for k in ("python_version", "python_implementation", "corpus_sha256",
                                        "corpus_bytes", "files_total", "files_train", "files_val",
                                        "files_skipped", "split", "file_list_sha256",
                                        "chat_samples", "tokens", "bytes_per_token")},
        "tokenizer": prep["tokenizer"],
        "hyperparameters": {
            "seed": args.seed, "context": ctx, "batch": bsz, "tokens_per_step": bsz * ctx,
            "optimizer": "AdamW(betas=(0.9, 0.95), eps=1e-8), no decay on norms",
            "lr_peak": args.lr, "warmup_steps": args.warmup, "schedule": "cosine",
            "min_lr_frac": args.min_lr_frac, "weight_decay": args.weight_decay,
            "grad_clip": args.clip, "precision": "bf16 autocast, fp32 master weights",
            "time_budget_s": args.time_budget, "max_epochs": args.max_epochs,
            "compile": bool(args.compile),
        },
        "run": {
            "planned_steps": planned if planned < 10**9 else None,
            "steps": step, "stop_reason": stop_reason,
            "train_tokens_seen": n_train_tokens,
            "epochs": round(n_train_tokens / max(1, prep["tokens"]["train"]), 2),
            "step_seconds_measured": None if math.isnan(step_seconds) else round(step_seconds, 5),
            "tokens_per_second": round(n_train_tokens / train_seconds),
            "train_wall_s": round(train_seconds, 1),
            "total_wall_s": round(time.time() - t_start, 1),
            "device": gpu, "torch": torch.__version__,
            "best_val": {"step": best[1], "val_loss": round(best[0], 4)},
            "restored_best": restored,
        },
        "final": {
            "train_loss": round(final_train, 4),
            "val_loss": round(final_val, 4),
            "val_perplexity": round(math.exp(final_val), 3),
            "val_chat_loss": round(final_chat_val, 4),
            "val_bits_per_byte": round(final_val / math.log(2) / prep["bytes_per_token"], 4),
        },
        "curve": [
            {"step": s, "train_loss": round(t, 4)} for s, t in train_hist
        ],
    }
    (out / "training.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log_f.close()
    print(json.dumps({k: manifest[k] for k in ("parameters", "run", "final")}, indent=2))


# --------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(root):",
    "class Stack:\n    def __init__(self):",
    "    def __repr__(self):",
]


def cmd_check(args: argparse.Namespace) -> None:
    """Load the saved model with ``transformers`` Auto classes and sample it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    print(f"loaded {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} params), "
          f"tokenizer {type(tok).__name__} vocab {len(tok)}; eos {tok.eos_token!r}={tok.eos_token_id}")
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    print(f"directory size {size / 2**20:.2f} MiB")

    msgs = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
            {"role": "user", "content": "Write a Python function `is_prime(n)`. Return True if n is prime."}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == render_chat(msgs, add_generation_prompt=True), rendered
    print("chat template ok:", repr(rendered))

    gen_cfg = model.generation_config
    for prompt in PROMPTS + ([rendered] if not args.no_chat else []):
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 eos_token_id=gen_cfg.eos_token_id, pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)
        print("=" * 72)
        print(prompt + text)


# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and run one subcommand."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    pp = sub.add_parser("prepare", help="corpus, split, tokenizer, token arrays (CPU)")
    pp.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    pp.add_argument("--out", default=".cache/tiny")
    pp.add_argument("--seed", type=int, default=1234)
    pp.add_argument("--val-frac", type=float, default=0.03)
    pp.add_argument("--vocab-size", type=int, default=8192)
    pp.add_argument("--chat-limit", type=int, default=4000, help="synthetic chat samples (train)")
    pp.set_defaults(func=cmd_prepare)

    pt = sub.add_parser("train", help="train on the GPU for a wall-clock budget")
    pt.add_argument("--data", default=".cache/tiny")
    pt.add_argument("--out", required=True)
    pt.add_argument("--seed", type=int, default=1234)
    pt.add_argument("--ctx", type=int, default=512)
    pt.add_argument("--batch", type=int, default=128)
    pt.add_argument("--lr", type=float, default=2e-3)
    pt.add_argument("--min-lr-frac", type=float, default=0.05)
    pt.add_argument("--warmup", type=int, default=200)
    pt.add_argument("--weight-decay", type=float, default=0.1)
    pt.add_argument("--clip", type=float, default=1.0)
    pt.add_argument("--time-budget", type=float, default=240.0, help="seconds of training")
    pt.add_argument("--grace", type=float, default=20.0, help="hard stop this long past the budget")
    pt.add_argument("--eval-every", type=int, default=250)
    pt.add_argument("--eval-batch", type=int, default=64)
    pt.add_argument("--eval-windows", type=int, default=None, help="cap periodic eval windows")
    pt.add_argument("--max-epochs", type=float, default=16.0, help="cap on passes over train")
    pt.add_argument("--max-steps", type=int, default=0, help="fixed step count instead of the budget")
    pt.add_argument("--compile", action="store_true", help="torch.compile the model (GPU only)")
    pt.add_argument("--smoke", action="store_true", help="tiny shape for a CPU test")
    pt.add_argument("--cpu", action="store_true")
    pt.set_defaults(func=cmd_train)

    pc = sub.add_parser("check", help="load with transformers and sample greedily (CPU)")
    pc.add_argument("--model", default="tokenmill/data/default_model")
    pc.add_argument("--max-new-tokens", type=int, default=96)
    pc.add_argument("--no-chat", action="store_true")
    pc.set_defaults(func=cmd_check)

    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
