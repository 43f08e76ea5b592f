"""One bad request must never take the engine down: faults injected into one request's
scheduling, logits, sampling or sampled token fail that request alone, the others in the same
batch finish with the tokens they get without it, and every block returns to the pool."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.outputs import RequestOutput
from tests import utils
from tests.fault_injection import FAULTY_RUNNER
from tests.utils import pool_is_whole

PROMPTS = [*utils.PROMPTS, "The largest planet in the solar system is", "A haiku about the sea:"]
# Greedy with logprobs, and seeded sampling: a retried batch must not change either.
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12),
]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(dtype="float32", kv_cache_memory="128MiB", max_model_len=512, enable_prefix_caching=False,
                 model_runner_cls=FAULTY_RUNNER)
    yield engine
    assert pool_is_whole(engine)


def run(llm: LLM, fault: str | None) -> dict[str, RequestOutput]:
    """The 8 prompts (alternating PARAMS), plus one request marked for ``fault``, in one batch."""
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"ok-{i}", prompt, PARAMS[i % 2])
    if fault is not None:
        engine.add_request("bad", "Tell me a story about a dragon.", PARAMS[0], cache_salt=f"fault:{fault}")
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


@pytest.fixture(scope="module")
def baseline(llm) -> dict[str, RequestOutput]:
    return run(llm, None)


@pytest.mark.parametrize("fault", ["sample", "logits", "token"])
def test_fault_fails_only_its_request(llm, baseline, fault: str) -> None:
    finals = run(llm, fault)
    bad = finals.pop("bad").outputs[0]
    assert bad.finish_reason == "error"
    assert bad.error and bad.token_ids == [] and bad.text == ""
    assert set(finals) == set(baseline)
    for rid, out in finals.items():
        want = baseline[rid].outputs[0]
        got = out.outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), rid
        if want.logprobs is not None:
            assert [sorted(e) for e in got.logprobs] == [sorted(e) for e in want.logprobs]
    assert pool_is_whole(llm)
    assert not llm.engine.core.scheduler.requests  # nothing left behind in the core


def test_fault_mid_generation_keeps_nothing_behind(llm) -> None:
    """A request that already has tokens and blocks fails later: its blocks are freed too."""
    engine = llm.engine
    engine.add_request("long", "Count from one to fifty:", SamplingParams(temperature=0.0, max_tokens=40))
    for _ in range(4):
        engine.step()
    request = engine.core.scheduler.requests["long-0"]
    assert request.num_output_tokens > 0
    request.cache_salt = "fault:sample"  # from now on its sampling raises
    finals = [o for _ in range(3) for o in engine.step() if o.finished]
    assert [o.outputs[0].finish_reason for o in finals] == ["error"]
    assert finals[0].outputs[0].token_ids  # the tokens it had before the fault are kept
    assert pool_is_whole(llm)


def test_scheduling_fault_fails_only_its_request(llm, baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = llm.engine.core.kv_cache
    allocate = kv.allocate_slots

    def failing(request, *args, **kwargs):
        if request.request_id == "bad-0":
            raise RuntimeError("injected scheduling fault")
        return allocate(request, *args, **kwargs)

    monkeypatch.setattr(kv, "allocate_slots", failing)
    finals = run(llm, "none")
    assert finals.pop("bad").outputs[0].finish_reason == "error"
    assert {rid: o.outputs[0].token_ids for rid, o in finals.items()} == {
        rid: o.outputs[0].token_ids for rid, o in baseline.items()
    }
    assert pool_is_whole(llm)


@pytest.mark.parametrize("fault", ["sample", "logits", "token"])
def test_fault_during_speculative_verification(fault: str) -> None:
    """With n-gram drafts the rejection sampler verifies: a fault there fails its request alone."""
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, enable_prefix_caching=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3}, model_runner_cls=FAULTY_RUNNER)
    # Repetitive prompts so that the n-gram proposer has drafts to verify.
    prompts = [f"{i} {i} {i} {i} {i} {i} {i} {i}" for i in range(1, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    baseline = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"ok-{i}", prompt, params)
    engine.add_request("bad", "a b c a b c a b c a b c", params)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        bad = engine.core.scheduler.requests.get("bad-0")
        if bad is not None and bad.spec_token_ids:  # drafts to verify next step: the fault hits there
            bad.cache_salt = f"fault:{fault}"
    failed = finals.pop("bad").outputs[0]
    assert failed.finish_reason == "error"
    if fault != "token":  # an id outside the vocabulary is caught after any sampler, with one message
        assert "verification failed" in failed.error
    assert [finals[f"ok-{i}"].outputs[0].token_ids for i in range(len(prompts))] == baseline
    assert engine.core.scheduler.spec_stats.num_drafts > 0
    assert pool_is_whole(llm)
