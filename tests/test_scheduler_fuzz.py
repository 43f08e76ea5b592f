"""A stateful fuzz of the core: the scheduler, the KV cache manager and the step the workers
build from its output, driven by a fake model whose K/V cache is exact (``fake_kv_model``: a
block the core gets wrong reads back a wrong entry). The outputs of many requests under
pressure (a tiny pool, prefix caching, aborts, arrivals, chunking, drafts, adapters) must equal
those of the same requests each run alone in a large pool. After every step the pool's
bookkeeping is checked against the tables (``_check_invariants``), and so is the pool rebuilt
from the block events alone (``EventReplay``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from pagedllm.config import ModelConfig
from pagedllm.core.kv_cache_groups import KVCacheGroup, blocks_per_request, kv_cache_groups
from pagedllm.core.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from pagedllm.core.kv_events import BlockOp, BlockOpKind
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.lora_request import LoRARequest
from pagedllm.sampling_params import SamplingParams
from tests.fake_kv_model import VOCAB, FakeModel, adapter_id, oracle_continuation
from tests.utils import assert_pool_whole

EOS = 2


@dataclass
class Spec:
    """One request of a scenario: what it asks for and when it arrives."""

    rid: str
    prompt: list[int]
    params: dict
    salt: str | None
    lora: int  # adapter id; 0: the base model
    arrival: int

    def request(self, max_model_len: int) -> Request:
        lora = LoRARequest(f"adapter{self.lora}", self.lora, "/nowhere") if self.lora else None
        params = SamplingParams(**self.params)
        return Request(self.rid, list(self.prompt), params, [EOS], max_model_len, self.salt, lora_request=lora)


def _check_invariants(sched: Scheduler) -> None:
    """The pool's counts, queue and cache map agree with the requests' tables; tables are sane."""
    kv = sched.kv_cache
    pool = kv.pool
    bs = kv.block_size
    holders: dict[int, list[tuple[str, int, int]]] = {}
    for rid, tables in kv.req_blocks.items():
        assert rid in sched.requests, f"{rid} holds a table but is not live"
        ids = kv.req_block_ids[rid]
        for g, (blocks, block_ids) in enumerate(zip(tables, ids)):
            assert [NULL_BLOCK_ID if b is None else b.block_id for b in blocks] == block_ids
            if not kv.groups[g].window:
                assert None not in blocks
            else:  # released entries lead
                n_released = next((k for k, b in enumerate(blocks) if b is not None), len(blocks))
                assert None not in blocks[n_released:]
            for k, b in enumerate(blocks):
                if b is not None:
                    holders.setdefault(b.block_id, []).append((rid, g, k))
    free = [b.block_id for b in pool.free_queue]
    assert len(free) == len(set(free)) == pool.num_free_blocks
    assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    for b in pool.blocks:
        assert b.ref_cnt == len(holders.get(b.block_id, [])), f"{b}: held by {holders.get(b.block_id)}"
        if b.block_hash is not None:
            assert pool.cached.get(b.block_hash) is b
    assert all(b.block_hash == h for h, b in pool.cached.items())
    for block_id, where in holders.items():
        if len(where) > 1:  # shared: a full cached prefix block, at one position in one group
            assert pool.blocks[block_id].block_hash is not None, f"block {block_id} shared unhashed: {where}"
            assert len({(g, k) for _, g, k in where}) == 1, f"block {block_id} shared across positions: {where}"
            assert len({rid for rid, _, _ in where}) == len(where)
            owners = {(sched.requests[rid].cache_salt, adapter_id(sched.requests[rid])) for rid, _, _ in where}
            assert len(owners) == 1, f"block {block_id} shared across salts or adapters: {owners}"
    assert len(sched.running) <= sched.max_num_seqs
    assert {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting} == set(sched.requests)
    assert len(sched.running) + len(sched.waiting) == len(sched.requests)
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        assert 0 <= r.num_computed_tokens < r.num_tokens <= sched.max_model_len
        for g, group in enumerate(kv.groups):
            blocks = kv.req_blocks[r.request_id][g]
            assert len(blocks) >= -(-r.num_computed_tokens // bs)
            first = group.first_needed_block(r.num_computed_tokens, bs)
            assert None not in blocks[first : -(-r.num_computed_tokens // bs)]
    for r in sched.waiting:
        assert r.num_computed_tokens == 0 and not r.spec_token_ids
        assert not any(kv.num_held_blocks(r.request_id))


class EventReplay:
    """The pool as the live view sees it: rebuilt from the manager's block events alone."""

    def __init__(self, num_blocks: int) -> None:
        self.ref = [0] * num_blocks
        self.cached: set[int] = set()
        self.tables: dict[tuple[str, int], dict[int, int]] = {}  # (request, group) -> index -> block

    def apply(self, events: list[BlockOp]) -> None:
        for e in events:
            table = self.tables.setdefault((e.request_id, e.group), {})
            for i, b in enumerate(e.block_ids):
                where = e.first_index + i
                if e.kind == BlockOpKind.NEW:
                    assert self.ref[b] == 0 and where not in table, e
                    self.ref[b] = 1
                    self.cached.discard(b)
                    table[where] = b
                elif e.kind == BlockOpKind.HIT:
                    assert b in self.cached and where not in table, e
                    self.ref[b] += 1
                    table[where] = b
                elif e.kind == BlockOpKind.FREE:
                    assert table.pop(where, None) == b, e
                    self.ref[b] -= 1
                elif e.kind == BlockOpKind.CACHED:
                    assert b in table.values() and b not in self.cached, e
                    self.cached.add(b)
            if e.kind == BlockOpKind.RESET:
                self.cached.clear()

    def check(self, kv: KVCacheManager) -> None:
        assert self.ref == [b.ref_cnt for b in kv.pool.blocks]
        assert self.cached == {b.block_id for b in kv.pool.blocks if b.block_hash is not None}
        tables = {key: table for key, table in self.tables.items() if table}
        held = {
            (rid, g): {k: b.block_id for k, b in enumerate(blocks) if b is not None}
            for rid, per_group in kv.req_blocks.items()
            for g, blocks in enumerate(per_group)
            if any(b is not None for b in blocks)
        }
        assert tables == held


