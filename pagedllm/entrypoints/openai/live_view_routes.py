"""HTTP routes of the live view: the page, its Server-Sent Events stream, and the trace download.

The page is one HTML document with its CSS and JavaScript inlined from package data, so a
browser needs no other request than the event stream (and no network beyond this server).
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.live_view.frames import ViewerFrames
from pagedllm.live_view.trace import trace_events
from pagedllm.live_view.view import LiveView

FRAME_INTERVAL_S = 0.4  # the page redraws on every frame: at most 2.5 times a second per viewer
HEARTBEAT_S = 1.0  # a frame at least this often while nothing changes (the waterfall's clock)
_OFF_MESSAGE = "the live view is off: start the server with --enable-live-view"


def dashboard_html() -> str:
    """The page, with ``dashboard.css`` and ``dashboard.js`` inlined (FileNotFoundError if not installed)."""
    static = resources.files("pagedllm.live_view") / "static"
    html = (static / "dashboard.html").read_text()
    css = (static / "dashboard.css").read_text()
    js = (static / "dashboard.js").read_text()
    return html.replace("/*DASHBOARD_CSS*/", css).replace("/*DASHBOARD_JS*/", js)


def live_view_router(
    view: LiveView | None, frame_interval_s: float = FRAME_INTERVAL_S, heartbeat_s: float = HEARTBEAT_S
) -> APIRouter:
    """``GET /dashboard``, ``GET /dashboard/events`` and ``GET /debug/trace``; 404 on each when ``view`` is None.

    Each event-stream viewer gets ``ViewerFrames``: a snapshot, then deltas, at most one frame
    per ``frame_interval_s``, and one at least every ``heartbeat_s``.
    """
    router = APIRouter()
    encoder = msgspec.json.Encoder()

    def off() -> JSONResponse:
        return JSONResponse(OpenAIError(404, _OFF_MESSAGE, "NotFoundError").body(), 404)

    @router.get("/dashboard", response_model=None)
    async def dashboard() -> Response:
        return off() if view is None else HTMLResponse(dashboard_html())

    @router.get("/dashboard/events", response_model=None)
    async def events(request: Request) -> Response:
        if view is None:
            return off()

        async def stream():
            frames = ViewerFrames(view, frame_interval_s, heartbeat_s)
            while not await request.is_disconnected():
                frame = frames.poll(time.monotonic())
                if frame is not None:
                    yield b"data: " + encoder.encode(frame) + b"\n\n"
                await asyncio.sleep(frames.wait_s(time.monotonic()))

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @router.get("/debug/trace", response_model=None)
    async def trace() -> Response:
        if view is None:
            return off()
        headers = {"Content-Disposition": 'attachment; filename="pagedllm-trace.json"'}
        return Response(encoder.encode(trace_events(view)), media_type="application/json", headers=headers)

    return router
