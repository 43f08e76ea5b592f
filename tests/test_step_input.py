"""The step diff rank 0 broadcasts: the other ranks' block tables always equal the scheduler's."""

from __future__ import annotations

import random

import msgspec

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.step_input import BlockTableMirror, StepInput, apply_updates


def _request(rid: str) -> Request:
    r = Request(rid, list(range(40)), SamplingParams(max_tokens=8), [], 256)
    r.status = RequestStatus.RUNNING
    return r


def test_remote_tables_follow_appends_releases_and_rebuilds() -> None:
    """Random table edits of the kinds the KV cache manager makes, over two groups."""
    rng = random.Random(0)
    mirror, remote = BlockTableMirror(), {}
    requests = {str(i): _request(str(i)) for i in range(6)}
    tables = {rid: [[], []] for rid in requests}
    decoder = msgspec.msgpack.Decoder(StepInput)
    for _ in range(300):
        running = [rid for rid, r in requests.items() if r.status == RequestStatus.RUNNING]
        for rid in rng.sample(running, k=min(len(running), rng.randint(1, 4))):
            for g in range(2):
                t, kind = tables[rid][g], rng.random()
                if kind < 0.6:
                    t.extend(rng.randrange(100) for _ in range(rng.randint(0, 2)))  # growth
                elif kind < 0.8 and t:
                    t[rng.randrange(len(t))] = 0  # a sliding window releases a block (null id)
                elif kind < 0.9:
                    t[:] = [rng.randrange(100) for _ in range(rng.randint(0, 5))]  # rebuilt
        for rid in running:  # finish, preempt or resume some
            if rng.random() < 0.05:
                requests[rid].status = rng.choice([RequestStatus.FINISHED_STOPPED, RequestStatus.PREEMPTED])
        for rid, r in requests.items():
            if r.status == RequestStatus.PREEMPTED and rng.random() < 0.3:
                r.status, tables[rid] = RequestStatus.RUNNING, [[], [rng.randrange(100)]]
        scheduled = [rid for rid, r in requests.items() if r.status == RequestStatus.RUNNING and rng.random() < 0.7]
        reqs = [ScheduledRequest(requests[rid], 1, 10, tables[rid]) for rid in scheduled]
        step = decoder.decode(msgspec.msgpack.encode(mirror.step_input(reqs, [0])))
        apply_updates(remote, step, 2)
        for rid in scheduled:
            assert remote[rid] == tables[rid]
        assert set(remote) <= {rid for rid, r in requests.items() if r.status == RequestStatus.RUNNING} | set(scheduled)


def test_a_decode_step_sends_only_new_blocks_and_tokens() -> None:
    mirror = BlockTableMirror()
    r = _request("a")
    table = [[3, 4, 5]]
    first = mirror.step_input([ScheduledRequest(r, 40, 0, table)], [39])
    assert [(u.start, u.block_ids) for u in first.block_updates] == [(0, [3, 4, 5])]
    assert first.requests[0].token_ids == list(range(40))
    r.append_output_token(7)
    second = mirror.step_input([ScheduledRequest(r, 1, 40, table)], [0])
    assert second.block_updates == [] and second.requests[0].num_computed_before == 40
    table[0].append(9)
    third = mirror.step_input([ScheduledRequest(r, 1, 41, table)], [0])
    assert [(u.start, u.block_ids) for u in third.block_updates] == [(3, [9])]
