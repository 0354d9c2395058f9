"""Ranks 1 … N-1 of a tensor-parallel engine, each in a process of its own.

Rank 0 lives in the engine core: it schedules, samples and owns every sequence's state, and starts
the others through ``WorkerGroup``. Each worker joins the process group, loads its share of the
weights, reports the KV blocks its memory holds, builds its runner with the pools rank 0 settles on
(``RankSetup``), then runs every ``StepPlan`` rank 0 sends, in order, until told to stop. Messages
cross one pipe per worker, pickled; a plan is sent before rank 0 launches the step itself, so the
workers' host work overlaps its own.

A worker that fails reports its error and exits; one that is killed closes its pipe. Rank 0 finds
out at its next wait: a collective that fails (gloo), a GPU event it polls while watching the
processes (NCCL), a pipe that breaks, or a reply it waits for with a deadline. It then raises
``WorkerError`` naming the rank, and the engine stops.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch

from tokenmill.distributed import destroy_group, init_group
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.worker.model_runner import build_model
from tokenmill.engine.worker.rank import (
    RankSetup,
    apply_quantization,
    kv_cache_blocks,
    make_runner,
    rank_device,
    resolve_device,
)
from tokenmill.loader.kv_layout import resolve_kv_cache_dtype
from tokenmill.loader.model_config import resolve_dtype
from tokenmill.models.registry import load_model_config

logger = logging.getLogger(__name__)

# How long a collective may wait for a peer before it fails (gloo; NCCL's watchdog) — a backstop:
# a dead peer is noticed long before, by its process or its pipe.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# How long rank 0 waits for a worker's start-up replies (loading a large shard takes minutes).
STARTUP_TIMEOUT_S = 1800.0
_POLL_S = 0.05


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed: the engine cannot go on."""


class WorkerGroup:
    """Rank 0's handle on the other ranks: starts them, talks to them, notices when one dies."""

    def __init__(self, engine_config: EngineConfig, model_dir: Path) -> None:
        self.size = engine_config.tensor_parallel_size
        self._store = tempfile.mkdtemp(prefix="tokenmill-tp-")
        self.init_method = f"file://{self._store}/store"
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self.processes: list[BaseProcess] = []
        self.pipes: list[Connection] = []
        with _may_have_children():
            for rank in range(1, self.size):
                ours, theirs = context.Pipe()
                process = context.Process(
                    target=run_worker,
                    name=f"tokenmill-tp{rank}",
                    daemon=True,
                    args=(
                        engine_config,
                        model_dir,
                        rank,
                        self.init_method,
                        theirs,
                        logging.getLogger().getEffectiveLevel(),
                    ),
                )
                process.start()
                theirs.close()
                self.processes.append(process)
                self.pipes.append(ours)
        self._errors: dict[int, str] = {}

    # ------------------------------------------------------------ messages
    def send(self, message: Any) -> None:
        """``message`` to every worker (a ``StepPlan``, a ``RankSetup``, or None: stop)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for pipe in self.pipes:
            try:
                pipe.send_bytes(data)
            except OSError as exc:  # a broken pipe: that worker is gone
                raise self.failure(exc) from exc

    def receive(self, what: str, timeout: float = STARTUP_TIMEOUT_S) -> list[Any]:
        """One reply from each worker, in rank order (``what``: for the error if one never comes)."""
        deadline = time.monotonic() + timeout
        replies = []
        for rank, pipe in enumerate(self.pipes, start=1):
            while not pipe.poll(_POLL_S):
                self.check()
                if time.monotonic() > deadline:
                    raise WorkerError(f"tensor-parallel worker rank {rank} sent no {what} within {timeout:.0f} s")
            reply = self._read(rank, pipe)
            if reply is None:
                raise self.failure()
            replies.append(reply[1])
        return replies

    def _read(self, rank: int, pipe: Connection) -> tuple[str, Any] | None:
        """A worker's next message, ``(kind, value)``; None (its error noted) if it reported one or its
        pipe closed."""
        try:
            kind, value = pickle.loads(pipe.recv_bytes())
        except (EOFError, OSError):
            return None
        if kind == "error":
            self._errors[rank] = value
            return None
        return kind, value

    def wait(self, event: torch.cuda.Event) -> None:
        """``event.synchronize()``, watching the workers meanwhile: a peer that died leaves this rank's
        collectives waiting forever on the GPU, so a plain synchronize would hang."""
        checked = time.monotonic()
        while not event.query():
            if time.monotonic() - checked > _POLL_S:
                self.check()
                checked = time.monotonic()

    def check(self) -> None:
        """Raise ``WorkerError`` if a worker has died (a failing worker reports its error, which
        ``failure`` reads, then exits)."""
        if not all(process.is_alive() for process in self.processes):
            raise self.failure()

    def failure(self, cause: BaseException | None = None) -> WorkerError:
        """The error naming the worker that failed, or else rank 0's own ``cause``. A collective that
        broke because a peer died may be seen before that peer's exit is: wait a moment for it to show.
        A worker killed outright is named before one that reported an error, which may only have
        been its collectives failing after the other's death."""
        deadline = time.monotonic() + 5.0
        while True:
            for rank, pipe in enumerate(self.pipes, start=1):
                with contextlib.suppress(EOFError, OSError):
                    while rank not in self._errors and pipe.poll() and self._read(rank, pipe) is not None:
                        pass  # a start-up reply nobody will read now
            dead = [rank for rank, process in enumerate(self.processes, start=1) if not process.is_alive()]
            killed = [rank for rank in dead if rank not in self._errors]
            if killed:
                process = self.processes[killed[0] - 1]
                process.join(1.0)
                return WorkerError(
                    f"tensor-parallel worker rank {killed[0]} died ({_exit_description(process)}); "
                    "the engine has stopped"
                )
            if self._errors:
                rank = min(self._errors)
                return WorkerError(f"tensor-parallel worker rank {rank} failed: {self._errors[rank]}")
            if time.monotonic() > deadline:
                if cause is None:
                    return WorkerError("the tensor-parallel workers stopped answering; the engine has stopped")
                return WorkerError(
                    f"rank 0 of the tensor-parallel engine failed ({type(cause).__name__}: {cause}); "
                    "the engine has stopped"
                )
            time.sleep(_POLL_S)

    def close(self, timeout: float = 10.0) -> None:
        """Tell the workers to stop, wait for them, make sure they are gone."""
        with contextlib.suppress(Exception):
            self.send(None)
        for process in self.processes:
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join(5.0)
        for pipe in self.pipes:
            pipe.close()
        shutil.rmtree(self._store, ignore_errors=True)


