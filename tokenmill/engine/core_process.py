"""The engine core in a process of its own, and the front-end's handle on it.

The core process loads the model, then loops: take every message waiting on
its input socket (new requests, aborts), run one step, send the step's
outputs. Nothing else runs there, so HTTP, tokenizing and detokenizing never
take time from the GPU, and a crash in the front-end or in one request's
handling cannot corrupt the core's state. Messages are msgpack-encoded
``tokenmill.engine.messages`` structs over ZeroMQ (PUSH/PULL, one socket each
way, over an ipc path the front-end owns).

The same loop can run in a thread of the front-end's process (``in_thread``),
over in-process sockets: tests use it to reach into the core.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from multiprocessing.process import BaseProcess

import msgspec
import torch
import zmq

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import CoreFailed, CoreInput, CoreReady, Shutdown

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500  # how often an idle core checks that its parent is alive
_STATS_INTERVAL_S = 0.5  # a busy core sends its gauges at least this often, outputs or not
_REAP_TIMEOUT_S = 5.0  # how long a core process that is gone may take to leave its exit status


class CoreStartupError(RuntimeError):
    """The engine core could not start; the message says why."""


class CoreLoop:
    """The busy loop over one core: inputs between steps, one output message per step."""

    def __init__(
        self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int | None = None
    ) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self._decoder = msgspec.msgpack.Decoder(CoreInput)
        self._encoder = msgspec.msgpack.Encoder()

    def run(self) -> None:
        last_sent = time.monotonic()
        while True:
            busy = self.core.has_unfinished_requests()
            if not self._take_inputs(0 if busy else _IDLE_POLL_MS):
                return
            if not self._parent_alive():  # nobody would read what we compute
                logger.error("the front-end process is gone; the engine core exits")
                return
            if self.core.has_unfinished_requests():
                result = self.core.step()
            else:
                result = self.core.take_outputs()
            now = time.monotonic()
            if result.outputs or now - last_sent > _STATS_INTERVAL_S or not busy:
                self.outputs.send(self._encoder.encode(result), copy=False)
                last_sent = now

    def _take_inputs(self, timeout_ms: int) -> bool:
        """Apply every waiting message (waiting up to ``timeout_ms`` for the first);
        False once told to shut down."""
        if not self.inputs.poll(timeout_ms):
            return True
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            message = self._decoder.decode(frame.buffer)
            if isinstance(message, Shutdown):
                return False
            try:
                self.core.handle(message)
            except Exception:  # never lose the core to one message
                logger.exception("the engine core could not apply %s", type(message).__name__)

    def _parent_alive(self) -> bool:
        return self.parent_pid is None or os.getppid() == self.parent_pid


def _serve_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    context: zmq.Context,
    parent_pid: int | None,
    on_core: list | None = None,
) -> None:
    """Build the core, report ready (or why not), run the loop; shared by process and thread."""
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 1000)
    outputs.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    core = None
    try:
        try:
            core = EngineCore(config)
        except Exception as exc:
            logger.exception("the engine core could not start")
            outputs.send(encoder.encode(CoreFailed(str(exc), isinstance(exc, ValueError))))
            return
        if on_core is not None:
            on_core.append(core)
        outputs.send(encoder.encode(core.ready_message()))
        CoreLoop(core, inputs, outputs, parent_pid).run()
    finally:
        if core is not None:
            core.shutdown()
        inputs.close(linger=0)
        outputs.close()


def run_core_process(
    config: EngineConfig, input_address: str, output_address: str, parent_pid: int, log_level: int
) -> None:
    """The child process's entry point. The front-end alone decides when the core stops (a
    Shutdown message, or its own death): a terminal's Ctrl-C, or a SIGTERM sent to the whole
    process group, must not end the core before the server has drained its streams."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    if "OMP_NUM_THREADS" not in os.environ:
        # Leave a core to the front-end: torch's CPU threads spin at their barriers, and one
        # that shares its core with the HTTP process stalls every step (5x on two cores).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    context = zmq.Context()
    try:
        _serve_core(config, input_address, output_address, context, parent_pid)
    finally:
        context.term()


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
                target=_serve_core,
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
