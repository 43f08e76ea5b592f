"""Scheduler and KV cache manager with a fake model: budgets, chunking, preemption, stops."""

from pagedllm.core.kv_cache_groups import KVCacheGroup
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from tests.utils import assert_pool_whole

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256, caching=False,
                   long_prefill=0):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(kv, max_num_seqs, budget, max_model_len, long_prefill_token_threshold=long_prefill)


def make_request(rid, n_prompt, max_model_len=256, **params):
    params.setdefault("max_tokens", 8)
    prompt = [10 + (i % 50) for i in range(n_prompt)]
    return Request(str(rid), prompt, SamplingParams(**params), [EOS], max_model_len)


def step(sched, token=7):
    """Schedule, 'run' (every sampling request gets ``token``), update; return the output."""
    out = sched.schedule()
    sampled = [[token] if s.samples else [] for s in out.scheduled]
    sched.update_from_output(out, sampled)
    return out


def test_budget_and_max_num_seqs_respected():
    sched = make_scheduler(max_num_seqs=3, budget=20)
    for i in range(5):
        sched.add_request(make_request(i, 9))
    while sched.num_unfinished:
        out = step(sched)
        assert out.num_batched_tokens <= 20
        assert len(out.scheduled) <= 3
        assert len(sched.running) <= 3
    assert_pool_whole(sched)


def test_chunked_prefill_then_decode():
    sched = make_scheduler(budget=32)
    sched.add_request(make_request(0, 100, max_tokens=3))
    chunks = [step(sched).scheduled[0].num_new_tokens for _ in range(6)]
    assert chunks == [32, 32, 32, 4, 1, 1]
    assert sched.num_unfinished == 0
    assert_pool_whole(sched)


def test_long_prefill_threshold_lets_prompts_advance_side_by_side():
    sched = make_scheduler(budget=32, long_prefill=12)
    sched.add_request(make_request(0, 30, max_tokens=2))
    sched.add_request(make_request(1, 5, max_tokens=2))
    first = step(sched).scheduled
    assert [(s.request.request_id, s.num_new_tokens) for s in first] == [("0", 12), ("1", 5)]
    second = step(sched).scheduled
    assert [(s.request.request_id, s.num_new_tokens) for s in second] == [("0", 12), ("1", 1)]
    while sched.num_unfinished:
        assert all(s.num_new_tokens <= 12 for s in step(sched).scheduled)
    assert_pool_whole(sched)


def test_no_token_sampled_mid_prefill():
    sched = make_scheduler(budget=8)
    req = make_request(0, 20)
    sched.add_request(req)
    out = sched.schedule()
    assert not out.scheduled[0].samples
    assert req.num_computed_tokens == 8


