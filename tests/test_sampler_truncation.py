"""Sampler: top-k, top-p and min-p keep exactly the expected tokens, the nucleus's size against a full sort."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.logprobs import largest
from pagedllm.layers.sampler import _nucleus_size
from tests.utils import row, sample

pytestmark = pytest.mark.usefixtures("draw_impl")  # each test on the native kernels and in PyTorch (conftest.py)


def sampled_set(probs: list[float], n: int = 4000, **params: object) -> set[int]:
    """The tokens drawn in ``n`` rows that all have distribution ``probs``."""
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()
    return set(sample(logits, [row(**params)] * n).sampled_token_ids.tolist())


@pytest.mark.parametrize(
    ("probs", "params", "kept"),
    [
        ([0.05, 0.3, 0.1, 0.25, 0.2, 0.1], dict(top_k=2), {1, 3}),
        ([0.05, 0.3, 0.1, 0.25, 0.2, 0.1], dict(top_k=1), {1}),
        # mass before token 1: 0.4 < 0.6, before token 2: 0.7 >= 0.6
        ([0.4, 0.3, 0.2, 0.1], dict(top_p=0.6), {0, 1}),
        ([0.4, 0.3, 0.2, 0.1], dict(top_p=0.75), {0, 1, 2}),
        ([0.4, 0.3, 0.2, 0.1], dict(top_p=0.3), {0}),
        # top-p on the top-k distribution renormalized: 4/7 >= 0.5 before token 1.
        ([0.4, 0.3, 0.2, 0.1], dict(top_k=2, top_p=0.5), {0}),
        ([0.5, 0.3, 0.1, 0.06, 0.04], dict(min_p=0.15), {0, 1, 2}),  # p >= 0.075
        ([0.5, 0.3, 0.1, 0.06, 0.04], dict(min_p=0.15, top_k=2), {0, 1}),
        ([0.5, 0.3, 0.1, 0.06, 0.04], dict(min_p=0.7, top_p=0.9), {0}),
        # min-p before top-p (vLLM V1): top_p of the 0.9 that min-p keeps is reached before token 2
        # (0.8 / 0.9 >= 0.85); on the whole distribution it would not be (0.8 < 0.85).
        ([0.5, 0.3, 0.1, 0.04, 0.03, 0.03], dict(min_p=0.1, top_p=0.85), {0, 1}),
        ([0.5, 0.3, 0.1, 0.04, 0.03, 0.03], dict(min_p=0.1, top_p=0.85, top_k=3), {0, 1}),
        ([0.5, 0.3, 0.1, 0.06, 0.04], dict(), {0, 1, 2, 3, 4}),
    ],
)
def test_truncation_keeps_exactly_the_expected_tokens(
    probs: list[float], params: dict[str, float], kept: set[int]
) -> None:
    assert sampled_set(probs, **params) == kept


def test_rows_keep_their_own_truncation_in_one_batch() -> None:
    probs = [0.5, 0.3, 0.1, 0.06, 0.04]
    settings = [dict(top_k=2), dict(min_p=0.15), dict(), dict(top_p=0.6, min_p=0.3)]
    kept = [{0, 1}, {0, 1, 2}, {0, 1, 2, 3, 4}, {0}]  # last: min-p keeps 0.5 + 0.3, top-p 0.6 of it 0.5
    n = 1000
    logits = torch.tensor(probs).log().expand(n * len(settings), -1).contiguous()
    rows = [row(**settings[i % len(settings)]) for i in range(n * len(settings))]
    drawn = sample(logits, rows).sampled_token_ids
    for i, expected in enumerate(kept):
        assert set(drawn[i :: len(settings)].tolist()) == expected, settings[i]


def _reference_size(probs: torch.Tensor, top_k: int, top_p: float) -> int:
    """vLLM's sort-based top-k then top-p, for one row: how many tokens it keeps."""
    top = probs.double().sort(descending=True).values
    top = top[:top_k] if top_k else top
    top = top / top.sum()
    return int((top.cumsum(0) - top < top_p).sum())


SETTINGS = [(0, 0.9), (50, 1.0), (0, 0.5), (30, 0.95), (40, 0.99), (0, 0.999), (1, 0.5)]


@pytest.mark.parametrize("num_candidates", [64, 1024, 20480])
def test_nucleus_size_matches_a_full_sort(num_candidates: int) -> None:
    vocab = 20480
    scales = [8.0, 4.0, 2.0, 1.0, 0.3, 0.05, 0.01]  # peaked to flat
    # Over 20480 tokens a float32 softmax row sums to 1 only within ~2e-6 (how far depends on
    # the CPU's vector width), and the reference renormalizes in float64: the window below
    # widens by each row's own error, so no draw on any machine lands outside it.
    gen = torch.Generator().manual_seed(0)
    probs = (torch.randn(len(scales), vocab, generator=gen) * torch.tensor(scales)[:, None]).softmax(-1)
    top = probs.topk(num_candidates, dim=-1).values
    for k, p in SETTINGS:
        column = torch.full((len(scales), 1), k or 2**62), torch.full((len(scales), 1), p)
        num_kept, complete = _nucleus_size(top, *column)
        for i in range(len(scales)):
            # float32 sums: a token whose mass before lies within 1e-6 (plus the row's error) of
            # p may go either way
            window = 1e-6 + abs(float(probs[i].double().sum()) - 1)
            low, high = (_reference_size(probs[i], k, p + d) for d in (-window, window))
            if complete[i]:
                assert low <= num_kept[i] <= high, (i, k, p)
            assert bool(complete[i]) == (low < num_candidates or 0 < k <= num_candidates)


def test_wide_nuclei_are_drawn_from_exactly() -> None:
    vocab, n = 2048, 4000
    logits = torch.linspace(2.0, 0.0, vocab)  # flat: nuclei of hundreds of tokens
    settings = [dict(top_p=0.5), dict(top_k=1500, top_p=0.8), dict(temperature=0.0)]
    rows = [row(**settings[i % 3]) for i in range(3 * n)]
    drawn = sample(logits.expand(3 * n, -1).contiguous(), rows).sampled_token_ids
    probs = logits.softmax(-1)
    for i, (k, p) in enumerate([(0, 0.5), (1500, 0.8)]):
        size = _reference_size(probs, k, p)
        assert 300 < size < 1500
        tokens = set(drawn[i::3].tolist())
        assert max(tokens) < size and len(tokens) > 0.9 * size  # linspace: token id = rank
    assert set(drawn[2::3].tolist()) == {0}


def test_two_stage_topk_gives_the_k_largest_values_even_with_ties() -> None:
    values = torch.cat([torch.randn(8, 64 * 512), torch.randint(0, 4, (8, 64 * 512)).float()])
    values[3, 5 * 64 : 9 * 64] = 50.0  # the largest values crowd into a few blocks
    for k in (0, 1, 64, 128, 200, 400, 1024, 5000):  # blocks of 64, 32, 16, 8, then none
        top, ids = largest(values, k)
        assert torch.equal(top, values.topk(k, dim=-1).values), k
        assert torch.equal(values.gather(1, ids), top)
        assert all(len(set(r)) == k for r in ids.tolist())  # distinct tokens
