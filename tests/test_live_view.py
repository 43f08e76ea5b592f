"""The live view's records and trace: block accounting by replay, Trace Event format, the ring buffer."""

import json
import random

import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_config import create_kv_cache_config
from pagedllm.core.kv_cache_groups import KVCacheGroup
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagedllm.live_view.block_map import BlockMap
from pagedllm.live_view.recorder import StepRecorder
from pagedllm.live_view.records import StepRecord
from pagedllm.live_view.trace import trace_events
from pagedllm.live_view.view import LiveView
from pagedllm.models.loader import load_config, resolve_model
from pagedllm.sampling_params import SamplingParams

EOS = 2
BS = 4
GLOBAL = (KVCacheGroup((0,), 0),)
HYBRID = (KVCacheGroup((0,), 0), KVCacheGroup((1,), 8))  # one global group, one sliding window of 8


def make_engine(groups, num_blocks=20, budget=24):
    kv = KVCacheManager(num_blocks, BS, True, groups)
    recorder = StepRecorder(kv)
    return Scheduler(kv, 6, budget, 256), recorder


def make_request(rid, rng, prefixes):
    prompt = rng.choice(prefixes) + [rng.randint(10, 90) for _ in range(rng.randint(1, 14))]
    params = SamplingParams(max_tokens=rng.randint(2, 12), ignore_eos=True)
    return Request(rid, prompt, params, [EOS], 256)


def fake_step(sched, recorder, rng) -> StepRecord:
    """What EngineCore.step does, with a fake model that accepts a random run of each request's drafts."""
    for r in sched.running:  # a proposer's drafts for some decoding requests
        if r.num_output_tokens and rng.random() < 0.4:
            r.spec_token_ids = [rng.randint(10, 90) for _ in range(rng.randint(1, 3))]
    recorder.begin(sched)
    out = sched.schedule()
    entries = recorder.entries(out)
    sampled = []
    for s in out.scheduled:
        accepted = s.spec_token_ids[: rng.randint(0, len(s.spec_token_ids))]
        sampled.append(accepted + [7] if s.samples else [])
    sched.update_from_output(out, sampled)
    return recorder.finish(sched, sched.kv_cache.usage, entries, out, sampled)


def assert_replay_matches(block_map: BlockMap, kv: KVCacheManager) -> None:
    pool = kv.pool
    assert block_map.ref == [b.ref_cnt for b in pool.blocks]
    assert block_map.cached == [b.block_hash is not None for b in pool.blocks]
    expected: dict[int, dict[str, int]] = {}
    for rid, tables in kv.req_blocks.items():
        for g, blocks in enumerate(tables):
            for i, b in enumerate(blocks):
                if b is not None:
                    expected.setdefault(b.block_id, {})[rid] = i
                    assert block_map.group[b.block_id] == g
    assert {b: h for b, h in enumerate(block_map.holders) if h} == expected


def scripted_run(groups, seed):
    """A run with shared prefixes, preemptions, drafts, aborts and a prefix-cache reset; yields each record."""
    rng = random.Random(seed)
    sched, recorder = make_engine(groups)
    prefixes = [[rng.randint(10, 90) for _ in range(8)] for _ in range(3)]
    for i in range(24):
        sched.add_request(make_request(f"r{i}", rng, prefixes))
        yield fake_step(sched, recorder, rng), sched
        if i % 7 == 6 and sched.running:  # an abort between steps
            sched.finish_requests([sched.running[0].request_id], RequestStatus.FINISHED_ABORTED)
    while sched.num_unfinished:
        yield fake_step(sched, recorder, rng), sched
    assert sched.kv_cache.reset_prefix_cache()
    yield recorder.finish(sched, sched.kv_cache.usage), sched  # the idle record after the reset


