"""Rank 0's messages to the other tensor-parallel ranks: one TCP connection per rank.

Not a collective: the other ranks wait for the next step however long the engine idles, while
every collective's wait is bounded (``init_tensor_parallel``'s ``collective_timeout_s``), which
is what turns a hung rank into an error. A rank waits here without a time limit; when rank 0
goes away its connection closes and the rank leaves. Rank 0 watches the connections from a
monitor thread: a rank that exits closes its end, which marks it dead at once, whether it runs
as a local process or a Ray actor on another node. A rank never sends anything after its
ready message, so anything readable on rank 0's side is that close.

Framing: an 8-byte little-endian length, then the payload.
"""

from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("pagedllm")

_LENGTH = struct.Struct("<Q")
_RANK = struct.Struct("<I")


class RankGoneError(RuntimeError):
    """A rank other than rank 0 closed its connection (it exited, or its host went away)."""


class StepSender:
    """Rank 0's end: listens on ``host`` (a free port), then holds one connection per other rank.

    Args:
        host: the address the other ranks reach this process at.
        num_peers: ranks other than rank 0.
    """

    def __init__(self, host: str, num_peers: int) -> None:
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self.num_peers = num_peers
        self._peers: dict[int, socket.socket] = {}
        self.dead_ranks: list[int] = []  # ranks whose connection closed, in the order seen
        self._dead = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._monitor: threading.Thread | None = None

    def accept(self, timeout_s: float, alive: Callable[[], bool]) -> None:
        """Wait until every other rank has connected and said it is ready (model loaded), then
        start watching the connections.

        Args:
            timeout_s: how long the ranks may take.
            alive: whether the ranks' processes still run (checked every second).

        Raises:
            RankGoneError: if a rank exited first.
            TimeoutError: if they are not all ready within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        self._listener.settimeout(1.0)
        while len(self._peers) < self.num_peers:
            if not alive():
                raise RankGoneError("a tensor-parallel rank exited before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.num_peers - len(self._peers)} tensor-parallel rank(s) not ready within {timeout_s:.0f} s"
                )
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(timeout_s)
            (rank,) = _RANK.unpack(_recv_exactly(conn, _RANK.size))
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._peers[rank] = conn
        self._listener.close()
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()

    def send(self, payload: bytes) -> None:
        """``payload`` to every other rank.

        Raises:
            RankGoneError: if a rank's connection is closed.
        """
        frame = _LENGTH.pack(len(payload)) + payload
        for rank, conn in self._peers.items():
            try:
                conn.sendall(frame)
            except OSError as e:
                raise RankGoneError(f"tensor-parallel rank {rank} is gone: {e}") from e

    def wait_dead(self, timeout_s: float) -> bool:
        """Whether some rank's connection closed, waiting up to ``timeout_s`` for it to show."""
        return self._dead.wait(timeout_s)

    def close(self) -> None:
        """Close every connection (the ranks still reading then leave); once only."""
        self._wake_w.send(b"x")
        if self._monitor is not None:
            self._monitor.join()
        for sock in [*self._peers.values(), self._listener, self._wake_r, self._wake_w]:
            sock.close()

    def _watch(self) -> None:
        """The monitor thread: mark the ranks whose connection closes, until ``close``."""
        with selectors.DefaultSelector() as sel:
            sel.register(self._wake_r, selectors.EVENT_READ)
            for rank, conn in self._peers.items():
                sel.register(conn, selectors.EVENT_READ, rank)
            while True:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        return
                    sel.unregister(key.fileobj)
                    logger.error("tensor-parallel rank %d is gone (its connection to rank 0 closed)", key.data)
                    self.dead_ranks.append(key.data)
                    self._dead.set()


class StepReceiver:
    """A rank's end: connects to rank 0's ``StepSender`` at ``address`` ("host:port").

    Args:
        rank: this rank, sent once :meth:`ready` is called.
    """

    def __init__(self, address: str, rank: int) -> None:
        host, _, port = address.rpartition(":")
        self._conn = socket.create_connection((host, int(port)))
        self.rank = rank

    def ready(self) -> None:
        """Tell rank 0 this rank is ready for steps."""
        self._conn.sendall(_RANK.pack(self.rank))

    def recv(self) -> bytes | None:
        """The next message; None when rank 0 closed the connection."""
        try:
            header = _recv_exactly(self._conn, _LENGTH.size)
            return _recv_exactly(self._conn, _LENGTH.unpack(header)[0])
        except (EOFError, ConnectionError):
            return None

    def close(self) -> None:
        self._conn.close()


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``conn``.

    Raises:
        EOFError: if the connection closes first.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise EOFError("connection closed")
        got += k
    return bytes(buf)
