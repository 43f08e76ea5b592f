"""Front-end clients of an engine core running in its own (spawned) process.

Requests go out on a PUSH socket, outputs come back on a PULL socket; both are ipc sockets in
a private temporary directory, and every message is msgspec msgpack (never pickle). The
client watches the process sentinel, so a core that dies is noticed at once rather than
by a read that never returns.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagedllm.config import EngineConfig
from pagedllm.engine.core_proc import EngineCoreReady, run_engine_core
from pagedllm.engine.messages import EngineCoreOutputs, EngineCoreRequest, RequestType

logger = logging.getLogger("pagedllm")

_SHUTDOWN_TIMEOUT_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine-core process has exited; no request can be served any more."""


class MPClient:
    """Starts the engine-core process and owns the sockets to it.

    Construction returns as soon as the process is started (so the caller can load its
    tokenizer meanwhile); ``wait_ready`` completes the handshake.

    Args:
        config: engine settings, handed to the spawned process.
        engine_index: which of ``config.data_parallel_size`` data-parallel cores this is.
    """

    def __init__(self, config: EngineConfig, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self._tmpdir = tempfile.mkdtemp(prefix="pagedllm-")
        input_addr, output_addr = f"ipc://{self._tmpdir}/input", f"ipc://{self._tmpdir}/output"
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        # Unbounded send queue: a send to a live core never blocks the front end.
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._call_ids = itertools.count()
        self._closed = False
        self._ready = False  # the handshake arrived: the core reads its input from then on
        # spawn, not fork: the front end may already hold threads (tokenizers, asyncio).
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(config, input_addr, output_addr, os.getpid(), engine_index),
            name="EngineCore" if config.data_parallel_size == 1 else f"EngineCore_DP{engine_index}",
            daemon=True,  # multiprocessing terminates it if the front end exits without shutdown()
        )
        self.proc.start()
        # How errors name this core: data-parallel cores by index and pid, so a log names the one that died.
        dp = config.data_parallel_size > 1
        self.name = f"engine core {engine_index} (pid {self.proc.pid})" if dp else "engine core"

    def wait_ready(self) -> EngineCoreReady:
        """Block until the core has loaded the model.

        Raises:
            RuntimeError: the core failed to start (its error in the message).
        """
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        poller.poll()  # until the handshake arrives or the process exits
        # A core that failed sent its reason just before exiting: give it a moment to arrive.
        if not self._output.poll(1000):
            raise RuntimeError(f"{self.exit_description()} during startup")
        ready = msgspec.msgpack.decode(self._output.recv(), type=EngineCoreReady)
        if ready.error is not None:
            raise RuntimeError(f"{self.name} failed to start: {ready.error}")
        self._ready = True
        return ready

    @property
    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def exit_description(self) -> str:
        """How the exited core process ended: "the engine core process was killed by SIGKILL"
        (the OOM killer's signal) or "... exited with code 1". It is reaped first: its sentinel
        closes a moment before it can be, when its exit code would still read None."""
        self.proc.join()
        code = self.proc.exitcode
        if code is not None and code < 0:
            return f"the {self.name} process was killed by {signal.Signals(-code).name}"
        return f"the {self.name} process exited with code {code}"

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for r in requests:
            self._send(RequestType.ADD, r)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort engine-core requests; a no-op once the core is gone (it holds nothing then)."""
        if not request_ids:
            return
        try:
            self._send(RequestType.ABORT, request_ids)
        except EngineDeadError:
            pass

    def _send(self, kind: RequestType, payload: Any) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"the {self.name} process is not running")
        try:
            self._input.send_multipart((bytes([kind]), self._encoder.encode(payload)), zmq.NOBLOCK)
        except zmq.Again:  # no peer: the core has just gone
            raise EngineDeadError(f"the {self.name} process is not running") from None

    def _utility_message(self, method: str, args: tuple[Any, ...]) -> int:
        call_id = next(self._call_ids)
        self._send(RequestType.UTILITY, (call_id, method, list(args)))
        return call_id

    def shutdown(self) -> None:
        """Ask the core to stop, wait for it, kill it if it does not; remove the sockets. A core
        still starting (the front end failed first: an unknown model, a bad chat template) reads
        no input yet: it is killed at once."""
        if self._closed:
            return
        self._closed = True
        if self.proc.is_alive() and not self._ready:
            self.proc.kill()
            self.proc.join()
        elif self.proc.is_alive():
            try:
                self._input.send_multipart((bytes([RequestType.SHUTDOWN]), b""), zmq.NOBLOCK)
            except zmq.Again:
                pass
            self.proc.join(_SHUTDOWN_TIMEOUT_S)
            if self.proc.is_alive():
                logger.warning("%s did not stop within %.0f s; killing it", self.name, _SHUTDOWN_TIMEOUT_S)
                self.proc.kill()
                self.proc.join()
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._tmpdir, ignore_errors=True)


class SyncMPClient(MPClient):
    """Blocking client, for a synchronous front end (an offline ``LLM`` over a core process)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._pending: deque[EngineCoreOutputs] = deque()  # step outputs read while awaiting a utility reply
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        self._poller.register(self.proc.sentinel, zmq.POLLIN)

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs, blocking until they come.

        Raises:
            EngineDeadError: the core process has exited.
        """
        if self._pending:
            return self._pending.popleft()
        while True:
            out = self._recv()
            if out.utility_call_id is None:
                return out

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run an engine-core method (e.g. ``reset_prefix_cache``) and return its result."""
        call_id = self._utility_message(method, args)
        while True:
            out = self._recv()
            if out.utility_call_id == call_id:
                return out.utility_result
            if out.utility_call_id is None:
                self._pending.append(out)

    def _recv(self) -> EngineCoreOutputs:
        if self._output not in dict(self._poller.poll()):  # only the sentinel fired
            raise EngineDeadError(self.exit_description())
        return self._decoder.decode(self._output.recv())


