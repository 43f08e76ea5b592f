"""Speculative decoding in the scheduler (a fake model): drafts' budget, rollback, block pool, stops, metrics."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from tests.utils import assert_pool_whole

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, budget=32, caching=False, max_num_seqs=8):
    return Scheduler(KVCacheManager(num_blocks, block_size, caching), max_num_seqs, budget, 256)


def make_request(rid: str, n_prompt: int, **params) -> Request:
    params.setdefault("max_tokens", 16)
    return Request(rid, [10 + (i % 50) for i in range(n_prompt)], SamplingParams(**params), [EOS], 256)


def spec_step(sched: Scheduler, num_accepted: int = 0, token: int = 7):
    """One step of a fake model: each request keeps ``num_accepted`` drafts, then ``token``."""
    out = sched.schedule()
    sampled = []
    for s in out.scheduled:
        if s.spec_token_ids:
            sampled.append(s.spec_token_ids[:num_accepted] + [token])
        else:
            sampled.append([token] if s.samples else [])
    sched.update_from_output(out, sampled)
    return out


def test_drafts_are_scheduled_then_rolled_back() -> None:
    sched = make_scheduler()
    req = make_request("a", 6)
    sched.add_request(req)
    spec_step(sched)  # prefill; 7 tokens, 6 computed
    req.spec_token_ids = [11, 12, 13, 14]
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.num_new_tokens, s.spec_token_ids, out.num_batched_tokens) == (5, [11, 12, 13, 14], 5)
    assert req.spec_token_ids == [] and req.num_computed_tokens == 11
    assert len(sched.kv_cache.block_ids("a")[0]) == 3  # 11 slots in blocks of 4
    sched.update_from_output(out, [[11, 9]])  # draft 1 accepted, 9 sampled instead of draft 2
    assert req.output_token_ids == [7, 11, 9]
    assert req.num_computed_tokens == 8 == req.num_tokens - 1
    assert len(sched.kv_cache.block_ids("a")[0]) == 2  # the block of rejected drafts only is free again
    assert sched.kv_cache.pool.num_free_blocks == 62
    stats = sched.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 1)
    assert stats.accepted_per_position == [1, 0, 0, 0]


def test_drafts_fit_the_budget_and_max_tokens() -> None:
    sched = make_scheduler(budget=4)
    req = make_request("a", 3, max_tokens=4)
    sched.add_request(req)
    spec_step(sched)
    req.spec_token_ids = [11, 12, 13, 14, 15]
    out = spec_step(sched, num_accepted=5)
    assert out.scheduled[0].spec_token_ids == [11, 12]  # max_tokens 4 - 1 output - 1 sampled
    assert req.output_token_ids == [7, 11, 12, 7] and req.status == RequestStatus.FINISHED_LENGTH
    assert_pool_whole(sched)

    sched = make_scheduler(budget=8)
    a, b = make_request("a", 2), make_request("b", 2)
    sched.add_request(a)
    sched.add_request(b)
    spec_step(sched)
    sched.max_num_batched_tokens = 5
    a.spec_token_ids, b.spec_token_ids = [11, 12, 13], [15, 16]  # b: budget for its last token only
    out = sched.schedule()
    assert [s.spec_token_ids for s in out.scheduled] == [[11, 12, 13], []] and out.num_batched_tokens == 5


def test_drafts_dropped_before_anyone_is_preempted() -> None:
    sched = make_scheduler(num_blocks=2, block_size=4)
    req = make_request("a", 6)
    sched.add_request(req)
    spec_step(sched)
    req.spec_token_ids = [11, 12, 13]  # 7 + 3 slots > 2 blocks: the drafts go, the request stays
    out = spec_step(sched)
    assert out.scheduled[0].spec_token_ids == [] and not out.preempted and sched.num_preemptions == 0
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert_pool_whole(sched)


def test_stop_token_inside_an_accepted_run_ends_the_request_there() -> None:
    sched = make_scheduler()
    req = make_request("a", 5)
    sched.add_request(req)
    spec_step(sched)
    req.spec_token_ids = [3, EOS, 4]
    spec_step(sched, num_accepted=3, token=8)
    assert req.output_token_ids == [7, 3, EOS] and req.status == RequestStatus.FINISHED_STOPPED
    assert_pool_whole(sched)


def test_preemption_clears_drafts() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    a, b = make_request("a", 7, max_tokens=6), make_request("b", 7, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    spec_step(sched)
    preempted = []
    while not preempted:
        for r in (a, b):
            r.spec_token_ids = [11]
        preempted = spec_step(sched, num_accepted=1).preempted
    assert preempted == [b] and b.spec_token_ids == [] and b.status == RequestStatus.PREEMPTED
    for _ in range(40):
        spec_step(sched)
    assert a.is_finished and b.is_finished
    assert_pool_whole(sched)


def test_unverified_drafts_never_enter_the_prefix_cache() -> None:
    sched = make_scheduler(caching=True)
    req = make_request("a", 6, max_tokens=12)
    sched.add_request(req)
    spec_step(sched)
    while not req.is_finished:
        req.spec_token_ids = [90, 91, 92, 93]  # always rejected, and crossing block boundaries
        spec_step(sched)
    real = set(req.block_hashes)
    assert all(b.block_hash in real for b in sched.kv_cache.pool.blocks if b.block_hash is not None)
    assert len(sched.kv_cache.pool.cached) == (req.num_tokens - 1) // 4
    assert_pool_whole(sched)


def test_acceptance_metrics_in_the_log_line(caplog: pytest.LogCaptureFixture) -> None:
    from pagedllm.engine.messages import SchedulerStats
    from pagedllm.engine.stat_logger import StatLogger

    logger = StatLogger(interval=0.0)
    first = SchedulerStats(spec_num_drafts=2, spec_num_draft_tokens=8, spec_num_accepted_tokens=5,
                           spec_accepted_per_position=[2, 2, 1, 0])
    second = SchedulerStats(spec_num_drafts=4, spec_num_draft_tokens=16, spec_num_accepted_tokens=6,
                            spec_accepted_per_position=[3, 2, 1, 0])
    with caplog.at_level("INFO", logger="pagedllm"):
        logger.record(first, 0, 0)
        logger.record(second, 0, 0)  # the interval's deltas: 2 drafts, 8 tokens, 1 accepted
    lines = [r.getMessage() for r in caplog.records if "speculative decoding" in r.getMessage()]
    assert "acceptance rate: 62.5%, mean acceptance length: 3.50" in lines[0]
    assert "acceptance rate: 12.5%, mean acceptance length: 1.50" in lines[1]
    assert "acceptance per position: [0.500, 0.000, 0.000, 0.000]" in lines[1]


def test_kv_cache_manager_trim() -> None:
    kv = KVCacheManager(8, 4, enable_caching=False)
    req = make_request("a", 3)
    assert kv.allocate_slots(req, 3, num_lookahead_tokens=10)
    (ids,) = kv.block_ids("a")  # one group
    assert len(ids) == 4 and kv.pool.num_free_blocks == 4
    kv.trim(req, 5)
    assert len(ids) == 2 and kv.pool.num_free_blocks == 6  # the live list itself shrinks
    kv.trim(req, 8)  # nothing beyond: no-op
    assert len(ids) == 2