@dataclass
class Scenario:
    block_size: int
    groups: list[KVCacheGroup]
    num_layers: int
    max_model_len: int
    budget: int
    max_num_seqs: int
    long_prefill: int
    caching: bool
    num_blocks: int
    specs: list[Spec]
    max_loras: int | None
    p_abort: float
    p_draft: float


def _groups(rng: random.Random, block_size: int) -> tuple[list[KVCacheGroup], int]:
    """KV cache groups as a model config gives them: all global, Gemma 3's mix, or all sliding."""
    kind = rng.choice(["global", "mixed", "mixed", "sliding"])
    num_layers = rng.randint(1, 7) if kind != "mixed" else rng.randint(2, 7)
    window = rng.randint(1, 3 * block_size)
    if kind == "global":
        types = ["full_attention"] * num_layers
    elif kind == "sliding":
        types = ["sliding_attention"] * num_layers
    else:
        types = ["full_attention" if rng.random() < 0.3 else "sliding_attention" for _ in range(num_layers)]
        types[rng.randrange(num_layers)] = "full_attention"
        types[rng.randrange(num_layers)] = "sliding_attention"
        if "full_attention" not in types or "sliding_attention" not in types:
            types = ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
    config = ModelConfig(
        "gemma3", VOCAB, 8, 8, num_layers, 1, 1, 8, 1e4, 1e-6, 1024, True, layer_types=types, sliding_window=window
    )
    return kv_cache_groups(config), num_layers


def _scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3, 4, 4, 8])
    groups, num_layers = _groups(rng, block_size)
    max_model_len = rng.randint(8, 64)
    budget = rng.choice([1, 2, 3, 5, 8, 16, 64])
    long_prefill = rng.choice([0, 0, 1, 3, 7])
    # The smallest pool every request fits in alone (chunks and drafts are within the budget,
    # which blocks_per_request assumes), a little more, or too small for the longest requests.
    need = blocks_per_request(groups, max_model_len, block_size, budget)
    num_blocks = max(1, need + rng.choice([-3, -1, 0, 0, 1, 2, 5, 20]))
    num_adapters = rng.choice([0, 0, 1, 3])
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, max_model_len))] for _ in range(3)]
    specs = []
    arrival = 0
    for n in range(rng.randint(1, 12)):
        prompt = list(rng.choice(prefixes))[: rng.randint(0, max_model_len - 1)] if rng.random() < 0.7 else []
        prompt += [rng.randrange(0, VOCAB) for _ in range(rng.randint(0 if prompt else 1, 12))]
        prompt = prompt[: max_model_len - 1]
        params: dict = {"max_tokens": rng.choice([None, 1, 2, 5, 10, 30])}
        if rng.random() < 0.5:
            params["ignore_eos"] = True
        if rng.random() < 0.3:
            params["stop_token_ids"] = [rng.randrange(VOCAB)]
        if rng.random() < 0.2 and params["max_tokens"]:
            params["min_tokens"] = rng.randint(0, params["max_tokens"])
        if rng.random() < 0.1:
            params["prompt_logprobs"] = 1
            if rng.random() < 0.3:
                params["max_tokens"] = 0
                params.pop("min_tokens", None)
        salt = rng.choice([None, None, None, "a", "b"])
        lora = rng.randint(0, num_adapters)
        copies = rng.choice([1, 1, 1, 2, 3])  # n > 1: samples are requests of one prompt
        arrival += rng.choice([0, 0, 1, 3])
        for c in range(copies):
            specs.append(Spec(f"r{n}-{c}", prompt, params, salt, lora, arrival))
    return Scenario(
        block_size, groups, num_layers, max_model_len, budget, rng.choice([1, 2, 3, 8]), long_prefill,
        rng.random() < 0.8, num_blocks, specs, rng.choice([None, 1, 2]) if num_adapters else None,
        rng.choice([0.0, 0.0, 0.02, 0.1]), rng.choice([0.0, 0.5, 0.9]),
    )


