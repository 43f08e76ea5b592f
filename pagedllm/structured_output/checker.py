"""Grammar checks isolated in worker processes, behind plain-Python limits and a time budget.

Every structured-output constraint a client sends is checked here before it is queued: first
``limits.check_shape`` (size, rules, depth, width; no native code), then a full compile in a
grammar worker process (``grammar_worker``). A compile that crashes the native library or runs
past ``compile_timeout_s`` costs that worker (it is replaced) and answers the request with a
400 naming the field; the calling process and every other request are untouched.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time

import msgspec

from pagedllm.errors import InvalidParamError
from pagedllm.structured_output.cache import BoundedCache
from pagedllm.structured_output.grammar_worker import HEADER, frame
from pagedllm.structured_output.limits import GrammarLimits, check_shape

logger = logging.getLogger("pagedllm")

DEFAULT_WORKERS = 2
CACHE_BYTES = 64 * 1024 * 1024  # results kept, counted as constraint text + grammar text


class _WorkerDied(Exception):
    pass


class _Worker:
    """One grammar worker process and its two pipes; used by one thread at a time."""

    def __init__(self) -> None:
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.structured_output.grammar_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )

    def run(self, kind: str, text: str, timeout: float) -> list:
        """The worker's reply to one job.

        Raises:
            _WorkerDied: the process exited (crashed) before replying.
            TimeoutError: no reply within ``timeout`` seconds (the process is left running).
        """
        try:
            self.proc.stdin.write(frame(msgspec.msgpack.encode([kind, text])))
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise _WorkerDied from None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        data = b""
        need = HEADER.size
        while len(data) < need:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, max(need - len(data), 65536))
            if not chunk:
                raise _WorkerDied
            data += chunk
            if need == HEADER.size and len(data) >= HEADER.size:
                need += HEADER.unpack(data[: HEADER.size])[0]
        return msgspec.msgpack.decode(data[HEADER.size : need])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


class GrammarChecker:
    """A small pool of grammar worker processes, started on first use; thread-safe.

    Args:
        limits: what a constraint may be (sizes, depth, width, compile time).
        workers: processes compiling at once; a check waits for a free one.
    """

    def __init__(self, limits: GrammarLimits | None = None, workers: int = DEFAULT_WORKERS) -> None:
        self.limits = limits or GrammarLimits()
        self._workers: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(workers):
            self._workers.put(None)  # started when first taken
        self._lock = threading.Lock()
        self._live: set[_Worker] = set()  # started and not yet stopped, idle or busy
        # Results, sized as constraint text + grammar text; no bound on their number. A failure is
        # kept as an InvalidParamError that was never raised (no traceback) and raised as a copy.
        self._cache: BoundedCache[tuple[str, str], str | InvalidParamError] = BoundedCache(1 << 62, CACHE_BYTES)

    def check(self, kind: str, text: str) -> str:
        """The grammar text of a constraint (``StructuredOutputsParams.key``) that compiles.

        Raises:
            InvalidParamError: ``param`` is ``kind``: beyond the limits, does not compile,
                crashed the compiler, or ran past the compile budget.
        """
        key = (kind, text)
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                if isinstance(hit, InvalidParamError):
                    raise InvalidParamError(hit.param, str(hit))
                return hit
        try:
            grammar = self._compile(kind, text)
        except InvalidParamError as e:
            # A fresh error, never raised: a raised one's traceback holds its frames (the parsed
            # schema, the caller's request), which the cache's size does not count.
            self._remember(key, InvalidParamError(e.param, str(e)))
            raise
        self._remember(key, grammar)
        return grammar

    def worker_pids(self) -> list[int]:
        """Process ids of the workers running now, idle or busy (for tests and diagnostics)."""
        with self._lock:
            return [w.proc.pid for w in self._live if w.proc.poll() is None]

    def close(self) -> None:
        """Stop the idle workers (busy ones stop when their check returns them)."""
        while True:
            try:
                worker = self._workers.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                self._stop(worker)

    def _stop(self, worker: _Worker) -> None:
        worker.stop()
        with self._lock:
            self._live.discard(worker)

    def _compile(self, kind: str, text: str) -> str:
        check_shape(kind, text, self.limits)
        budget = self.limits.compile_timeout_s
        worker = self._workers.get()
        try:
            if worker is None or worker.proc.poll() is not None:
                worker = _Worker()
                with self._lock:
                    self._live.add(worker)
            reply = worker.run(kind, text, budget)
        except _WorkerDied:
            logger.warning("a grammar worker died compiling a %s constraint; replacing it", kind)
            self._stop(worker)
            worker = None
            raise InvalidParamError(kind, f"the {kind} is too complex: the grammar compiler failed on it") from None
        except TimeoutError:
            logger.warning("a %s constraint compiled for over %g s; abandoned", kind, budget)
            self._stop(worker)
            worker = None
            raise InvalidParamError(kind, f"the {kind} is too complex: it did not compile within {budget:g} s") from None
        finally:
            self._workers.put(worker)
        if reply[0] == "ok":
            return reply[1]
        raise InvalidParamError(reply[1], reply[2])

    def _remember(self, key: tuple[str, str], result: str | InvalidParamError) -> None:
        size = len(key[1]) + (len(result) if isinstance(result, str) else 0)
        if size > CACHE_BYTES // 4:
            return
        with self._lock:
            self._cache.put(key, result, size)


_default: GrammarChecker | None = None
_default_lock = threading.Lock()


def configure(limits: GrammarLimits, workers: int = DEFAULT_WORKERS) -> None:
    """Set this process's checker (the server calls this with its ``--max-grammar-*`` flags)."""
    global _default
    with _default_lock:
        if _default is not None:
            _default.close()
        _default = GrammarChecker(limits, workers)


def default_checker() -> GrammarChecker:
    """This process's checker: the last ``configure``d one, else one with default limits."""
    global _default
    with _default_lock:
        if _default is None:
            _default = GrammarChecker()
        return _default
