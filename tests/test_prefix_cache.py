"""Prefix caching at the block level: hash chain, sharing, eviction order, salts."""

from pagedllm.core.kv_cache_manager import KVCacheManager, hash_block
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

BS = 4


def req(rid, tokens, salt=None, **params):
    params.setdefault("max_tokens", 4)
    return Request(str(rid), list(tokens), SamplingParams(**params), [2], 1024, cache_salt=salt)


def admit(kv: KVCacheManager, r: Request) -> int:
    """What the scheduler does at admission; returns the hit length in tokens."""
    blocks, hit = kv.get_computed_blocks(r)
    r.num_computed_tokens = hit
    assert kv.allocate_slots(r, r.num_tokens - hit, blocks)
    kv.count_prefix_hit(r, hit)
    r.num_computed_tokens = r.num_tokens
    return hit


def test_hash_chain_depends_on_parent_tokens_and_salt():
    a = hash_block(None, [1, 2, 3, 4], None)
    assert a == hash_block(None, [1, 2, 3, 4], None)
    assert a != hash_block(None, [1, 2, 3, 5], None)
    assert a != hash_block(None, [1, 2, 3, 4], "tenant")
    b = hash_block(a, [5, 6, 7, 8], None)
    assert b != hash_block(hash_block(None, [0, 2, 3, 4], None), [5, 6, 7, 8], None)


def test_shared_prefix_hits_and_refcounts():
    kv = KVCacheManager(16, BS, True)
    first = req("a", range(10))  # 2 full blocks + a partial one
    assert admit(kv, first) == 0
    second = req("b", list(range(8)) + [99, 98, 97])
    assert admit(kv, second) == 8
    shared = kv.req_blocks["a"][0][:2]
    assert shared == kv.req_blocks["b"][0][:2]
    assert [b.ref_cnt for b in shared] == [2, 2]
    assert kv.req_blocks["a"][0][2] is not kv.req_blocks["b"][0][2]  # partial blocks never shared
    assert kv.req_blocks["a"][0][2].block_hash is None
    kv.free(first)
    kv.free(second)
    assert kv.pool.num_free_blocks == 16 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_last_token_always_computed():
    kv = KVCacheManager(16, BS, True)
    admit(kv, req("a", range(8)))
    again = req("b", range(8))  # the whole prompt is cached, but its last token must run
    assert admit(kv, again) == 4


def test_eviction_order_after_free():
    kv = KVCacheManager(6, BS, True)
    a = req("a", range(12))  # 3 full blocks
    admit(kv, a)
    ids = [b.block_id for b in kv.req_blocks["a"][0]]
    kv.free(a)
    order = [b.block_id for b in kv.pool.free_queue]
    # never-used blocks first, then a's blocks tail first (its tail is evicted before its head)
    assert order[-3:] == ids[::-1]
    assert set(order[:3]) == set(range(6)) - set(ids)
    # a new request hits a's head: those blocks leave the middle of the queue
    b = req("b", list(range(8)) + [50, 51])
    assert admit(kv, b) == 8
    assert kv.pool.num_free_blocks == 3  # 6 - 2 hit - 1 new partial
    # filling the pool evicts a's tail block last of the free ones, and drops its hash lazily
    tail = kv.req_blocks.get("a")
    assert tail is None
    c = req("c", range(100, 112))  # needs 3 new blocks: takes every free block
    admit(kv, c)
    assert kv.pool.get_cached_block(hash_block(None, list(range(4)), None)) is not None  # a's head, held by b
    assert len(kv.pool.cached) == 2 + 3  # b's two shared + c's three


def test_salted_request_never_hits_unsalted():
    kv = KVCacheManager(16, BS, True)
    admit(kv, req("plain", range(9)))
    assert admit(kv, req("salted", range(9), salt="t1")) == 0
    assert admit(kv, req("salted2", range(9), salt="t1")) == 8
    assert admit(kv, req("other", range(9), salt="t2")) == 0


def test_preempted_request_finds_its_blocks_again():
    kv = KVCacheManager(8, BS, True)
    sched = Scheduler(kv, 4, 64, 1024)
    r = req("a", range(10), max_tokens=3)
    sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, [[7]])
    sched._preempt(sched.running.pop())
    out = sched.schedule()
    assert out.scheduled[0].num_computed_before == 8  # two full blocks found again


def test_hit_counters_in_tokens():
    kv = KVCacheManager(16, BS, True)
    admit(kv, req("a", range(10)))
    admit(kv, req("b", range(10)))
    assert kv.prefix_queries == 20 and kv.prefix_hits == 8