class AsyncMPClient(MPClient):
    """asyncio client: sends are immediate (never block), outputs are awaited.

    Call ``start()`` inside the running event loop before awaiting outputs.
    """

    def __init__(self, config: EngineConfig, engine_index: int = 0) -> None:
        super().__init__(config, engine_index)
        self._async_output: zmq.asyncio.Socket | None = None
        self._dead: asyncio.Future[None] | None = None
        self._utility_futures: dict[int, asyncio.Future[Any]] = {}

    def start(self) -> None:
        """Attach to the running loop: async reads, and a reader on the process sentinel."""
        loop = asyncio.get_running_loop()
        self._async_output = zmq.asyncio.Socket.from_socket(self._output)
        self._dead = loop.create_future()
        loop.add_reader(self.proc.sentinel, self._on_exit)

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.proc.sentinel)
        if not self._dead.done():
            self._dead.set_result(None)
        error = EngineDeadError(self.exit_description())
        for fut in self._utility_futures.values():
            if not fut.done():
                fut.set_exception(error)

    async def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs; utility replies are routed to their callers on the way.

        Raises:
            EngineDeadError: the core process has exited (outputs it sent before are still read).
        """
        while True:
            recv = self._async_output.recv()
            await asyncio.wait((recv, self._dead), return_when=asyncio.FIRST_COMPLETED)
            if not recv.done():
                recv.cancel()
                raise EngineDeadError(self.exit_description())
            out = self._decoder.decode(recv.result())
            if out.utility_call_id is None:
                return out
            fut = self._utility_futures.pop(out.utility_call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(out.utility_result)

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run an engine-core method and await its result (someone must be reading outputs)."""
        call_id = self._utility_message(method, args)
        fut = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = fut
        return await fut

    def shutdown(self) -> None:
        if self._dead is not None and not self._dead.done():
            try:
                asyncio.get_running_loop().remove_reader(self.proc.sentinel)
            except RuntimeError:  # no running loop any more: nothing to detach from
                pass
        super().shutdown()
