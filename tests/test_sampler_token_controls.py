"""Sampler: token controls: min_tokens' masked stop ids, allowed_token_ids, bad_words and logit_bias."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.sampler import process_logits
from pagedllm.layers.sampling_metadata import SamplingMetadata, SamplingRow
from pagedllm.sampling_params import SamplingParams
from tests.utils import row, sample

pytestmark = pytest.mark.usefixtures("draw_impl")  # each test on the native kernels and in PyTorch (conftest.py)


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0]])  # 3: EOS, 4: a stop token id
    stop = dict(temperature=0.0, eos=[3], stop_token_ids=[4], min_tokens=2)
    assert sample(logits, [row(output=[1], **stop)]).sampled_token_ids.tolist() == [2]
    assert sample(logits, [row(output=[1, 1], **stop)]).sampled_token_ids.tolist() == [3]
    # ignore_eos: EOS is an ordinary token, not masked; the stop id still is.
    ignoring = row(output=[1], ignore_eos=True, **stop)
    assert sample(logits, [ignoring]).sampled_token_ids.tolist() == [3]
    # Random rows never draw a masked id either.
    many = [row(output=[1], eos=[3], stop_token_ids=[4], min_tokens=2)] * 2000
    drawn = sample(logits.expand(2000, -1).contiguous(), many).sampled_token_ids
    assert not set(drawn.tolist()) & {3, 4}


def _bad_words_row(words: list[list[int]], output: list[int], **params: object) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(bad_words=["w"] * len(words), bad_words_token_ids=words, **params),
        prompt_token_ids=[0],
        output_token_ids=output,
    )


def test_token_controls_cost_nothing_when_unused() -> None:
    logits = torch.randn(4, 50)
    meta = SamplingMetadata.build([row(temperature=0.0)] * 4)
    assert meta.allowed_tokens is None and meta.bad_words_mask is None and meta.logit_bias is None
    assert process_logits(logits, meta) is logits


def test_logit_bias_plus_100_forces_and_minus_100_bans() -> None:
    logits = torch.randn(8, 300)
    best = logits.argmax(dim=-1)
    rows = [row(temperature=0.0, logit_bias={7: 100.0})] * 4 + [row(temperature=1.0, logit_bias={"7": 100.0})] * 4
    assert sample(logits, rows).sampled_token_ids.tolist() == [7] * 8
    # -100 on each row's argmax: greedy takes the runner-up; sampling never draws it.
    banned = [row(temperature=0.0, logit_bias={int(best[i]): -100.0}) for i in range(4)]
    banned += [row(temperature=1.0, logit_bias={int(best[i]): -100.0}) for i in range(4, 8)]
    for _ in range(20):
        out = sample(logits, banned).sampled_token_ids
        assert not (out == best).any()
    assert out[:4].tolist() == logits[:4].topk(2).indices[:, 1].tolist()


def test_logit_bias_shifts_logits_only_of_its_rows() -> None:
    logits = torch.randn(3, 20)
    meta = SamplingMetadata.build([row(logit_bias={1: 2.5, 4: -1.0}), row(), row(logit_bias={1: 0.5})])
    expected = logits.clone()
    expected[0, 1] += 2.5
    expected[0, 4] -= 1.0
    expected[2, 1] += 0.5
    assert torch.equal(process_logits(logits, meta), expected)


def test_allowed_token_ids() -> None:
    logits = torch.randn(6, 400)
    allowed = [3, 250, 399]
    rows = [row(temperature=0.0, allowed_token_ids=allowed)] * 3 + [row(temperature=1.0, allowed_token_ids=allowed)] * 3
    for _ in range(20):
        assert set(sample(logits, rows).sampled_token_ids.tolist()) <= set(allowed)
    greedy = sample(logits[:3], rows[:3]).sampled_token_ids
    assert greedy.tolist() == [allowed[int(logits[i, allowed].argmax())] for i in range(3)]
    # A row without the field in the same batch is untouched.
    mixed = sample(logits[:2], [row(temperature=0.0, allowed_token_ids=[5]), row(temperature=0.0)])
    assert mixed.sampled_token_ids.tolist() == [5, int(logits[1].argmax())]


def test_bad_words_vllm_semantics() -> None:
    logits = torch.zeros(4, 10)
    logits[:, 2] = 5.0  # the greedy choice
    rows = [
        _bad_words_row([[2]], [], temperature=0.0),  # one-token word: always banned
        _bad_words_row([[7, 2]], [1, 7], temperature=0.0),  # output ends with the prefix: banned
        _bad_words_row([[7, 2]], [7, 1], temperature=0.0),  # it does not: allowed
        _bad_words_row([[6, 7, 2]], [7], temperature=0.0),  # only part of the prefix: allowed
    ]
    out = sample(logits, rows).sampled_token_ids.tolist()
    assert out[0] != 2 and out[1] != 2 and out[2] == 2 and out[3] == 2


def test_every_token_banned_still_gives_a_valid_id() -> None:
    logits = torch.randn(2, 100)
    rows = [
        SamplingRow(params=SamplingParams(temperature=t, allowed_token_ids=[5], bad_words=["w"],
                                          bad_words_token_ids=[[5]]),
                    prompt_token_ids=[0], output_token_ids=[])
        for t in (1.0, 0.0)
    ]
    assert all(0 <= t < 100 for t in sample(logits, rows).sampled_token_ids.tolist())
