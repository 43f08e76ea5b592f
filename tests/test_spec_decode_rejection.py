"""Speculative decoding's rejection sampler: accepted and resampled tokens keep the target distribution exactly."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.layers.rejection_sampler import RejectionSampler
from pagedllm.layers.sampling_metadata import SamplingMetadata, SamplingRow


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
