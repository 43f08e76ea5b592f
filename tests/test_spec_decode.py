"""Speculative decoding: configuration, n-gram lookup, exact rejection sampling, scheduling with
drafts (rollback, budget, block pool), stop conditions inside accepted runs, and greedy outputs
token-identical with speculation on and off on the default model, for both proposers."""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np
import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.rejection_sampler import RejectionSampler
from pagedllm.layers.sampling_metadata import SamplingMetadata, SamplingRow
from pagedllm.models.loader import load_tokenizer, resolve_model
from pagedllm.outputs import TokenLogprobs
from pagedllm.speculative_config import SpeculativeConfig
from pagedllm.spec_decode.ngram_proposer import NgramProposer, find_ngram_drafts
from tests.utils import assert_pool_whole, pool_is_whole

EOS = 2
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


# -- configuration ----------------------------------------------------------------------------
def test_config_parses_vllm_shapes() -> None:
    ngram = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (ngram.method, ngram.num_speculative_tokens, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (
        "ngram", 3, 4, 4
    )
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    draft = SpeculativeConfig.parse({"method": "draft_model", "model": "x", "num_speculative_tokens": 4})
    assert draft.model == "x" and EngineConfig(speculative_config=draft).speculative_config is draft
    assert EngineConfig(speculative_config=None).speculative_config is None
    # vLLM infers the method from the model when none is given
    assert SpeculativeConfig.parse({"model": "x", "num_speculative_tokens": 2}).method == "draft_model"
    lookup = SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2})
    assert (lookup.method, lookup.model) == ("ngram", None)


@pytest.mark.parametrize(
    "value, match",
    [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2}, "needs a method"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "only for method 'draft_model'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "positive integer"),
    ],
)
def test_bad_configs_raise(value, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(speculative_config=value)  # fails in EngineConfig, before any model is loaded


def test_cli_flag_reaches_the_engine_kwargs() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    config = EngineConfig(speculative_config=EngineArgs.from_cli_args(args).kwargs()["speculative_config"])
    assert config.speculative_config.num_speculative_tokens == 2


# -- n-gram lookup ----------------------------------------------------------------------------
def ngram(tokens: list[int], k: int = 4, lo: int = 2, hi: int = 5) -> list[int]:
    return find_ngram_drafts(np.array(tokens, dtype=np.int64), k, lo, hi)


def test_ngram_longest_suffix_most_recent_occurrence() -> None:
    # Suffix [1, 2, 3] occurs at 0 (followed by 4 9 ...) and, one shorter, [2, 3] at 6 (then 8).
    assert ngram([1, 2, 3, 4, 9, 9, 2, 3, 8, 8, 1, 2, 3]) == [4, 9, 9, 2]
    # Two occurrences of the longest match: the most recent one wins.
    assert ngram([5, 6, 1, 5, 6, 2, 5, 6], lo=1) == [2, 5, 6, 2]
    assert ngram([1, 2, 3, 4], lo=1) == []  # no earlier occurrence at all
    assert ngram([7, 1, 2, 9, 2], lo=2) == []  # only a 1-gram matches
    assert ngram([7, 1, 2, 9, 2], lo=1) == [9, 2, 9, 2]


def test_ngram_overlapping_copy_keeps_the_period() -> None:
    assert ngram([4, 1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]
    assert ngram([3, 3, 3], k=3, lo=1) == [3, 3, 3]


def test_ngram_proposer_caps_at_max_tokens_and_frees_state() -> None:
    proposer = NgramProposer(4, 1, 3)
    req = Request("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=3), [EOS], 64)
    proposer.propose([req])
    assert req.spec_token_ids == [3, 1] and req.spec_probs is None  # max_tokens - 1 drafts
    req.append_output_token(3)
    proposer.propose([req])  # the buffer grows by the new token only
    assert req.spec_token_ids == [1]
    proposer.remove_finished(set())
    assert not proposer._buffers


# -- rejection sampling ------------------------------------------------------------------------
def reference_probs(logits: torch.Tensor, params: SamplingParams, output: list[int]) -> torch.Tensor:
    """The target distribution by the textbook definitions (full sort), independent of sampler.py."""
    x = logits.clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=len(x)).float()
    x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    probs = (x / params.temperature).softmax(-1)
    values, order = probs.sort(descending=True)
    keep = values >= params.min_p * values[0]  # min-p first, as vLLM V1
    if params.top_k:
        keep[params.top_k :] = False
    kept = values * keep
    before = (kept / kept.sum()).cumsum(0) - kept / kept.sum()
    keep &= before < params.top_p
    out = torch.zeros_like(probs)
    out[order] = values * keep
    return out / out.sum()


def run_verifications(
    logits: torch.Tensor,
    params: SamplingParams,
    num_trials: int,
    q: torch.Tensor | None = None,
    fixed_drafts: list[int] | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """``num_trials`` independent requests with the same target logits [k + 1, V]; drafts drawn
    from ``q`` [k, V] (or the same ``fixed_drafts`` for all, q one-hot). One sampler call."""
    torch.manual_seed(seed)
    k = len(logits) - 1
    if q is not None:
        drafts = torch.multinomial(q, num_trials, replacement=True).T.tolist()  # [trials, k]
    else:
        drafts = [list(fixed_drafts)] * num_trials
    rows = [
        SamplingRow(params=params, prompt_token_ids=[], output_token_ids=d[:j])
        for d in drafts
        for j in range(k + 1)
    ]
    return RejectionSampler()(
        logits.repeat(num_trials, 1),
        SamplingMetadata.build(rows),
        drafts,
        [q] * num_trials,
        [None] * num_trials,
    )


def assert_emits_target(results: list[list[int]], expected: list[torch.Tensor], num_trials: int) -> None:
    """Token i, among the runs that emitted it, is distributed as expected[i] (5-sigma cells)."""
    for i, p in enumerate(expected):
        tokens = [r[i] for r in results if len(r) > i]
        m = len(tokens)
        assert m > num_trials // 20, f"position {i} emitted too rarely to test ({m})"
        freq = torch.bincount(torch.tensor(tokens), minlength=len(p)).double() / m
        tolerance = 5 * torch.sqrt(p.double() * (1 - p.double()) / m) + 1e-9
        assert ((freq - p.double()).abs() <= tolerance).all(), (i, freq, p)


TRIALS = 20_000
V = 8


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.7),
        SamplingParams(top_k=5, top_p=0.8, min_p=0.1),
    ],
)
def test_rejection_sampling_with_draft_probs_preserves_the_target(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=gen) * 1.5  # k = 2 drafts, then the bonus position
    # A draft that roughly agrees with the target, as a real one does, so bonus tokens are common.
    q = (logits[:2] + 0.7 * torch.randn(2, V, generator=gen)).softmax(-1)
    results = run_verifications(logits, params, TRIALS, q=q)
    assert all(1 <= len(r) <= 3 for r in results)
    assert_emits_target(results, [reference_probs(row, params, []) for row in logits], TRIALS)