@pytest.mark.parametrize("groups", [GLOBAL, HYBRID], ids=["global", "sliding-window"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replaying_block_ops_reproduces_the_pool_after_every_step(groups, seed):
    block_map = BlockMap(20)
    kinds = set()
    preempted = 0
    for record, sched in scripted_run(groups, seed):
        block_map.apply(record.ops)
        assert_replay_matches(block_map, sched.kv_cache)
        kinds |= {op.kind for op in record.ops}
        preempted += len(record.preempted)
    assert kinds == {0, 1, 2, 3, 4}  # new, hit, free, cached and reset all happened
    assert preempted > 0
    assert all(r == 0 for r in block_map.ref)


def test_step_entries_count_every_scheduled_token():
    hits = 0
    for record, _ in scripted_run(GLOBAL, 3):
        for e in record.scheduled:
            assert e.prefill >= 0 and e.decode in (0, 1) and 0 <= e.accepted <= e.draft
            hits += max(e.cached, 0)
        assert record.start <= record.end
        assert record.num_running >= 0 and 0.0 <= record.kv_usage <= 1.0
    assert hits > 0  # shared prefixes were hit at admission


def feed_view(max_steps=4096):
    """A LiveView fed as the front end feeds it: arrivals, then every record with its outputs."""
    view = LiveView(20, BS, [0], 24, max_steps=max_steps)
    for _ in fed_steps(view, stops=False):
        pass
    return view


def test_ring_buffer_is_bounded_and_keeps_the_latest_steps():
    view = feed_view(max_steps=10)
    assert len(view.steps) == 10
    indices = [r.index for r in view.steps]
    assert indices == sorted(indices)
    snapshot = json.loads(json.dumps(view.snapshot()))
    assert len(snapshot["steps"]) == 10
    assert snapshot["headline"]["preemptions"] > 0
    assert len(snapshot["blocks"]["ref"]) == 20


def test_trace_has_trace_event_keys_monotonic_tracks_and_one_track_per_request():
    view = feed_view()
    trace = json.loads(json.dumps(trace_events(view)))
    events = trace["traceEvents"]
    assert events
    last_ts: dict[tuple[int, int], float] = {}
    for e in events:
        assert {"name", "ph", "ts", "pid", "tid"} <= e.keys()
        assert e["ph"] in ("X", "i", "C", "M")
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] == "M":
            continue
        track = (e["pid"], e["tid"])
        assert e["ts"] >= last_ts.get(track, 0.0)
        last_ts[track] = e["ts"]
    names = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 2]
    assert sorted(names) == sorted(view.requests)
    assert len(set(names)) == len(names)
    tids = {e["tid"] for e in events if e["pid"] == 2 and e["ph"] != "M"}
    assert tids == set(range(1, len(view.requests) + 1))
    steps = [e for e in events if e["pid"] == 1 and e["ph"] == "X"]
    assert len(steps) == len(view.steps)


def test_llm_trace_file_has_a_track_per_request(tmp_path):
    from pagedllm import LLM, SamplingParams

    path = tmp_path / "trace.json"
    llm = LLM(trace=str(path), kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=64)
    prompts = ["The paged KV cache", "Continuous batching means", "A prefix cache hit"]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    events = json.loads(path.read_text())["traceEvents"]
    tracks = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 2]
    assert sorted(tracks) == ["0-0", "1-0", "2-0"]
    steps = [e for e in events if e["pid"] == 1 and e["ph"] == "X"]
    assert sum(e["args"]["prefill"] for e in steps) == sum(len(llm.get_tokenizer().encode(p)) for p in prompts)
    assert llm.engine.live_view.blocks.ref == [0] * llm.engine.core.num_blocks  # every block back in the pool


def live_view_app(view, api_key=None, **router_kwargs):
    from fastapi import FastAPI

    from pagedllm.entrypoints.openai.middleware import BearerAuthMiddleware
    from pagedllm.entrypoints.openai.live_view_routes import live_view_router

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


def fed_steps(view, stops=True):
    """Feed ``view`` as the front end does, yielding after each change; ``stops``: now and then a
    stop string found by the front end finishes a request."""
    seen = set()
    for record, sched in scripted_run(GLOBAL, 4):
        for rid, r in sched.requests.items():
            if rid not in seen:
                seen.add(rid)
                view.on_arrival([EngineCoreRequest(rid, r.prompt_token_ids, r.sampling_params, [EOS], r.arrival_time)])
        outputs = [EngineCoreOutput(e.request_id, [7] if e.decode or e.prefill else []) for e in record.scheduled]
        view.on_outputs(EngineCoreOutputs(outputs, timestamp=record.end, step=record))
        for e in record.scheduled[:1] if stops else ():
            if record.index % 9 == 8:
                view.on_finish([e.request_id], "stop", record.end)
        yield


