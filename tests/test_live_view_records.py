"""The live view's records: block accounting by replay, step entries, the ring buffer, traces, the cache dtype named."""

import json

import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_config import create_kv_cache_config
from pagedllm.core.kv_cache_groups import KVCacheGroup
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.live_view.block_map import BlockMap
from pagedllm.live_view.trace import trace_events
from pagedllm.live_view.view import LiveView
from pagedllm.models.loader import load_config, resolve_model
from tests.live_view_util import LIVE_VIEW_GLOBAL as GLOBAL
from tests.live_view_util import feed_view, scripted_run

HYBRID = (KVCacheGroup((0,), 0), KVCacheGroup((1,), 8))  # one global group, one sliding window of 8


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


def test_the_block_map_names_the_cache_dtype():
    """An engine's view states its K/V dtype beside the pool's size (the 8-bit caches hold
    about twice bfloat16's blocks in the same memory)."""
    config = EngineConfig(kv_cache_dtype=torch.int8, kv_cache_memory=2**26)
    kv = create_kv_cache_config(config, load_config(resolve_model(config.model)))
    shown = LiveView.for_engine(config, kv).config_json()
    assert shown["cache_dtype"] == "int8" and shown["num_blocks"] == kv.num_blocks