def test_preempts_most_recently_admitted_and_recomputes():
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens fill 4 blocks, growth forces preemption.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a, b = make_request("a", 8, max_tokens=12), make_request("b", 8, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    preempted = []
    while sched.num_unfinished:
        out = step(sched)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and set(preempted) == {"b"}
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.num_output_tokens == b.num_output_tokens == 12
    assert b.num_preemptions >= 1
    assert_pool_whole(sched)


def test_a_recompute_stops_at_the_prompt_end():
    """After a preemption, the request's prompt is one chunk and its outputs the next step's
    rows (past the prompt: computed as they were, by the decode kernel), never one chunk
    holding both."""
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a, b = make_request("a", 8, max_tokens=12), make_request("b", 8, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    chunks, preempted = [], False  # b's (tokens computed before, new tokens) after its preemption
    while sched.num_unfinished:
        out = step(sched)
        preempted |= b in out.preempted
        chunks += [(s.num_computed_before, s.num_new_tokens) for s in out.scheduled if s.request is b and preempted]
    first = chunks.index((0, 8))  # the recompute's prompt chunk
    assert chunks[first + 1][0] == 8 and chunks[first + 1][1] > 1  # then every output so far at once
    assert all(before >= 8 or before + n <= 8 for before, n in chunks)
    assert b.num_output_tokens == 12
    assert_pool_whole(sched)


def test_a_prompt_waits_until_the_pool_holds_all_of_it():
    """10 blocks of 4 slots, 8 tokens a step: "a" (8 prompt tokens, 12 more decoded, up to 5
    blocks) runs; "b" (32 prompt tokens, 8 blocks) would fit its first chunk beside it, but not
    its whole prompt, so it waits for "a" to finish instead of taking blocks that a's decode
    needs (and being preempted for them)."""
    sched = make_scheduler(num_blocks=10, block_size=4, budget=8)
    a = make_request("a", 8, max_tokens=12, ignore_eos=True)
    b = make_request("b", 32, max_tokens=2, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    preempted, b_first_step, a_done_step = [], None, None
    for n in range(100):
        if not sched.num_unfinished:
            break
        out = step(sched)
        preempted += [r.request_id for r in out.preempted]
        if b_first_step is None and any(s.request is b for s in out.scheduled):
            b_first_step = n
        if a_done_step is None and a.status == RequestStatus.FINISHED_LENGTH:
            a_done_step = n
    assert not preempted
    assert a_done_step is not None and b_first_step > a_done_step
    assert a.num_output_tokens == 12 and b.num_output_tokens == 2
    assert_pool_whole(sched)


def test_a_prompt_alone_runs_in_chunks_that_the_window_lets_fit():
    """One global and five 4-token sliding-window groups, 24 blocks of 4 slots: a 21-token prompt
    needs 6 blocks per group if nothing slid, more than the pool, but the windows' groups free
    their early blocks chunk by chunk, so alone it runs (nobody else's decode competes, so
    nothing of its later chunks is held back for it)."""
    groups = (KVCacheGroup((0,), 0), *(KVCacheGroup((i,), 4) for i in range(1, 6)))
    sched = Scheduler(KVCacheManager(24, 4, False, groups), 8, 8, 256)
    request = make_request("r", 21, max_tokens=2, ignore_eos=True)
    sched.add_request(request)
    failed = {}
    while sched.num_unfinished:
        failed.update(step(sched).failed)
    assert not failed and request.num_output_tokens == 2
    assert_pool_whole(sched)


def test_stop_conditions():
    sched = make_scheduler()
    eos = make_request("eos", 4)
    stop_tok = make_request("stop", 4, stop_token_ids=[9])
    ignore = make_request("ignore", 4, ignore_eos=True, max_tokens=3)
    min_tok = make_request("min", 4, min_tokens=2)
    for r in (eos, stop_tok, ignore, min_tok):
        sched.add_request(r)
    out = sched.schedule()
    tokens = {"eos": EOS, "stop": 9, "ignore": EOS, "min": EOS}
    sched.update_from_output(out, [[tokens[s.request.request_id]] for s in out.scheduled])
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert stop_tok.status == RequestStatus.FINISHED_STOPPED and stop_tok.stop_reason == 9
    assert not ignore.is_finished and not min_tok.is_finished  # EOS ignored / before min_tokens
    while sched.num_unfinished:
        out = sched.schedule()
        sched.update_from_output(out, [[EOS] for _ in out.scheduled])
    assert ignore.status == RequestStatus.FINISHED_LENGTH and ignore.num_output_tokens == 3
    assert min_tok.status == RequestStatus.FINISHED_STOPPED and min_tok.num_output_tokens == 2
    assert_pool_whole(sched)


def test_max_tokens_and_max_model_len():
    sched = make_scheduler(max_model_len=12)
    capped = Request("cap", list(range(10, 20)), SamplingParams(max_tokens=None), [EOS], 12)
    exact = make_request("exact", 3, max_model_len=12, max_tokens=5)
    sched.add_request(capped)
    sched.add_request(exact)
    while sched.num_unfinished:
        step(sched)
    assert capped.num_output_tokens == 2 and capped.status == RequestStatus.FINISHED_LENGTH
    assert exact.num_output_tokens == 5 and exact.status == RequestStatus.FINISHED_LENGTH
    assert_pool_whole(sched)


def test_abort_waiting_and_running_frees_blocks():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 6), make_request("b", 6)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    ended = sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in ended} == {"a", "b"}
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert sched.num_unfinished == 0
    assert_pool_whole(sched)


def test_invariants_hold_every_step():
    sched = make_scheduler(num_blocks=20, block_size=4, max_num_seqs=4, budget=16, max_model_len=64)
    reqs = [make_request(i, 3 + 5 * i, max_model_len=64, max_tokens=6) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    while sched.num_unfinished:
        step(sched)
        pool = sched.kv_cache.pool
        in_use = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert in_use + pool.num_free_blocks == pool.num_blocks
        for r in sched.running:
            assert 0 <= r.num_computed_tokens <= r.num_tokens <= 64
    assert all(r.num_output_tokens == 6 for r in reqs)
    assert_pool_whole(sched)


def test_request_waits_for_its_grammar_without_holding_up_others():
    from concurrent.futures import Future

    from pagedllm.structured_output.request import StructuredOutputRequest

    sched = make_scheduler()
    compiling: Future = Future()
    constrained = make_request("grammar", 5)
    constrained.structured_output = StructuredOutputRequest(compiling)
    sched.add_request(constrained)
    sched.add_request(make_request("free", 5))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["free"]
    assert sched.compiling == [constrained] and list(sched.waiting) == [constrained]
    compiling.set_result(_any_text_matcher())
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["free", "grammar"] and not sched.compiling


def _any_text_matcher():
    from pagedllm.models.loader import load_tokenizer, resolve_model
    from pagedllm.structured_output.backend import Compiler

    return Compiler(load_tokenizer(resolve_model("SmolLM2-135M-Instruct")), 49152, [EOS]).compile("start: /.*/")


def test_a_request_the_whole_cache_cannot_hold_fails_instead_of_blocking_the_queue():
    """8 blocks of 4 slots: a 40-token prompt never fits, and a 20-token prompt that grows past
    32 tokens cannot either once alone; both fail with an error, the others finish, pool whole."""
    sched = make_scheduler(num_blocks=8, block_size=4, budget=16)
    small = make_request("small", 6)
    for r in (make_request("huge", 40), make_request("grows", 20, max_tokens=30, ignore_eos=True), small):
        sched.add_request(r)
    failed = {}
    for _ in range(200):
        if not sched.num_unfinished:
            break
        failed.update(step(sched).failed)
    assert not sched.num_unfinished
    assert set(failed) == {"huge", "grows"} and "do not fit in the KV cache (8 blocks" in failed["huge"].message
    assert small.status == RequestStatus.FINISHED_LENGTH and small.num_output_tokens == 8
    assert_pool_whole(sched)