def test_rates_cover_a_recent_window_and_fall_to_zero_when_idle():
    view = LiveView(20, BS, [0], 24)
    for _ in fed_steps(view, stops=False):
        pass
    last = view.steps[-1].end
    busy = view.headline(last)
    assert busy["tokens_out_per_s"] > 0 and busy["tokens_in_per_s"] > 0
    later = view.headline(last + 2.0)  # the same tokens over a longer span
    assert 0 < later["tokens_out_per_s"] < busy["tokens_out_per_s"]
    idle = view.headline(last + 60.0)
    assert idle["tokens_out_per_s"] == idle["tokens_in_per_s"] == 0.0
    assert idle["steps"] == busy["steps"] == len(view.steps)


def test_headline_after_aborts_with_the_engine_idle():
    """Aborts with no step after them: the core's idle record sets the headline's queues and KV
    usage (as /metrics), not the last step's; the steps shown stay as they were."""
    rng = random.Random(5)
    sched, recorder = make_engine(GLOBAL)
    view = LiveView(20, BS, [0], 24)
    for i in range(4):
        request = make_request(f"r{i}", rng, [[11, 12, 13, 14]])
        sched.add_request(request)
        view.on_arrival([EngineCoreRequest(request.request_id, request.prompt_token_ids, request.sampling_params,
                                           [EOS], request.arrival_time)])
    for _ in range(2):
        record = fake_step(sched, recorder, rng)
        view.on_outputs(EngineCoreOutputs([], timestamp=record.end, step=record))
    busy = view.headline(record.end)
    assert busy["running"] > 0 and busy["kv_usage"] > 0
    sched.finish_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
    idle = recorder.finish(sched, sched.kv_cache.usage)
    view.on_outputs(EngineCoreOutputs(timestamp=idle.end, step=idle))
    headline = view.headline(idle.end)
    assert (headline["running"], headline["waiting"], headline["kv_usage"]) == (0, 0, 0.0)
    assert headline["steps"] == busy["steps"] and len(view.steps) == 2
    assert all(r == 0 for r in view.blocks.ref)


def test_a_row_ends_when_the_front_end_ends_its_request():
    """The core's step in flight when the front end ended a request (a stop string, a client
    gone) comes after the finish: its tokens and time are no longer the row's, whose output
    counts what the request got and whose bars end at its finish tick."""
    rng = random.Random(3)
    sched, recorder = make_engine(GLOBAL)
    request = make_request("r0", rng, [[11, 12, 13, 14]])
    sched.add_request(request)
    view = LiveView(20, BS, [0], 24)
    view.on_arrival([EngineCoreRequest("r0", request.prompt_token_ids, request.sampling_params, [EOS],
                                       request.arrival_time)])
    first = fake_step(sched, recorder, rng)
    view.on_outputs(EngineCoreOutputs([EngineCoreOutput("r0", [7])], timestamp=first.end, step=first))
    view.on_finish(["r0"], "abort", first.end)
    late = fake_step(sched, recorder, rng)  # the abort had not reached the core yet
    view.on_outputs(EngineCoreOutputs([EngineCoreOutput("r0", [7])], timestamp=late.end, step=late))
    (row,) = [t.to_json() for t in view.shown_requests(10)]
    assert row["output"] == 1 and row["last_token"] == row["finished"] == first.end
    assert all(end <= row["finished"] for _, end, _ in row["segments"])
    assert len(view.steps) == 2  # the step itself is shown


def test_shown_requests_put_unfinished_first_then_the_latest_finished():
    view = LiveView(20, BS, [0], 24)
    for rid, t in [("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 4.0), ("e", 5.0)]:
        view.on_arrival([EngineCoreRequest(rid, [5, 6], SamplingParams(), [EOS], t)])
    view.on_finish(["c"], "stop", 10.0)
    view.on_finish(["a"], "stop", 11.0)
    view.on_finish(["b"], "length", 9.0)
    assert [t.request_id for t in view.shown_requests(40)] == ["d", "e", "a", "c", "b"]
    assert [t.request_id for t in view.shown_requests(3)] == ["d", "e", "a"]
    assert [t.request_id for t in view.shown_requests(1)] == ["d"]


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

    from tests.utils import free_port

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


def test_the_block_map_names_the_cache_dtype():
    """An engine's view states its K/V dtype beside the pool's size (the 8-bit caches hold
    about twice bfloat16's blocks in the same memory)."""
    config = EngineConfig(kv_cache_dtype=torch.int8, kv_cache_memory=2**26)
    kv = create_kv_cache_config(config, load_config(resolve_model(config.model)))
    shown = LiveView.for_engine(config, kv).config_json()
    assert shown["cache_dtype"] == "int8" and shown["num_blocks"] == kv.num_blocks
