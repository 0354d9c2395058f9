"""The front-end's handle on the engine core: starts it in a process of its own (or, for tests, a
thread), owns both ends of its sockets, and knows whether it lives."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import uuid
from multiprocessing.process import BaseProcess

import msgspec
import zmq

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.core_process import run_core_process, serve_core
from tokenmill.engine.core.engine_core import EngineCore
from tokenmill.engine.messages import CoreFailed, CoreInput, CoreReady, Shutdown

logger = logging.getLogger(__name__)

_REAP_TIMEOUT_S = 5.0  # how long a core process that is gone may take to leave its exit status


class CoreStartupError(RuntimeError):
    """The engine core could not start; the message says why."""


class CoreClient:
    """Starts the core (process or thread), owns both sockets, and knows whether it lives.

    ``send`` never blocks; outputs are read with ``output_socket`` (wrap it for asyncio).
    The constructor starts the core and returns; ``wait_ready`` blocks until the core reports
    ready (the caller does its own start-up meanwhile), and raises ``ValueError`` for a bad
    configuration (as the in-process engine would) or ``CoreStartupError``.
    """

    def __init__(self, config: EngineConfig, in_thread: bool = False) -> None:
        self.context = zmq.Context()
        self._tmpdir: str | None = None
        if in_thread:
            name = uuid.uuid4().hex
            input_address, output_address = f"inproc://core-in-{name}", f"inproc://core-out-{name}"
        else:
            self._tmpdir = tempfile.mkdtemp(prefix="tokenmill-")
            input_address = f"ipc://{self._tmpdir}/in"
            output_address = f"ipc://{self._tmpdir}/out"
        self.input_socket = self.context.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.bind(input_address)
        self.output_socket = self.context.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.bind(output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self.process: BaseProcess | None = None
        self.thread: threading.Thread | None = None
        self.thread_core: list[EngineCore] = []  # the core, once a thread built it
        if in_thread:
            self.thread = threading.Thread(
                target=serve_core,
                args=(config, input_address, output_address, self.context, None, self.thread_core),
                name="tokenmill-core",
                daemon=True,
            )
            self.thread.start()
        else:
            spawn = multiprocessing.get_context("spawn")  # CUDA cannot be forked
            self.process = spawn.Process(
                target=run_core_process,
                name="tokenmill-core",
                daemon=True,
                args=(config, input_address, output_address, os.getpid(), logging.getLogger().getEffectiveLevel()),
            )
            self.process.start()

    def wait_ready(self) -> CoreReady:
        """The core's ready report; on a failed start-up the core is shut down and the error raised."""
        try:
            return self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self) -> CoreReady:
        decoder = msgspec.msgpack.Decoder(CoreReady | CoreFailed)
        while not self.output_socket.poll(200):
            if not self.is_alive():
                raise CoreStartupError(f"the engine core exited during start-up ({self.exit_description()})")
        message = decoder.decode(self.output_socket.recv())
        if isinstance(message, CoreFailed):
            error = ValueError if message.is_value_error else CoreStartupError
            raise error(message.message)
        return message

    @property
    def core(self) -> EngineCore | None:
        """The core object when it runs in a thread of this process (tests reach into it)."""
        return self.thread_core[0] if self.thread_core else None

    def send(self, message: CoreInput) -> None:
        self.send_encoded(self._encoder.encode(message))

    def send_encoded(self, message: bytes) -> None:
        self.input_socket.send(message, copy=False)

    def is_alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        return self.thread is not None and self.thread.is_alive()

    def exit_description(self) -> str:
        """How the core's process ended ("killed by signal SIGKILL (9)", "exit code 1"), for a core
        known to be gone (its sentinel readable, or ``is_alive`` false). It reaps the process: the
        sentinel turns readable as the dying process closes its files, which may be before the kernel
        lets its exit status be read, so a poll alone could find nothing yet (and then no one would
        ever reap it). A core in a thread has no status: "stopped"."""
        if self.process is None:
            return "stopped"
        self.process.join(_REAP_TIMEOUT_S)
        code = self.process.exitcode
        if code is None:
            return "still running"
        if code >= 0:
            return f"exit code {code}"
        try:
            name = signal.Signals(-code).name
        except ValueError:
            return f"killed by signal {-code}"
        return f"killed by signal {name} ({-code})"

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait for it, and make sure it is gone."""
        if self.is_alive():
            try:
                self.send(Shutdown())
            except zmq.ZMQError:
                pass
        if self.process is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        if self.thread is not None:
            self.thread.join(timeout)
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        if self.thread is None or not self.thread.is_alive():
            self.context.term()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
