"""Connection timeouts beyond uvicorn's own: uvicorn's HTTP protocol, with a deadline for each request head.

uvicorn closes a keep-alive connection that stays silent ``timeout_keep_alive`` seconds after
a response, but it arms that timer only after a response and cancels it at the first byte
received: a connection that never sends a request, or sends part of a request head (a byte at a
time or not at all), is never closed, and each holds a socket and a place under
``limit_concurrency``. ``http_protocol`` adds the two missing rules.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol


class _RequestHeadDeadline:
    """Mixin over a uvicorn HTTP protocol (h11 or httptools: both keep ``cycle``, ``loop`` and the
    keep-alive timer under the same names).

    Whenever the connection waits for a request (on connecting, and after each response):
    - a connection that sends nothing for ``timeout_keep_alive`` seconds is closed (uvicorn's
      keep-alive timer, which uvicorn itself arms only after a response);
    - a connection whose next request head is not complete ``timeout_request_head`` seconds
      after the wait began is closed, however the bytes trickle in. The body is not covered:
      once the head is in, the request is the app's.
    """

    timeout_request_head: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None
    _waiting_after: Any = None  # the request cycle the wait began after (None: no request yet)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._await_request()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        # uvicorn starts a new request cycle the moment a head is complete.
        if self._head_timer is not None and self.cycle is not self._waiting_after:  # type: ignore[attr-defined]
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        cycle = self.cycle  # type: ignore[attr-defined]
        # Not when a pipelined request already started (its cycle is not complete).
        if not self.transport.is_closing() and cycle.response_complete:  # type: ignore[attr-defined]
            self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def _await_request(self) -> None:
        self._cancel_head_timer()
        self._waiting_after = self.cycle  # type: ignore[attr-defined]
        loop = self.loop  # type: ignore[attr-defined]
        self._head_timer = loop.call_later(self.timeout_request_head, self._on_head_timeout)
        if self.timeout_keep_alive_task is None:  # type: ignore[attr-defined]  # a new connection
            self.timeout_keep_alive_task = loop.call_later(  # type: ignore[attr-defined]
                self.timeout_keep_alive, self.timeout_keep_alive_handler  # type: ignore[attr-defined]
            )

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():  # type: ignore[attr-defined]
            self.transport.close()  # type: ignore[attr-defined]


def http_protocol(timeout_request_head: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol of choice (httptools where installed, else h11) with the deadlines
    of ``_RequestHeadDeadline``; pass it as ``uvicorn.Config(http=...)``."""
    return type(
        "HeadDeadlineHTTPProtocol", (_RequestHeadDeadline, AutoHTTPProtocol), {"timeout_request_head": timeout_request_head}
    )
