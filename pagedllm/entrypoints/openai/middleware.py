"""The server's ASGI middleware and browser policy: the API key, the request body's size
limit, and which other origins' pages may call the server (CORS).

Pure ASGI, not Starlette's ``BaseHTTPMiddleware``: wrapping ``receive`` must not hide client
disconnects.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from urllib.parse import parse_qs

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import OpenAIError, error_response, http_error

# Routes anyone may call with --api-key set: probes and monitoring, which change nothing.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
# Routes a browser opens itself (a page, its EventSource), which cannot send a header: the
# key may come as the ``api_key`` query parameter instead.
QUERY_KEY_PATHS = frozenset({"/dashboard", "/dashboard/events"})


class BearerAuthMiddleware:
    """401 for a request whose ``Authorization: Bearer`` token is missing or wrong, on every
    route but ``OPEN_PATHS`` (so a new route, admin ones such as /reset_prefix_cache included,
    is protected by default); on ``QUERY_KEY_PATHS`` an ``api_key`` query parameter will do."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            ok = secrets.compare_digest(given, self.expected)
            if not ok and scope["path"] in QUERY_KEY_PATHS:
                query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
                ok = secrets.compare_digest(query.get("api_key", [""])[0].encode("latin-1"), self.api_key)
            if not ok:
                response = error_response(http_error(401, "missing or invalid API key (Authorization: Bearer ...)"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for a request body larger than ``max_bytes`` (by Content-Length, or as it streams in)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(self._too_large())(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self._too_large().message)  # FastAPI answers it while reading the body
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> OpenAIError:
        return http_error(413, f"request body exceeds the limit of {self.max_bytes} bytes")


@dataclass(frozen=True)
class CorsPolicy:
    """Which pages of other origins a browser lets call the server (CORS), vLLM's
    ``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers`` and
    ``--allow-credentials``. No origins (the default): no CORS headers, so a browser keeps
    every other site's pages off the server (vLLM allows every origin by default)."""

    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False
