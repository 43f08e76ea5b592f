"""One viewer's frames: a full snapshot first, then deltas, at most one per ``min_interval_s``.

A viewer pulls: the engine's output loop only updates the ``LiveView`` and never waits for
a viewer, and a viewer that falls behind gets one frame with everything that changed since
its last one (or a new snapshot, when the view's change log no longer reaches back), never a
queue of stale frames.

A delta frame (``"kind": "delta"``) holds
- ``version``, ``now`` and ``headline``, as a snapshot's;
- ``steps``: the step rows after the last one sent (the page keeps the last ``num_steps``);
- ``requests``: the rows of shown requests that changed or were not shown before, to replace
  or add by ``id``;
- ``order``: the ids of the shown requests, in order, when that list changed (rows of other
  ids are dropped);
- ``blocks``: the changed blocks as ``BlockMap.rows`` gives them.
A snapshot (``"kind": "full"``) is ``LiveView.snapshot`` with ``num_steps``, the step rows to keep.
"""

from __future__ import annotations

import time
from typing import Any

from pagedllm.live_view.view import LiveView


class ViewerFrames:
    """The frames of one viewer of ``view``.

    Args:
        view: the live view.
        min_interval_s: at least this long between two frames.
        heartbeat_s: with nothing changed, a frame anyway after this long (the page's clock
            and its liveness); at least ``min_interval_s``.
        num_steps, num_requests: as ``LiveView.snapshot``.
    """

    def __init__(
        self, view: LiveView, min_interval_s: float, heartbeat_s: float, num_steps: int = 300, num_requests: int = 40,
    ) -> None:
        self.view = view
        self.min_interval_s = min_interval_s
        self.heartbeat_s = max(heartbeat_s, min_interval_s)
        self.num_steps = num_steps
        self.num_requests = num_requests
        self._version = -1  # the view's version in the last frame; -1: none sent
        self._last_step = -1
        self._order: list[str] = []
        self._sent_at = float("-inf")

    def wait_s(self, now: float) -> float:
        """How long to wait before ``poll`` may give the next frame (the rate limit); once
        that has passed, ``min_interval_s`` (how often to look for a change)."""
        return max(self._sent_at + self.min_interval_s - now, 0.0) or self.min_interval_s

    def poll(self, now: float) -> dict[str, Any] | None:
        """The next frame, or None: too soon after the last, or nothing changed and no heartbeat due.

        The first frame is a snapshot; later ones are deltas against the frames before.
        """
        if now < self._sent_at + self.min_interval_s:
            return None
        changes = self.view.changes_since(self._version) if self._version >= 0 else None
        if self._version >= 0 and changes is not None:
            if changes == (set(), set()) and now < self._sent_at + self.heartbeat_s:
                return None
            frame = self._delta(*changes)
        else:
            frame = self._snapshot()
        self._sent_at = now
        self._version = self.view.version
        return frame

    def _snapshot(self) -> dict[str, Any]:
        frame = {"kind": "full", "num_steps": self.num_steps} | self.view.snapshot(self.num_steps, self.num_requests)
        if frame["steps"]:
            self._last_step = frame["steps"][-1][0]
        self._order = [r["id"] for r in frame["requests"]]
        return frame

    def _delta(self, blocks: set[int], requests: set[str]) -> dict[str, Any]:
        view = self.view
        now = time.monotonic()
        frame: dict[str, Any] = {"kind": "delta", "version": view.version, "now": now, "headline": view.headline(now)}
        steps = view.step_rows(self._last_step, self.num_steps)
        if steps:
            self._last_step = steps[-1][0]
        shown = view.shown_requests(self.num_requests)
        order = [t.request_id for t in shown]
        before = set(self._order)
        frame["steps"] = steps
        frame["requests"] = [t.to_json() for t in shown if t.request_id in requests or t.request_id not in before]
        if order != self._order:
            frame["order"] = self._order = order
        frame["blocks"] = view.blocks.rows(blocks)
        return frame
