"""Chrome Trace Event JSON of the live view: opens in Perfetto (ui.perfetto.dev) and chrome://tracing.

Process 1 is the engine: thread 1 holds one complete ("X") event per step, and a counter
track follows KV usage and the queues. Process 2 holds one thread per request: waiting,
prefill chunks and decode runs as complete events, first token and finish as instants.
Timestamps are microseconds since the earliest time in the trace.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.live_view.view import LiveView

ENGINE_PID, REQUESTS_PID, STEPS_TID = 1, 2, 1


def trace_events(view: LiveView) -> dict[str, Any]:
    """The trace as a dict: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``."""
    steps = list(view.steps)
    requests = list(view.requests.values())
    times = [r.start for r in steps] + [t.arrival for t in requests]
    origin = min(times) if times else 0.0

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    events: list[dict[str, Any]] = [
        _meta("process_name", ENGINE_PID, 0, "engine"),
        _meta("thread_name", ENGINE_PID, STEPS_TID, "steps"),
        _meta("process_name", REQUESTS_PID, 0, "requests"),
    ]
    for r in steps:
        args = {
            "prefill": sum(e.prefill for e in r.scheduled), "decode": sum(e.decode for e in r.scheduled),
            "draft": sum(e.draft for e in r.scheduled), "accepted": sum(e.accepted for e in r.scheduled),
            "requests": len(r.scheduled), "preempted": r.preempted,
        }
        events.append(_complete(f"step {r.index}", ENGINE_PID, STEPS_TID, us(r.start), us(r.end), args))
        events.append({
            "name": "scheduler", "ph": "C", "ts": us(r.end), "pid": ENGINE_PID, "tid": STEPS_TID,
            "args": {"running": r.num_running, "waiting": r.num_waiting, "kv_usage_pct": round(100 * r.kv_usage, 2)},
        })
    for tid, t in enumerate(requests, start=1):
        events.append(_meta("thread_name", REQUESTS_PID, tid, t.request_id))
        track: list[dict[str, Any]] = []
        if t.first_scheduled is not None:
            track.append(_complete("waiting", REQUESTS_PID, tid, us(t.arrival), us(t.first_scheduled),
                                   {"prompt_tokens": t.num_prompt_tokens, "cached_tokens": t.cached_tokens}))
        for start, end, kind, _ in t.segments:
            track.append(_complete(kind, REQUESTS_PID, tid, us(start), us(end), {}))
        for when in t.preemptions:
            track.append(_instant("preempted", tid, us(when), {}))
        if t.first_token is not None:
            track.append(_instant("first token", tid, us(t.first_token), {"ttft_ms": round(1e3 * t.ttft, 3)}))
        if t.finished is not None:
            track.append(_instant("finished", tid, us(t.finished),
                                  {"reason": t.finish_reason, "output_tokens": t.num_output_tokens}))
        track.sort(key=lambda e: e["ts"])  # one track, one time order
        events += track
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(view: LiveView, path: str) -> None:
    """Write ``trace_events(view)`` to ``path`` (OSError if it cannot be written)."""
    with open(path, "w") as f:
        json.dump(trace_events(view), f)


def _meta(name: str, pid: int, tid: int, value: str) -> dict[str, Any]:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": value}}


def _complete(name: str, pid: int, tid: int, start: float, end: float, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "X", "ts": start, "dur": max(end - start, 0.0), "pid": pid, "tid": tid, "args": args}


def _instant(name: str, tid: int, ts: float, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "i", "s": "t", "ts": ts, "pid": REQUESTS_PID, "tid": tid, "args": args}
