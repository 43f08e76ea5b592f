"""What a live view's viewer gets: the page and its routes, frames (a snapshot, then deltas), the event stream."""

import json

from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.live_view.view import LiveView
from pagedllm.sampling_params import SamplingParams
from tests.live_view_util import LIVE_VIEW_BS as BS
from tests.live_view_util import LIVE_VIEW_EOS as EOS
from tests.live_view_util import fed_steps, feed_view


def live_view_app(view, api_key=None, **router_kwargs):
    from fastapi import FastAPI

    from pagedllm.entrypoints.openai.live_view_routes import live_view_router
    from pagedllm.entrypoints.openai.middleware import BearerAuthMiddleware

    app = FastAPI()
    app.include_router(live_view_router(view, **router_kwargs))
    if api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=api_key)
    return app


def test_page_is_self_contained_and_trace_is_served():
    from fastapi.testclient import TestClient

    client = TestClient(live_view_app(feed_view()))
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/*DASHBOARD_JS*/" not in page.text and "EventSource" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # no CDN, no external asset
    assert client.get("/debug/trace").json()["traceEvents"]


def test_routes_answer_404_when_the_live_view_is_off():
    from fastapi.testclient import TestClient

    client = TestClient(live_view_app(None))
    for path in ("/dashboard", "/dashboard/events", "/debug/trace"):
        response = client.get(path)
        assert response.status_code == 404 and "--enable-live-view" in response.text
        assert response.json()["error"] | {"message": ""} == {
            "message": "", "type": "NotFoundError", "param": None, "code": 404
        }


