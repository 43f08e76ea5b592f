"""Sampler: greedy rows, temperature, seeded and unseeded generators, mixed greedy and random batches."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.sampler import Sampler
from pagedllm.layers.sampling_metadata import SamplingMetadata
from tests.utils import row, sample

pytestmark = pytest.mark.usefixtures("draw_impl")  # each test on the native kernels and in PyTorch (conftest.py)


def test_greedy_is_argmax_first_index_on_ties() -> None:
    logits = torch.randn(64, 3000)
    logits[5, [7, 9]] = 100.0  # a tie: argmax's first index
    out = sample(logits, [row(temperature=0.0)] * 64)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids[5] == 7
    assert out.logprobs is None


def test_all_greedy_step_is_one_reduction() -> None:
    logits = torch.randn(64, 4096)
    meta = SamplingMetadata.build([row(temperature=0.0)] * 64)
    assert meta.all_greedy and meta.no_penalties and meta.no_top_k_top_p
    assert meta.max_num_logprobs is None
    with torch.profiler.profile() as prof:
        out = Sampler()(logits, meta)
    ops = {e.key for e in prof.key_averages()}
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert not ops & {"aten::softmax", "aten::_softmax", "aten::sort", "aten::topk", "aten::clone"}


def test_temperature_only_batch_neither_sorts_nor_selects() -> None:
    logits = torch.randn(64, 4096)
    with torch.profiler.profile() as prof:
        sample(logits, [row(temperature=0.8)] * 32 + [row(temperature=1.3)] * 32)
    ops = {e.key for e in prof.key_averages()}
    assert not ops & {"aten::sort", "aten::topk", "aten::multinomial", "aten::exponential_"}


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    vocab = 500
    seeded_logits = torch.randn(vocab)
    params = dict(temperature=0.9, top_p=0.95, top_k=200)

    def run(batch_size: int, position: int, seed: int) -> list[int]:
        seeded = row(seed=seed, **params)  # one generator, advanced step after step
        tokens = []
        for step in range(20):
            logits = torch.randn(batch_size, vocab) * 2
            logits[position] = seeded_logits
            # Neighbours: greedy, unseeded and seeded random rows, changing every step.
            rows = [
                row(temperature=float(i % 2), seed=step * i if i % 3 == 0 else None)
                for i in range(batch_size)
            ]
            rows[position] = seeded
            tokens.append(sample(logits, rows).sampled_token_ids[position].item())
        return tokens

    alone = run(1, 0, seed=1234)
    assert run(7, 3, seed=1234) == alone
    assert run(16, 15, seed=1234) == alone
    assert run(7, 3, seed=4321) != alone


def test_unseeded_rows_share_the_global_generator() -> None:
    logits = torch.zeros(16, 1000)
    torch.manual_seed(7)
    first = sample(logits, [row()] * 16).sampled_token_ids
    torch.manual_seed(7)
    assert torch.equal(sample(logits, [row()] * 16).sampled_token_ids, first)


def test_temperature_reshapes_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    n = 20000
    for temperature in (0.5, 1.0, 2.0):
        batch = logits.expand(n, -1).contiguous()
        tokens = sample(batch, [row(temperature=temperature)] * n).sampled_token_ids
        freq = torch.bincount(tokens, minlength=3).float() / n
        expected = (logits / temperature).softmax(-1)
        assert torch.allclose(freq, expected, atol=0.015), temperature


def test_mixed_batch_of_greedy_and_random_rows() -> None:
    logits = torch.randn(8, 1000) * 2
    rows = [
        row(temperature=0.0),
        row(temperature=0.9, top_k=1),  # random but forced to the argmax
        row(temperature=1.2),
        row(temperature=0.0, top_k=3),  # greedy ignores sampling settings
        row(temperature=0.5, min_p=1.0),  # only the most likely token
        row(temperature=1.0, seed=3),
        row(temperature=0.0),
        row(temperature=1.0, top_p=0.01),  # only the most likely token
    ]
    meta = SamplingMetadata.build(rows)
    assert meta.random_rows.tolist() == [1, 2, 4, 5, 7]
    tokens = Sampler()(logits, meta).sampled_token_ids
    argmax = logits.argmax(-1)
    for i in (0, 1, 3, 4, 6, 7):
        assert tokens[i] == argmax[i]
    # The unconstrained rows are draws, not argmaxes (flat enough that 20 tries suffice).
    flat = torch.zeros(20, 1000)
    flat_rows = [row(temperature=0.0), row(temperature=1.0)] * 10
    drawn = sample(flat, flat_rows).sampled_token_ids
    assert set(drawn[0::2].tolist()) == {0} and len(set(drawn[1::2].tolist())) > 1


def test_tiny_temperatures_flat_rows_and_banned_tokens() -> None:
    """A tiny temperature draws the most likely token; a flat row at the largest temperature
    spreads over every token not banned (its candidates widen to the whole vocabulary); -inf
    never wins."""
    vocab, n = 3000, 2000
    logits = torch.randn(vocab) * 3
    logits[::3] = float("-inf")
    best = int(logits.argmax())
    batch = logits.expand(n, -1).contiguous()
    for params in (dict(temperature=1e-4), dict(temperature=1e-4, top_p=0.5), dict(temperature=1e-4, min_p=0.5)):
        assert set(sample(batch, [row(**params)] * n).sampled_token_ids.tolist()) == {best}, params
    flat = (batch * 1e-3).contiguous()
    for params in (dict(temperature=2.0), dict(temperature=2.0, top_p=0.99), dict(temperature=2.0, top_k=1500)):
        drawn = sample(flat, [row(**params)] * n).sampled_token_ids
        assert bool(torch.isfinite(logits[drawn]).all()), params
        assert len(set(drawn.tolist())) > 0.4 * n, params