def test_rejection_sampling_of_fixed_drafts_preserves_the_target_with_penalties() -> None:
    """n-gram drafts (q one-hot); position j's p counts drafts 0..j-1 as output (penalties)."""
    params = SamplingParams(temperature=0.9, top_k=6, presence_penalty=0.5, frequency_penalty=0.7)
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, V, generator=gen)
    drafts = [0, 0, 3]  # token 0 twice: the second is penalized by the first
    logits[0, 0] += 3.0  # likely enough to be accepted often, so later positions are reached
    logits[1, 0] += 4.0
    logits[2, 3] += 2.0
    results = run_verifications(logits, params, TRIALS, fixed_drafts=drafts)
    expected = [reference_probs(row, params, drafts[:j]) for j, row in enumerate(logits)]
    assert_emits_target(results, expected, TRIALS)


def test_draft_outside_top_k_is_never_accepted() -> None:
    params = SamplingParams(top_k=2)
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    results = run_verifications(logits, params, 2000, fixed_drafts=[3])
    assert all(len(r) == 1 and r[0] in (0, 1) for r in results)


def test_greedy_accepts_exactly_the_argmax_prefix() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 1.0, 5.0], [1.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    assert run_verifications(logits, greedy, 1, fixed_drafts=[1, 0, 1])[0] == [1, 0, 2]
    assert run_verifications(logits, greedy, 1, fixed_drafts=[1, 0, 2])[0] == [1, 0, 2, 0]  # + bonus
    assert run_verifications(logits, greedy, 1, fixed_drafts=[2, 0, 2])[0] == [1]


def test_seeded_request_does_not_depend_on_the_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=5)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, V, generator=gen)
    q = torch.randn(2, V, generator=gen).softmax(-1)
    drafts = [[1, 2], [3, 4], [5, 6]]
    sampler = RejectionSampler()

    def run(batch: list[int], seeded_at: int) -> list[int]:
        rows = [
            SamplingRow(params=params if b == seeded_at else SamplingParams(), prompt_token_ids=[], output_token_ids=[])
            for b in batch
            for _ in range(3)
        ]
        gens = [torch.Generator().manual_seed(5) if b == seeded_at else None for b in batch]
        out = sampler(logits.repeat(len(batch), 1), SamplingMetadata.build(rows), [drafts[b] for b in batch],
                      [q] * len(batch), gens)
        return out[batch.index(seeded_at)]

    assert run([0], 0) == run([1, 0, 2], 0) == run([2, 1, 0], 0)