@dataclass
class Result:
    tokens: list[int]
    status: RequestStatus
    scored: list[int]


def _run(sc: Scenario, rng: random.Random | None, alone: bool = False) -> dict[str, Result]:
    """Run the scenario's requests; ``alone``: each in turn in a large pool, without drafts or
    aborts; else under the scenario's pressure with ``rng`` choosing aborts and drafts."""
    if alone:
        num_blocks = blocks_per_request(sc.groups, sc.max_model_len, sc.block_size, sc.max_model_len) + 4
        budget, seqs, threshold, caching, max_loras = sc.max_model_len, 1, 0, False, None
    else:
        num_blocks, budget, seqs, threshold = sc.num_blocks, sc.budget, sc.max_num_seqs, sc.long_prefill
        caching, max_loras = sc.caching, sc.max_loras
    kv = KVCacheManager(num_blocks, sc.block_size, caching, sc.groups)
    kv.events = []
    replay = EventReplay(num_blocks)
    sched = Scheduler(kv, seqs, budget, sc.max_model_len, max_loras, threshold)
    model = FakeModel(sc.groups, sc.num_layers, num_blocks, sc.block_size)
    requests: dict[str, Request] = {}
    pending = list(sc.specs)
    step_no = 0
    idle = 0
    while pending or sched.num_unfinished:
        step_no += 1
        assert step_no < 20_000, "no progress"
        while pending and (alone and not sched.num_unfinished or not alone and pending[0].arrival <= step_no):
            spec = pending.pop(0)
            requests[spec.rid] = spec.request(sc.max_model_len)
            sched.add_request(requests[spec.rid])
        if rng is not None and sched.requests and rng.random() < sc.p_abort:
            sched.finish_requests([rng.choice(sorted(sched.requests))], RequestStatus.FINISHED_ABORTED)
            _check_invariants(sched)
        if rng is not None and rng.random() < 0.05 and kv.reset_prefix_cache():
            assert not kv.pool.cached and all(b.block_hash is None for b in kv.pool.blocks)
        out = sched.schedule()
        for rid, _ in out.failed:  # only a request the whole pool cannot hold fails
            assert requests[rid].status == RequestStatus.FINISHED_ERROR
            assert blocks_per_request(sc.groups, requests[rid].num_tokens, sc.block_size, budget) > num_blocks, rid
        assert out.num_batched_tokens <= budget and len(out.scheduled) <= seqs
        assert len({s.request.request_id for s in out.scheduled}) == len(out.scheduled)
        for s in out.scheduled:
            assert s.num_new_tokens > 0
            if threshold:
                assert s.num_new_tokens - len(s.spec_token_ids) <= threshold
        if out.is_empty and not out.failed:
            idle += 1
            assert idle < 3 or not sched.num_unfinished, "nothing scheduled while requests wait"
        if out.is_empty:
            continue
        idle = 0
        sampled = model.run(sched, out)
        if rng is not None and rng.random() < sc.p_abort:  # aborted after the forward, before the update
            victim = rng.choice(out.scheduled).request
            sched.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
        updated = sched.update_from_output(out, sampled)
        if rng is not None:
            for s, new in updated:  # drafts for the next step, as the proposer makes them
                r = s.request
                if new and not r.is_finished and rng.random() < sc.p_draft:
                    k = rng.randint(1, 4)
                    drafts = oracle_continuation(r, k)
                    for d in range(rng.randint(0, k), k):
                        drafts[d] = rng.randrange(VOCAB)
                    r.spec_token_ids = drafts
        _check_invariants(sched)
        replay.apply(kv.events)
        kv.events = []
        replay.check(kv)
    assert_pool_whole(sched)
    assert not model.mirror.tables.keys() - set(sched.freed_req_ids)
    return {
        rid: Result(r.output_token_ids, r.status, model.scored.get(rid, [])) for rid, r in requests.items()
    }


def _fuzz(seed: int) -> None:
    sc = _scenario(seed)
    rng = random.Random(seed * 7919 + 1)
    got = _run(sc, rng)
    want = _run(sc, None, alone=True)
    for spec in sc.specs:
        g, w = got[spec.rid], want[spec.rid]
        n_prompt_scored = max(0, len(spec.prompt) - 1) if spec.params.get("prompt_logprobs") is not None else 0
        assert w.status != RequestStatus.FINISHED_ERROR, spec.rid
        if g.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            assert g.tokens == w.tokens[: len(g.tokens)], spec.rid
            assert len(set(g.scored)) == len(g.scored)
        else:
            assert (g.tokens, g.status) == (w.tokens, w.status), spec.rid
            assert sorted(g.scored) == list(range(n_prompt_scored)), spec.rid
        assert sorted(w.scored) == list(range(n_prompt_scored))


@pytest.mark.parametrize("seed", range(200))
def test_outputs_under_pressure_equal_outputs_alone(seed: int) -> None:
    _fuzz(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(200, 2200))
def test_outputs_under_pressure_equal_outputs_alone_long_sweep(seed: int) -> None:
    _fuzz(seed)
