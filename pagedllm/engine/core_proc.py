"""The engine-core process: an ``EngineCore`` driven by a busy loop over ZeroMQ sockets.

The front end binds two ipc sockets: it PUSHes requests (``RequestType`` frame + msgpack body)
and PULLs ``EngineCoreOutputs``. The process first sends one ``EngineCoreReady`` (the
handshake: startup figures, or the error that stopped it), then loops: block on the input
socket while there is nothing to run, else drain the input, run one step and send its outputs.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.distributed.cpu_budget import cpu_share, pin_to
from pagedllm.engine.malloc_trim import Trimmer
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, RequestType
from pagedllm.outputs import RequestError

logger = logging.getLogger("pagedllm")

# While idle the loop wakes this often only to notice that its parent has gone away.
_IDLE_POLL_MS = 1000


class EngineCoreReady(msgspec.Struct):
    """The first message from the core process: what the front end needs, or why it failed."""

    kv_cache_config: KVCacheConfig | None = None
    model_config: ModelConfig | None = None
    error: str | None = None


class EngineCoreProc:
    """Runs the busy loop of one engine core.

    Args:
        core: the engine core (model loaded).
        input_socket: PULL socket carrying requests from the front end.
        output_socket: PUSH socket carrying outputs to the front end.
        parent_pid: the front end's pid; the loop ends when the process is re-parented.
    """

    def __init__(self, core, input_socket: zmq.Socket, output_socket: zmq.Socket, parent_pid: int) -> None:
        self.core = core
        self.input = input_socket
        self.output = output_socket
        self.parent_pid = parent_pid
        self._encoder = msgspec.msgpack.Encoder()
        self._add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self._abort_decoder = msgspec.msgpack.Decoder(list[str])
        self._utility_decoder = msgspec.msgpack.Decoder(tuple[int, str, list[Any]])
        self._utilities: dict[str, Callable[..., Any]] = {"reset_prefix_cache": core.reset_prefix_cache}
        # Free C-heap pages back to the kernel: start-up, idle, every minute of work (malloc_trim.py).
        self.trimmer = Trimmer()

    def run(self) -> None:
        """Loop until SHUTDOWN arrives or the parent dies."""
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        self.trimmer.started()
        while os.getppid() == self.parent_pid:
            if not self.core.has_unfinished_requests() and not poller.poll(_IDLE_POLL_MS):
                self.trimmer.idle()
                continue
            changed = self._drain_input()
            if changed is None:
                return
            if self.core.has_unfinished_requests():
                self._send(self.core.step())
                self.trimmer.stepped()
            elif changed:
                # Aborts emptied the engine: report the idle stats so gauges drop to zero.
                self._send(self.core.idle_outputs())

    def _drain_input(self) -> bool | None:
        """Apply every queued message. Returns whether requests changed, None on SHUTDOWN."""
        changed = False
        while True:
            try:
                kind, payload = self.input.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return changed
            kind = RequestType(kind[0])
            if kind == RequestType.ADD:
                self._add(self._add_decoder.decode(payload))
                changed = True
            elif kind == RequestType.ABORT:
                self.core.abort_requests(self._abort_decoder.decode(payload))
                changed = True
            elif kind == RequestType.UTILITY:
                call_id, method, args = self._utility_decoder.decode(payload)
                result = self._utilities[method](*args)
                self._send(EngineCoreOutputs(utility_call_id=call_id, utility_result=result))
            else:
                return None

    def _add(self, request: EngineCoreRequest) -> None:
        try:
            self.core.add_request(request)
        except Exception as e:
            # The front end validated the request; whatever still fails ends that request
            # alone, never the loop that serves all the others.
            logger.exception("could not add request %s", request.request_id)
            error = RequestError(f"could not add the request: {type(e).__name__}: {e}")
            self._send(EngineCoreOutputs([EngineCoreOutput(request.request_id, [], "error", error=error)]))

    def _send(self, outputs: EngineCoreOutputs) -> None:
        self.output.send(self._encoder.encode(outputs), copy=False)


def run_engine_core(
    config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int, engine_index: int = 0
) -> None:
    """Entry point of the spawned process: pin (data-parallel cores), load the model, handshake, loop.

    Args:
        engine_index: which of ``config.data_parallel_size`` cores this is: it takes that share of the cores.
    """
    # Ctrl-C and service managers signal the whole process group; the front end alone decides
    # when the core stops (SHUTDOWN message), and the loop exits by itself if the front end dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dp = config.data_parallel_size
    name = "EngineCore" if dp == 1 else f"EngineCore_DP{engine_index}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {name}: %(message)s")
    if dp > 1:
        # N replicas each running one thread per core would oversubscribe N times over.
        pin_to(cpu_share(engine_index, dp), f"data-parallel engine core {engine_index} of {dp}")
    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.PULL)
    input_socket.connect(input_addr)
    output_socket = ctx.socket(zmq.PUSH)
    output_socket.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        from pagedllm.engine.core import EngineCore

        core = EngineCore(config)
    except Exception as e:
        # A ValueError is a setting or model the user chose, its message saying what: the front
        # end logs that one line. Anything else is a fault here, logged with its traceback.
        if not isinstance(e, ValueError):
            logger.error("engine core failed to start:\n%s", traceback.format_exc())
        output_socket.send(encoder.encode(EngineCoreReady(error=f"{type(e).__name__}: {e}")))
        ctx.destroy(linger=1000)
        raise SystemExit(1) from None
    ready = EngineCoreReady(core.kv_config, core.model_config)
    output_socket.send(encoder.encode(ready))
    try:
        EngineCoreProc(core, input_socket, output_socket, parent_pid).run()
    finally:
        core.shutdown()
        ctx.destroy(linger=0)