# -- scheduling with drafts (fake model) --------------------------------------------------------
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


def test_stop_string_inside_an_accepted_run_cuts_tokens_too(tokenizer) -> None:
    """The front end ends the output at the token completing the stop string, even mid-update."""
    prompt = tokenizer.encode("Fruits:")
    tokens = tokenizer.encode(" apple, banana, cherry, date")
    stop_at = next(i for i in range(len(tokens)) if "banana" in tokenizer.decode(tokens[: i + 1]))
    params = SamplingParams(stop=["banana"], logprobs=0)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [EngineCoreRequest("r-0", prompt, params, [EOS], 0.0)])
    lp = TokenLogprobs([[t] for t in tokens], [[-0.5] for _ in tokens], [1 for _ in tokens])
    outputs, to_abort = processor.process_outputs([EngineCoreOutput("r-0", tokens, logprobs=lp)], 0.0)
    (out,) = outputs[0].outputs
    assert to_abort == ["r-0"] and out.finish_reason == "stop" and out.text == " apple, "
    assert out.token_ids == tokens[: stop_at + 1] and len(out.logprobs) == stop_at + 1


# -- end to end on the default model ------------------------------------------------------------
COPY = (
    "Repeat this list with one change, replacing kiwi by mango: apple, banana, cherry, date, "
    "elderberry, fig, grape, honeydew, kiwi, lemon, lime, nectarine, orange, papaya.\nAnswer: apple, banana,"
)
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
GRAPE = 17040  # " grape": the greedy copy of COPY's list reaches it mid-run of accepted n-gram drafts
# A mixed batch; the stops sit inside the copied list, where n-gram drafts are accepted in runs.
PROMPTS = [COPY, CODE, "The capital of France is", COPY, COPY, "1, 2, 3, 4, 5,", COPY]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=40, logprobs=1),
    SamplingParams(temperature=0.0, max_tokens=32, stop=["mul", "return a *"]),
    SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.2),
    SamplingParams(temperature=0.0, max_tokens=36, stop_token_ids=[GRAPE]),
    SamplingParams(temperature=0.0, max_tokens=7),
    SamplingParams(temperature=0.0, max_tokens=30, min_tokens=12, presence_penalty=0.5),
    SamplingParams(temperature=0.0, max_tokens=40, stop=["honeydew"]),
]
LLM_ARGS = {"dtype": "float32", "kv_cache_memory": "128MiB"}


@pytest.fixture(scope="module")
def base() -> LLM:
    return LLM(**LLM_ARGS)


@pytest.fixture(scope="module")
def tokenizer(base: LLM):
    return base.get_tokenizer()


@pytest.fixture(scope="module")
def expected(base: LLM):
    return base.generate(PROMPTS, PARAMS, use_tqdm=False)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer llama with the default model's vocabulary: a poor but valid draft."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2,
    )
    path = tmp_path_factory.mktemp("tiny_draft")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


SPEC_CONFIGS = {
    "ngram": NGRAM,
    "self_draft": {"method": "draft_model", "model": "SmolLM2-135M-Instruct", "num_speculative_tokens": 3},
    "tiny_draft": {"method": "draft_model", "model": None, "num_speculative_tokens": 3},  # model: the fixture's
}


@pytest.fixture(scope="module", params=list(SPEC_CONFIGS))
def spec_llm(request: pytest.FixtureRequest, tiny_draft: str) -> tuple[str, LLM]:
    """(proposer name, an engine with that proposer); one at a time (pytest groups by param)."""
    config = dict(SPEC_CONFIGS[request.param])
    if request.param == "tiny_draft":
        config["model"] = tiny_draft
    llm = LLM(**LLM_ARGS, speculative_config=config)
    yield request.param, llm
    assert pool_is_whole(llm)
    if request.param != "ngram":  # the draft model's own cache is whole too once all requests ended
        draft = llm.engine.core.proposer
        assert draft.kv_cache.pool.num_free_blocks == draft.kv_cache.pool.num_blocks and not draft.seqs


