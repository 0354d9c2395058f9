"""The engine core in a process of its own (the front-end's handle on it: ``frontend/core_client.py``).

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
import os
import signal
import time

import msgspec
import torch
import zmq

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.engine_core import EngineCore
from tokenmill.engine.messages import CoreFailed, CoreInput, Shutdown

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500  # how often an idle core checks that its parent is alive
_STATS_INTERVAL_S = 0.5  # a busy core sends its gauges at least this often, outputs or not


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


def serve_core(
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
        serve_core(config, input_address, output_address, context, parent_pid)
    finally:
        context.term()
