"""The step every rank runs: block-table diffs from the scheduler keep every rank's tables equal
to the scheduler's, and the step's tokens, positions and logits rows follow its output."""

from __future__ import annotations

import random

import msgspec

from pagedllm.core.kv_cache_groups import KVCacheGroup
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.step_input import BlockTableMirror, StepInput, build_step

BLOCK_SIZE = 4


def _request(rid: str, rng: random.Random) -> Request:
    prompt = [rng.randrange(3, 50) for _ in range(rng.randint(1, 30))]
    return Request(rid, prompt, SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True), [], 128)


def test_tables_follow_the_scheduler_through_preemption_release_rollback_and_reuse() -> None:
    """Random traffic on a tight cache, two groups (one a sliding window), drafts rolled back,
    aborts and reused ids: after every step each rank's table of every scheduled request equals
    the scheduler's, and a rank forgets every request the scheduler no longer holds."""
    rng = random.Random(0)
    groups = (KVCacheGroup((0,), 0), KVCacheGroup((1,), 8))
    sched = Scheduler(KVCacheManager(24, BLOCK_SIZE, True, groups), 4, 16, 128)
    mirror = BlockTableMirror(len(groups))
    decoder = msgspec.msgpack.Decoder(StepInput)
    next_id = 0
    steps = 0
    while steps < 300:
        if rng.random() < 0.3:
            rid = str(rng.randrange(next_id + 1))  # sometimes an id used before
            if rid not in sched.requests:
                sched.add_request(_request(rid, rng))
            next_id += 1
        if sched.requests and rng.random() < 0.05:
            sched.finish_requests([rng.choice(list(sched.requests))], RequestStatus.FINISHED_ABORTED)
        for r in sched.running:  # drafts, some of them rejected below
            if rng.random() < 0.3:
                r.spec_token_ids = [rng.randrange(3, 50) for _ in range(rng.randint(1, 3))]
        out = sched.schedule()
        if out.is_empty:
            continue
        steps += 1
        step, _ = build_step(out)
        mirror.apply(decoder.decode(msgspec.msgpack.encode(step)))
        for s in out.scheduled:
            assert mirror[s.request.request_id] == sched.kv_cache.block_ids(s.request.request_id)
        sampled = [
            [rng.randrange(3, 50) for _ in range(rng.randint(1, len(s.spec_token_ids) + 1))] if s.samples else []
            for s in out.scheduled
        ]
        sched.update_from_output(out, sampled)
        assert set(mirror.tables) <= set(sched.kv_cache.req_block_ids) | set(sched.freed_req_ids)


def test_a_step_holds_tokens_positions_and_only_new_blocks() -> None:
    sched = Scheduler(KVCacheManager(16, BLOCK_SIZE, False), 4, 64, 128)
    prompt = list(range(3, 13))  # 10 tokens: 3 blocks
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=8, prompt_logprobs=1), [], 128))
    first, plan = build_step(out := sched.schedule())
    assert [(r.req_id, r.num_computed_before, r.token_ids) for r in first.requests] == [("a", 0, prompt)]
    assert [(u.group, u.start, len(u.block_ids)) for u in first.block_updates] == [(0, 0, 3)]
    assert first.logit_rows == [9, *range(9)]  # the sampled row, then the prompt-logprob rows
    assert (plan.num_sample, plan.num_verify, plan.prompt[0][2:]) == (1, 0, (0, 0, 9))
    sched.update_from_output(out, [[20]])
    second, _ = build_step(out := sched.schedule())
    assert [(r.num_computed_before, r.token_ids) for r in second.requests] == [(10, [20])]
    assert second.block_updates == []  # slot 10 is in block 2
    sched.update_from_output(out, [[21]])
    sched.requests["a"].spec_token_ids = [22, 23]
    third, plan = build_step(sched.schedule())
    assert [(r.num_computed_before, r.token_ids) for r in third.requests] == [(11, [21, 22, 23])]
    assert [(u.start, len(u.block_ids)) for u in third.block_updates] == [(3, 1)]  # slots 12, 13
    assert third.logit_rows == [0, 1, 2] and plan.verify[0][2] == 0 and plan.num_verify == 3


def test_a_step_runs_the_requests_past_their_prompts_then_prompt_chunks() -> None:
    """Decodes and speculative verifications first (the decode kernel's rows, ``num_decode_requests``), prompt chunks last (the prompt kernels' rows, ``num_prompt_rows``)."""
    sched = Scheduler(KVCacheManager(32, BLOCK_SIZE, False), 4, 64, 128)
    for rid in ("a", "b"):
        sched.add_request(Request(rid, list(range(3, 9)), SamplingParams(max_tokens=8, ignore_eos=True), [], 128))
    sched.update_from_output(out := sched.schedule(), [[20], [21]])
    sched.requests["a"].spec_token_ids = [22, 23]
    sched.add_request(Request("c", list(range(3, 8)), SamplingParams(max_tokens=8), [], 128))
    step, plan = build_step(out := sched.schedule())
    assert [s.request.request_id for s in out.scheduled] == ["a", "b", "c"]
    assert [(r.req_id, len(r.token_ids)) for r in step.requests] == [("a", 3), ("b", 1), ("c", 5)]
    assert (step.num_decode_requests, step.num_prompt_rows) == (2, 5)
    assert step.logit_rows == [3, 8, 0, 1, 2] and plan.num_verify == 3


def test_a_steps_logit_rows_are_a_view_where_consecutive_and_the_rows_asked_for_otherwise() -> None:
    """The runner takes a step's logit rows of the hidden states without indexing by a list
    (which starts torch's thread team every step): consecutive rows are a view of the same
    storage, any other choice the same values as ``t[js]``."""
    import torch

    from pagedllm.worker.model_runner import _rows

    t = torch.arange(40.0).view(8, 5)
    for js in ([0, 1, 2, 3, 4, 5, 6, 7], [2, 3, 4], [7]):
        rows = _rows(t, js)
        assert torch.equal(rows, t[js]) and rows.data_ptr() == t[js[0]].data_ptr()
    assert _rows(t, []).shape == (0, 5)
    for js in ([0, 2, 5], [6, 1], [3, 3]):
        assert torch.equal(_rows(t, js), t[js])