def test_api_key_as_query_parameter_only_on_the_page_routes():
    from fastapi.testclient import TestClient

    client = TestClient(live_view_app(feed_view(), api_key="k"))
    assert client.get("/dashboard").status_code == 401
    assert client.get("/dashboard?api_key=wrong").status_code == 401
    assert client.get("/dashboard?api_key=k").status_code == 200
    assert client.get("/dashboard", headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.get("/debug/trace?api_key=k").status_code == 401  # a download: the header, as elsewhere
    assert client.get("/debug/trace", headers={"Authorization": "Bearer k"}).status_code == 200


# -- viewers' frames: a snapshot, then deltas ------------------------------------------------
def _wire(frame):
    """A frame as a viewer receives it (msgspec on the server, JSON in the page)."""
    import msgspec

    return json.loads(msgspec.json.encode(frame))


def apply_frame(state, frame):
    """What dashboard.js does with a frame: a snapshot replaces the state, a delta updates it."""
    if frame["kind"] == "full":
        return frame
    state = json.loads(json.dumps(state))
    state |= {k: frame[k] for k in ("version", "now", "headline")}
    state["steps"] = (state["steps"] + frame["steps"])[-state["num_steps"]:]
    rows = {r["id"]: r for r in state["requests"]} | {r["id"]: r for r in frame["requests"]}
    state["requests"] = [rows[i] for i in frame.get("order", [r["id"] for r in state["requests"]])]
    blocks = state["blocks"]
    for b, ref, cached, group, holder, index, shared in frame["blocks"]:
        blocks["ref"][b], blocks["cached"][b], blocks["group"][b], blocks["index"][b] = ref, cached, group, index
        if holder is not None and holder not in blocks["owners"]:
            blocks["owners"].append(holder)
        blocks["owner"][b] = -1 if holder is None else blocks["owners"].index(holder)
        if shared:
            blocks["shared"][str(b)] = shared
        else:
            blocks["shared"].pop(str(b), None)
    return state


def drawn(state):
    """What the page draws from a state: everything but the clock, block owners by request id."""
    blocks = state["blocks"]
    cells = [
        (blocks["ref"][b], blocks["cached"][b], blocks["group"][b],
         blocks["owners"][blocks["owner"][b]] if blocks["owner"][b] >= 0 else None, blocks["index"][b],
         blocks["shared"].get(str(b)))
        for b in range(len(blocks["ref"]))
    ]
    rates = ("tokens_in_per_s", "tokens_out_per_s")  # of a window ending at the frame's clock
    headline = {k: v for k, v in state["headline"].items() if k not in rates}
    return {"version": state["version"], "headline": headline, "steps": state["steps"],
            "requests": state["requests"], "blocks": cells}


def test_viewer_gets_a_snapshot_then_deltas_that_rebuild_it():
    from pagedllm.live_view.frames import ViewerFrames

    # A pool larger than the scheduler's 20 blocks: the snapshot carries every block, a delta the changed ones.
    view = LiveView(2000, BS, [0], 24)
    frames = ViewerFrames(view, min_interval_s=1.0, heartbeat_s=5.0, num_steps=30, num_requests=6)
    now, state, sizes = 0.0, None, []
    for _ in fed_steps(view):
        now += 1.0  # one frame allowed per step
        frame = _wire(frames.poll(now))
        sizes.append((frame["kind"], len(json.dumps(frame))))
        state = apply_frame(state, frame)
        assert drawn(state) == drawn(_wire({"kind": "full", "num_steps": 30} | view.snapshot(30, 6)))
    assert sizes[0][0] == "full" and {kind for kind, _ in sizes[1:]} == {"delta"}
    assert len(sizes) > 30
    assert max(size for _, size in sizes[1:]) < sizes[0][1] / 5
    assert state["steps"] and len(state["steps"]) <= 30 and state["headline"]["preemptions"] > 0


def test_frames_are_rate_limited_coalesced_and_a_heartbeat_when_idle():
    from pagedllm.live_view.frames import ViewerFrames

    view = LiveView(20, BS, [0], 24)
    frames = ViewerFrames(view, min_interval_s=0.005, heartbeat_s=0.5)
    now, state, num_steps, sent = 0.0, None, 0, []
    for _ in fed_steps(view):
        num_steps += 1
        now += 0.001  # five steps per allowed frame
        frame = frames.poll(now)
        if frame is not None:
            sent.append(now)
            state = apply_frame(state, _wire(frame))
    assert num_steps > 30
    assert 2 <= len(sent) <= num_steps // 5 + 1
    assert all(b - a >= 0.005 - 1e-9 for a, b in zip(sent, sent[1:]))
    assert frames.poll(sent[-1] + 0.004) is None  # too soon
    # One more change (the last steps' may already be sent: the frames follow the step count).
    view.on_arrival([EngineCoreRequest("late", [11, 12, 13], SamplingParams(), [EOS], now)])
    now = sent[-1] + 0.005
    state = apply_frame(state, _wire(frames.poll(now)))  # the changes since, in one delta
    assert drawn(state) == drawn(_wire({"kind": "full", "num_steps": 300} | view.snapshot()))
    assert frames.poll(now + 0.1) is None  # nothing changed: no frame until the heartbeat
    heartbeat = frames.poll(now + 0.5)
    assert heartbeat["kind"] == "delta" and not (heartbeat["steps"] or heartbeat["requests"] or heartbeat["blocks"])


def test_a_viewer_behind_the_change_log_gets_a_new_snapshot():
    from collections import deque

    from pagedllm.live_view.frames import ViewerFrames

    view = LiveView(20, BS, [0], 24)
    view._changes = deque(maxlen=4)
    frames = ViewerFrames(view, min_interval_s=0.0, heartbeat_s=1.0)
    steps = fed_steps(view)
    next(steps)
    assert frames.poll(0.0)["kind"] == "full"
    next(steps)
    assert frames.poll(1.0)["kind"] == "delta"
    for _ in range(5):
        next(steps)
    assert frames.poll(2.0)["kind"] == "full"


def _sse_frames(response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line[6:])


def test_event_stream_over_a_socket_while_a_stalled_viewer_reads_nothing():
    """Real sockets: a viewer gets a snapshot then deltas that rebuild what a new viewer's snapshot
    shows; the steps are fed on the server's loop while another viewer never reads its stream."""
    import asyncio
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    from pagedllm.distributed.parallel_state import free_port

    view = LiveView(2000, BS, [0], 24)
    app = live_view_app(view, frame_interval_s=0.05, heartbeat_s=0.2)

    @app.post("/feed")
    async def feed() -> dict:
        for _ in fed_steps(view):
            await asyncio.sleep(0.01)
        return {"version": view.version}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        while not server.started:
            assert thread.is_alive()
            threading.Event().wait(0.05)
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", port))
        stalled.sendall(b"GET /dashboard/events HTTP/1.1\r\nHost: test\r\n\r\n")
        final: dict = {}
        feeder = threading.Thread(target=lambda: final.update(httpx.post(f"{url}/feed", timeout=120).json()))
        kinds, state, deadline = [], None, time.monotonic() + 120
        with httpx.Client(base_url=url, timeout=120) as client:
            with client.stream("GET", "/dashboard/events") as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                for frame in _sse_frames(r):
                    if not kinds:
                        feeder.start()
                    kinds.append(frame["kind"])
                    state = apply_frame(state, frame)
                    if final and state["version"] == final["version"]:
                        break
                    assert time.monotonic() < deadline, "the stream never reached the view's last version"
            feeder.join()
            with client.stream("GET", "/dashboard/events") as r:
                fresh = next(_sse_frames(r))
        assert kinds[0] == "full" and set(kinds[1:]) == {"delta"}
        assert fresh["kind"] == "full" and drawn(state) == drawn(fresh)
        assert state["headline"]["steps"] > 30
        stalled.close()
    finally:
        server.should_exit = True
        thread.join(30)

