"""Sampler: raw logprobs and ranks of sampled and prompt tokens, the native logprobs kernel against PyTorch."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.kernels import library
from pagedllm.layers.logprobs import RowLogprobs
from tests.utils import row, sample

pytestmark = pytest.mark.usefixtures("draw_impl")  # each test on the native kernels and in PyTorch (conftest.py)


def test_logprobs_are_raw_with_the_sampled_token_first() -> None:
    logits = torch.randn(6, 800) * 3
    original = logits.clone()
    rows = [
        row(temperature=0.0, logprobs=2),
        row(temperature=0.7, top_p=0.8, logprobs=5),
        row(temperature=1.0, repetition_penalty=1.8, output=[3], logprobs=0),
        row(temperature=0.0),
        row(min_p=0.2, logprobs=1),
        row(temperature=0.0, min_tokens=4, eos=[int(logits[5].argmax())], logprobs=3),
    ]
    out = sample(logits, rows)
    assert torch.equal(logits, original)  # the caller's logits are left as they were
    ids, lps, ranks = out.logprobs
    assert ids.shape == lps.shape == (6, 6) and ranks.shape == (6,)
    assert torch.equal(ids[:, 0], out.sampled_token_ids)
    raw = logits.log_softmax(-1)  # before penalties, temperature and truncation
    assert torch.allclose(lps, raw.gather(1, ids), atol=1e-5)
    assert torch.equal(ids[:, 1:], raw.topk(5, dim=-1).indices)
    expected_ranks = (raw > raw.gather(1, ids[:, :1])).sum(-1) + 1
    assert torch.equal(ranks, expected_ranks)
    assert ranks[0] == 1 and ranks[5] > 1  # greedy is rank 1; min_tokens masked the argmax


def test_compute_logprobs_for_prompt_positions() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    ids, lps, ranks = RowLogprobs()(logits, torch.tensor([2, 3]), 0)
    assert ids.tolist() == [[2], [3]]
    assert torch.allclose(lps[:, 0], torch.tensor([logits[0].log_softmax(0)[2], -math.log(4)]))
    assert ranks.tolist() == [2, 4]  # tied tokens count against the scored one, as in vLLM
    ids, lps, _ = RowLogprobs()(logits, torch.tensor([0, 3]), 2)
    assert ids[0].tolist()[0] == 0 and sorted(ids[0].tolist()[1:]) == [1, 2] and lps.shape == (2, 3)


@pytest.mark.skipif(not library.available(), reason="no native kernels here")
def test_native_logprobs_match_pytorch(draw_impl: str) -> None:
    """The kernel's log-probabilities, top tokens and ranks against PyTorch's, on rows of a
    length that is no multiple of the vector width, with banned (-inf) tokens and with ties
    (which the kernel orders by lower token id)."""
    if draw_impl == "pytorch":
        pytest.skip("compares the two itself")
    gen = torch.Generator().manual_seed(4)
    rows, vocab = 37, 1003
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[::5, 7:300] = float("-inf")
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    tokens[::5] = 0  # a scored token that is finite in the banned rows
    op = RowLogprobs()
    assert op.uses_native
    for num_top in (0, 1, 5, 20):
        ids, lps, ranks = op(logits, tokens, num_top)
        ref_ids, ref_lps, ref_ranks = op.forward_native(logits, tokens, num_top)
        assert torch.equal(ids, ref_ids) and torch.equal(ranks, ref_ranks), num_top
        assert torch.allclose(lps, ref_lps, atol=1e-5, rtol=0), num_top
    tied = torch.randint(0, 4, (rows, vocab), generator=gen).float()
    ids, lps, ranks = op(tied, tokens, 20)
    order = sorted(range(vocab), key=lambda i: (-float(tied[3, i]), i))
    assert ids[3, 1:].tolist() == order[:20]
    assert torch.equal(ranks, (tied >= tied.gather(1, tokens[:, None])).sum(-1))
    assert torch.allclose(lps, tied.log_softmax(-1).gather(1, ids), atol=1e-5, rtol=0)


@pytest.mark.skipif(not library.available(), reason="no native kernels here")
def test_native_logprobs_hold_1e_5_at_large_vocabularies(draw_impl: str) -> None:
    """A row's normalizer sums 10^5 and more weights: the kernel's log-probabilities stay within
    1e-5 of float64 (one float sum per lane over a whole 262144-token row drifted to 1.8e-5)."""
    if draw_impl == "pytorch":
        pytest.skip("checks the kernel itself")
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 262144, generator=gen) * 3
    tokens = torch.randint(0, logits.shape[1], (4,), generator=gen)
    ids, lps, _ = RowLogprobs()(logits, tokens, 20)
    exact = logits.double().log_softmax(-1).gather(1, ids)
    assert (lps.double() - exact).abs().max() < 1e-5


@pytest.mark.skipif(not library.available(), reason="no native kernels here")
def test_native_logprobs_rank_a_finite_token_below_the_padding_value(draw_impl: str) -> None:
    """A scored logit at or below -3e38 (finite, under the value the kernel pads a row's last
    block with) still ranks among the row's tokens only: the padding is not at least it."""
    if draw_impl == "pytorch":
        pytest.skip("compares the two itself")
    logits = torch.randn(2, 17)
    logits[:, :5] = float("-inf")
    logits[:, 8] = torch.tensor([-3.1e38, -3e38])
    tokens = torch.tensor([8, 8])
    op = RowLogprobs()
    assert torch.equal(op(logits, tokens, 3).ranks, op.forward_native(logits, tokens, 3).ranks)  # 12 each


@pytest.mark.skipif(not library.available(), reason="no native kernels here")
def test_logprobs_of_thousands_of_top_tokens_take_pytorch(draw_impl: str) -> None:
    """The kernel keeps a few top tokens by insertion (a whole 262144-token row as its top took
    ~30 s): its wrapper refuses more than ``MAX_TOP``, and ``RowLogprobs`` takes PyTorch's path."""
    if draw_impl == "pytorch":
        pytest.skip("checks the kernel's bound itself")
    from pagedllm.kernels.logprobs import MAX_TOP, logprobs_rows

    logits = (torch.arange(4096) / 512).expand(2, -1).contiguous()  # ascending: the slowest order
    tokens = torch.tensor([0, 4095])
    with pytest.raises(ValueError, match="num_top"):
        logprobs_rows(logits, tokens, MAX_TOP + 1)
    ids, lps, ranks = RowLogprobs()(logits, tokens, 4096)
    assert ids[:, 1:].tolist() == [list(range(4095, -1, -1))] * 2 and ranks.tolist() == [4096, 1]
    assert torch.allclose(lps, logits.log_softmax(-1).gather(1, ids), atol=1e-5, rtol=0)
