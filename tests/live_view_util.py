"""The live view's scripted runs (the test_live_view_* modules): a scheduler and step recorder
over a small prefix-caching KV cache, driven by a fake model through shared prefixes,
preemptions, drafts, aborts and a prefix-cache reset, and a ``LiveView`` fed from it as the
front end feeds it.

Test modules import from here, never from one another.
"""

from __future__ import annotations

import random

from pagedllm.core.kv_cache_groups import KVCacheGroup
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)
from pagedllm.live_view.recorder import StepRecorder
from pagedllm.live_view.records import StepRecord
from pagedllm.live_view.view import LiveView
from pagedllm.sampling_params import SamplingParams

LIVE_VIEW_EOS = 2
LIVE_VIEW_BS = 4  # tokens per block
LIVE_VIEW_GLOBAL = (KVCacheGroup((0,), 0),)  # one KV cache group, no sliding window


def make_engine(groups, num_blocks=20, budget=24):
    """A scheduler (6 sequences, ``budget`` tokens a step, 256 tokens long) over a prefix-caching KV
    cache of ``num_blocks`` blocks of ``LIVE_VIEW_BS`` tokens in ``groups``, and its step recorder."""
    kv = KVCacheManager(num_blocks, LIVE_VIEW_BS, True, groups)
    recorder = StepRecorder(kv)
    return Scheduler(kv, 6, budget, 256), recorder


def make_request(rid, rng, prefixes):
    """A request: one of ``prefixes`` and 1-14 random tokens, then 2-12 tokens out, EOS ignored."""
    prompt = rng.choice(prefixes) + [rng.randint(10, 90) for _ in range(rng.randint(1, 14))]
    params = SamplingParams(max_tokens=rng.randint(2, 12), ignore_eos=True)
    return Request(rid, prompt, params, [LIVE_VIEW_EOS], 256)


def fake_step(sched, recorder, rng) -> StepRecord:
    """What EngineCore.step does, with a fake model that accepts a random run of each request's drafts."""
    for r in sched.running:  # a proposer's drafts for some decoding requests
        if r.num_output_tokens and rng.random() < 0.4:
            r.spec_token_ids = [rng.randint(10, 90) for _ in range(rng.randint(1, 3))]
    recorder.begin(sched)
    out = sched.schedule()
    entries = recorder.entries(out)
    sampled = []
    for s in out.scheduled:
        accepted = s.spec_token_ids[: rng.randint(0, len(s.spec_token_ids))]
        sampled.append(accepted + [7] if s.samples else [])
    sched.update_from_output(out, sampled)
    return recorder.finish(sched, sched.kv_cache.usage, entries, out, sampled)


def scripted_run(groups, seed):
    """A run with shared prefixes, preemptions, drafts, aborts and a prefix-cache reset; yields each record."""
    rng = random.Random(seed)
    sched, recorder = make_engine(groups)
    prefixes = [[rng.randint(10, 90) for _ in range(8)] for _ in range(3)]
    for i in range(24):
        sched.add_request(make_request(f"r{i}", rng, prefixes))
        yield fake_step(sched, recorder, rng), sched
        if i % 7 == 6 and sched.running:  # an abort between steps
            sched.finish_requests([sched.running[0].request_id], RequestStatus.FINISHED_ABORTED)
    while sched.num_unfinished:
        yield fake_step(sched, recorder, rng), sched
    assert sched.kv_cache.reset_prefix_cache()
    yield recorder.finish(sched, sched.kv_cache.usage), sched  # the idle record after the reset


def feed_view(max_steps=4096):
    """A LiveView fed as the front end feeds it: arrivals, then every record with its outputs."""
    view = LiveView(20, LIVE_VIEW_BS, [0], 24, max_steps=max_steps)
    for _ in fed_steps(view, stops=False):
        pass
    return view


def fed_steps(view, stops=True):
    """Feed ``view`` as the front end does, yielding after each change; ``stops``: now and then a
    stop string found by the front end finishes a request."""
    seen = set()
    for record, sched in scripted_run(LIVE_VIEW_GLOBAL, 4):
        for rid, r in sched.requests.items():
            if rid not in seen:
                seen.add(rid)
                view.on_arrival([EngineCoreRequest(rid, r.prompt_token_ids, r.sampling_params, [LIVE_VIEW_EOS],
                                                   r.arrival_time)])
        outputs = [EngineCoreOutput(e.request_id, [7] if e.decode or e.prefill else []) for e in record.scheduled]
        view.on_outputs(EngineCoreOutputs(outputs, timestamp=record.end, step=record))
        for e in record.scheduled[:1] if stops else ():
            if record.index % 9 == 8:
                view.on_finish([e.request_id], "stop", record.end)
        yield