def test_greedy_outputs_identical_with_speculation(spec_llm: tuple[str, LLM], expected) -> None:
    proposer, llm = spec_llm
    got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for want, have, params in zip(expected, got, PARAMS):
        a, b = want.outputs[0], have.outputs[0]
        assert b.token_ids == a.token_ids, (proposer, want.prompt)
        assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason, a.stop_reason)
        if params.max_tokens == 7:
            assert len(b.token_ids) == 7
        if params.logprobs is not None:
            assert len(b.logprobs) == len(a.logprobs)
            for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids):
                assert math.isclose(x[t].logprob, y[t].logprob, abs_tol=1e-3)
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens > 0
    if proposer == "self_draft":  # the same model drafting greedily: every draft is the argmax
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    if proposer == "ngram":
        assert stats.spec_num_accepted_tokens > 0.3 * stats.spec_num_draft_tokens
    assert pool_is_whole(llm)


def test_sampling_with_speculation_is_seeded_and_leaves_the_pool_whole(spec_llm: tuple[str, LLM]) -> None:
    """Random sampling end to end (draft models hand q to the verifier); a seeded request's
    output does not depend on its batch."""
    proposer, llm = spec_llm
    if proposer == "self_draft":
        pytest.skip("the tiny draft covers the draft-model path at a fraction of the cost")
    drafts_before = llm.engine.core.stats().spec_num_drafts
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=12)
    alone = llm.generate([COPY], params, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(
        ["Hello", COPY, CODE], [SamplingParams(max_tokens=4), params, SamplingParams(temperature=1.0, max_tokens=8)],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone and len(alone) <= 12
    assert llm.engine.core.stats().spec_num_drafts > drafts_before
    assert pool_is_whole(llm)


def test_no_drafts_while_the_batch_is_large(spec_llm: tuple[str, LLM]) -> None:
    proposer, llm = spec_llm
    if proposer != "ngram":
        pytest.skip("the rule is the engine's, not the proposer's")
    config = llm.engine.core.config
    original = config.speculative_config
    config.speculative_config = dataclasses.replace(original, disable_by_batch_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8)
        before = llm.engine.core.stats().spec_num_drafts
        llm.generate([COPY, COPY], params, use_tqdm=False)  # two running: no drafts
        assert llm.engine.core.stats().spec_num_drafts == before
        llm.generate([COPY], params, use_tqdm=False)
        assert llm.engine.core.stats().spec_num_drafts > before
    finally:
        config.speculative_config = original


def test_sampled_drafts_the_grammar_forbids_keep_the_target_distribution(tiny_draft: str, tmp_path) -> None:
    """A draft model's sampled draft that the grammar forbids is verified (and so rejected),
    not cut: the token at its position comes from max(p - q, 0). Drawing it from p instead
    made the allowed token q favours 1.4x as frequent as without speculation. The target is a
    random model with peaked logits (and the tokenizer its grammar needs); drafts come from a
    fixed q."""
    num = 300
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    load_tokenizer(resolve_model("smollm2")).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="64MiB", max_model_len=64,
              speculative_config={"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 1})
    core = llm.engine.core
    regex = StructuredOutputsParams(regex="[ab]+")
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, structured_outputs=regex) for s in range(num)]

    def later_tokens(outputs) -> list[int]:  # drafts start at the second token
        return [t for o in outputs for t in o.outputs[0].token_ids[1:]]

    core.proposer.propose = lambda requests: None
    base = later_tokens(llm.generate(["Letters:"] * num, params, use_tqdm=False))
    allowed = collections.Counter(base).most_common(1)[0][0]
    forbidden = llm.get_tokenizer().convert_tokens_to_ids("z")
    q = torch.zeros(config.vocab_size)
    q[allowed], q[forbidden] = 0.5, 0.5
    gen = torch.Generator().manual_seed(0)

    def propose(requests) -> None:
        for r in requests:
            r.spec_token_ids = [allowed if torch.rand(1, generator=gen).item() < q[allowed] else forbidden]
            r.spec_probs = q.unsqueeze(0)

    core.proposer.propose = propose
    spec = later_tokens(llm.generate(["Letters:"] * num, params, use_tqdm=False))
    assert core.stats().spec_num_drafts > 0
    p = base.count(allowed) / len(base)
    assert abs(spec.count(allowed) / len(spec) - p) <= 4 * math.sqrt(2 * p * (1 - p) / len(base))
    assert pool_is_whole(llm)
    llm.shutdown()
