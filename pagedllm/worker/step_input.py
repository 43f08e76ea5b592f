"""What tensor-parallel rank 0 broadcasts to the other ranks each step, as a diff.

The other ranks only run the forward pass (and their share of the logits), so they need the
step's tokens and where their K/V go: per scheduled request its new token ids and
``num_computed_tokens`` before them, and its block table, sent once and then only as changes
(appended blocks; a sliding-window group's released head; a table rebuilt after preemption).
Sampling, stop checks and grammars stay on rank 0, which owns the requests.
"""

from __future__ import annotations

import msgspec

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import ScheduledRequest


class RequestTokens(msgspec.Struct, array_like=True):
    """One scheduled request's share of the step (drafts included in ``token_ids``)."""

    req_id: str
    num_computed_before: int
    token_ids: list[int]


class BlockTableUpdate(msgspec.Struct, array_like=True):
    """Replace ``table[group][start:]`` of request ``req_id`` by ``block_ids``."""

    req_id: str
    group: int
    start: int
    block_ids: list[int]


class StepInput(msgspec.Struct, array_like=True):
    """One step for the non-driver ranks, or the order to stop.

    Attributes:
        requests: the scheduled requests in forward order (decodes first).
        block_updates: changes to the block tables of those requests.
        dropped: requests whose tables the ranks forget (finished, preempted).
        logit_rows: rows of the step's hidden states the logits are computed for, in order.
        shutdown: stop the loop (every other field empty).
    """

    requests: list[RequestTokens] = []
    block_updates: list[BlockTableUpdate] = []
    dropped: list[str] = []
    logit_rows: list[int] = []
    shutdown: bool = False


class BlockTableMirror:
    """The block tables the other ranks hold, kept on rank 0 to send only what changed."""

    def __init__(self) -> None:
        self.tables: dict[str, list[list[int]]] = {}
        self.requests: dict[str, Request] = {}

    def step_input(self, reqs: list[ScheduledRequest], logit_rows: list[int]) -> StepInput:
        """The broadcast of a step that runs ``reqs`` (in forward order)."""
        dropped = [rid for rid, r in self.requests.items() if r.status != RequestStatus.RUNNING]
        for rid in dropped:
            del self.tables[rid], self.requests[rid]
        updates: list[BlockTableUpdate] = []
        tokens: list[RequestTokens] = []
        for s in reqs:
            rid = s.request.request_id
            known = self.tables.get(rid)
            if known is None:
                known = self.tables[rid] = [[] for _ in s.block_ids]
                self.requests[rid] = s.request
            for g, (old, new) in enumerate(zip(known, s.block_ids)):
                start = _first_difference(old, new)
                if start < len(new) or len(old) > len(new):
                    updates.append(BlockTableUpdate(rid, g, start, new[start:]))
                    known[g] = list(new)
            start, end = s.num_computed_before, s.num_computed_before + s.num_new_tokens
            tokens.append(RequestTokens(rid, start, s.request.all_token_ids[start:end] + s.spec_token_ids))
        return StepInput(tokens, updates, dropped, logit_rows)


def apply_updates(tables: dict[str, list[list[int]]], step: StepInput, num_groups: int) -> None:
    """A non-driver rank's tables after ``step``'s drops and updates."""
    for rid in step.dropped:
        tables.pop(rid, None)
    for r in step.requests:
        if r.req_id not in tables:
            tables[r.req_id] = [[] for _ in range(num_groups)]
    for u in step.block_updates:
        table = tables[u.req_id][u.group]
        del table[u.start :]
        table.extend(u.block_ids)


def _first_difference(old: list[int], new: list[int]) -> int:
    """Index of the first entry where ``new`` differs from ``old`` (or where one ends)."""
    n = len(old)
    if new[:n] == old:  # the common case, compared in C: blocks appended or none
        return n
    for i, (a, b) in enumerate(zip(old, new)):
        if a != b:
            return i
    return len(new)