@contextlib.contextmanager
def _may_have_children() -> Iterator[None]:
    """multiprocessing refuses children to a daemonic process, which the server's engine core is (it
    must die with the server). The workers are bound to it all the same: each exits when its pipe
    to rank 0 closes, and is daemonic itself."""
    config: dict[str, Any] = multiprocessing.current_process()._config  # type: ignore[attr-defined]  # private
    daemon = config.get("daemon", False)
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon


def _exit_description(process: BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def run_worker(
    engine_config: EngineConfig, model_dir: Path, rank: int, init_method: str, pipe: Connection, log_level: int
) -> None:
    """A worker process's entry point. Rank 0 alone decides when it stops (a None message, or its pipe
    closing when rank 0's process ends): signals sent to the whole process group are ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(name)s [rank {rank}]: %(message)s")
    if "OMP_NUM_THREADS" not in os.environ:  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // engine_config.tensor_parallel_size))
    failed = False
    try:
        model_config = load_model_config(model_dir)
        device = rank_device(resolve_device(engine_config.device), rank)
        dtype = resolve_dtype(engine_config.dtype, model_config, device)
        kv_dtype = resolve_kv_cache_dtype(engine_config.kv_cache_dtype, dtype, device)
        _reply(pipe, "joining", None)
        tp = init_group(device, rank, engine_config.tensor_parallel_size, init_method, COLLECTIVE_TIMEOUT)
        torch.manual_seed(engine_config.seed)
        max_len = engine_config.max_model_len or model_config.max_position_embeddings
        model = build_model(
            model_config,
            None if engine_config.random_weights else model_dir,
            dtype,
            device,
            max_len,
            engine_config.seed,
            tp,
        )
        apply_quantization(model, engine_config, model_config, model_dir, device)
        _reply(pipe, "blocks", kv_cache_blocks(engine_config, model_config, device, dtype, kv_dtype, max_len))
        setup: RankSetup = pickle.loads(pipe.recv_bytes())
        runner = make_runner(engine_config, model_config, model, setup, device, dtype, kv_dtype, tp)
        if device.type == "cuda":
            assert engine_config.max_num_batched_tokens is not None  # rank 0 sends its resolved config
            runner.warm_up(engine_config.max_num_batched_tokens, setup.max_model_len)
        _reply(pipe, "ready", None)
        while (plan := pickle.loads(pipe.recv_bytes())) is not None:
            runner.follow(plan)
    except EOFError:  # rank 0 is gone
        logger.error("rank 0 of the engine is gone; worker rank %d exits", rank)
    except BaseException as exc:
        failed = True
        logger.exception("tensor-parallel worker rank %d failed", rank)
        with contextlib.suppress(OSError):
            _reply(pipe, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-4)}")
        raise SystemExit(1) from exc
    finally:
        destroy_group(abort=failed)


def _reply(pipe: Connection, kind: str, value: Any) -> None:
    pipe.send_bytes(pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL))