def test_hit_counters_count_each_request_once():
    """A request waiting for room looks its prompt up again every step, and one recomputed after
    a preemption looks it up once more: the counters count each request once, at its first
    admission (6 blocks: "a" holds 4 and grows to 6, "b" shares a's first 2 and needs 3 more)."""
    kv = KVCacheManager(6, BS, True)
    sched = Scheduler(kv, 4, 64, 1024)
    a = req("a", range(16), max_tokens=8, ignore_eos=True)
    b = req("b", list(range(8)) + list(range(50, 62)), max_tokens=4, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    waited = 0
    while b.num_cached_tokens < 0:
        out = sched.schedule()
        waited += 1
        sched.update_from_output(out, [[7] if s.samples else [] for s in out.scheduled])
    assert waited > 2 and a.is_finished and b.num_cached_tokens == 8
    assert (kv.prefix_queries, kv.prefix_hits) == (16 + 20, 8)
    sched._preempt(sched.running.pop())
    out = sched.schedule()
    assert out.scheduled[0].num_computed_before == 20  # found its blocks again, not counted again
    assert (kv.prefix_queries, kv.prefix_hits) == (16 + 20, 8)


def test_caching_off_never_hits():
    kv = KVCacheManager(16, BS, False)
    admit(kv, req("a", range(10)))
    assert admit(kv, req("b", range(10))) == 0
    assert not kv.pool.cached


# -- end to end on the default model ----------------------------------------------------
import pytest  # noqa: E402

from pagedllm import LLM  # noqa: E402
from tests.utils import pool_is_whole  # noqa: E402

SYSTEM = (
    "You are a meticulous assistant for a hardware store. Answer in one short sentence, "
    "mention the aisle number when you can, and never invent prices."
)


@pytest.fixture(scope="module")
def engines():
    on = LLM(dtype="float32", kv_cache_memory="64MiB", enable_prefix_caching=True)
    off = LLM(dtype="float32", kv_cache_memory="64MiB", enable_prefix_caching=False)
    yield on, off
    assert pool_is_whole(on) and pool_is_whole(off)


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_shared_system_prompt_same_output_on_and_off(engines):
    on, off = engines
    questions = ["Where are the hammers?", "Do you sell paint?", "Where can I find screws?", "Any ladders?"]
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    first = on.chat(convs[:1], params)  # fills the cache with the system prompt
    rest = on.chat(convs[1:], params)
    assert on.engine.core.kv_cache.prefix_hits > 0
    assert _tokens(first + rest) == _tokens(off.chat(convs, params))
    assert rest[0].num_cached_tokens > 0


def test_n_samples_share_prompt_blocks_and_match(engines):
    on, off = engines
    prompt = "Write a list of tools: " + "hammer, saw, drill, " * 6
    params = SamplingParams(n=4, temperature=0.8, seed=11, max_tokens=16)
    got = on.generate([prompt], params)
    assert _tokens(got) == _tokens(off.generate([prompt], params))


def test_preemption_with_caching_matches(engines):
    _, off = engines
    prompts = [f"{SYSTEM} Question {i}: what is aisle {i}?" for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = _tokens(off.generate(prompts, params))
    tight = LLM(dtype="float32", num_gpu_blocks_override=16, enable_prefix_caching=True)
    assert _tokens(tight.generate(prompts, params)) == expected
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert pool_is_whole(tight)


def test_hit_count_is_block_arithmetic():
    llm = LLM(dtype="float32", kv_cache_memory="32MiB", block_size=16)
    kv = llm.engine.core.kv_cache
    prompt = list(range(1000, 1050))  # 50 tokens: 3 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([prompt], params)
    assert (kv.prefix_queries, kv.prefix_hits) == (50, 0)
    llm.generate([prompt], params)
    assert (kv.prefix_queries, kv.prefix_hits) == (100, 48)  # (50 - 1) // 16 full blocks
    llm.generate([prompt[:40] + [7, 8, 9]], params)  # shares 2 full blocks
    assert (kv.prefix_queries, kv.prefix_hits) == (143, 80)
    llm.generate([prompt[:32]], params)  # whole prompt cached: its last block is recomputed
    assert (kv.prefix_queries, kv.prefix_hits) == (175, 96)


def test_hybrid_groups_never_hand_one_block_to_two_groups():
    """A free cached block that one group is about to reuse must not be taken as another group's new block."""
    import random

    from pagedllm.core.kv_cache_groups import KVCacheGroup

    groups = (KVCacheGroup((0,), 0), KVCacheGroup((1,), 8))  # global + sliding window of 8 tokens
    for seed in range(6):
        rng = random.Random(seed)
        kv = KVCacheManager(20, BS, True, groups)
        sched = Scheduler(kv, 6, 24, 256)
        prefixes = [[rng.randint(10, 90) for _ in range(8)] for _ in range(3)]
        for i in range(24):
            prompt = rng.choice(prefixes) + [rng.randint(10, 90) for _ in range(rng.randint(1, 14))]
            sched.add_request(req(f"r{i}", prompt, max_tokens=rng.randint(2, 12), ignore_eos=True))
            for _ in range(1 if i < 23 else 200):
                out = sched.schedule()
                sched.update_from_output(out, [[7] if s.samples else [] for s in out.scheduled])
                held: dict[int, list[int]] = {}  # block id -> the groups whose tables hold it
                for tables in kv.req_blocks.values():
                    for g, blocks in enumerate(tables):
                        for b in blocks:
                            if b is not None:
                                held.setdefault(b.block_id, []).append(g)
                for block_id, gs in held.items():
                    assert len(set(gs)) == 1, f"seed {seed}: block {block_id} in groups {gs}"
                    assert kv.pool.blocks[block_id].ref_cnt == len(gs)


def test_a_prompts_last_token_alone_gives_the_cold_runs_bits():
    """Under dtype auto (int8 activations), a prompt of 5 blocks + 1 token: the warm run's hit
    leaves the last token alone, a budget of 80 tokens cuts it into a chunk of its own; both
    take the prefill kernel, as the cold run's whole prompt does, so the first token's
    logprobs are the cold run's bit for bit (the decode kernel's other summation order moved
    them by up to 0.2 through int8 rounding edges)."""
    prompt = list(range(1000, 1081))
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)

    def first_logprobs(llm):
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return out.num_cached_tokens, {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}

    with LLM(kv_cache_memory="32MiB", max_model_len=256) as llm:
        (cold_hit, cold), (warm_hit, warm) = first_logprobs(llm), first_logprobs(llm)
    with LLM(kv_cache_memory="32MiB", max_model_len=256, max_num_batched_tokens=80, enable_prefix_caching=False) as llm:
        _, chunked = first_logprobs(llm)
    assert (cold_hit, warm_hit) == (0, 80)
    assert warm == cold and chunked == cold
