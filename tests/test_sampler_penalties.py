"""Sampler: repetition, presence and frequency penalties, in PyTorch and on the native kernel."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import library
from pagedllm.layers import sampler as sampler_module
from pagedllm.layers.sampler import Sampler, _apply_penalties
from pagedllm.layers.sampling_metadata import SamplingMetadata, SamplingRow
from tests.utils import row

pytestmark = pytest.mark.usefixtures("draw_impl")  # each test on the native kernels and in PyTorch (conftest.py)


def _penalized(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    out = logits.clone()
    _apply_penalties(out, SamplingMetadata.build([r]).penalties)
    return out


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([[3.0, -1.0, 2.0, -2.0, 0.5]])
    out = _penalized(logits, row(prompt=[0, 1], output=[3], repetition_penalty=2.0))
    assert out.tolist() == [[1.5, -2.0, 2.0, -4.0, 0.5]]  # prompt and output tokens only


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.tensor([[3.0, -1.0, 2.0, -2.0, 0.5]])
    r = row(prompt=[0, 4], output=[2, 2, 2, 3], presence_penalty=0.5, frequency_penalty=0.25)
    assert _penalized(logits, r).tolist() == [[3.0, -1.0, 2.0 - 0.5 - 0.75, -2.0 - 0.5 - 0.25, 0.5]]


def test_repetition_then_presence_and_frequency_in_one_row() -> None:
    logits = torch.tensor([[3.0, -1.0, 2.0], [3.0, -1.0, 2.0]])
    r = row(
        prompt=[0, 0], output=[0, 1, 1], repetition_penalty=2.0, presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    out = _penalized(logits, r)  # build() sees row 0 only: row 1 stays as it was
    assert out.tolist() == [[3.0 / 2 - 0.25 - 0.5, -1.0 * 2 - 0.5 - 0.5, 2.0], [3.0, -1.0, 2.0]]
    # First decode step: penalties but no output yet.
    first = _penalized(logits, row(prompt=[2], frequency_penalty=1.0, repetition_penalty=0.5))
    assert first.tolist() == [[3.0, -1.0, 4.0], [3.0, -1.0, 2.0]]


@pytest.mark.skipif(not library.available(), reason="no native kernels here")
def test_native_penalties_match_pytorch(draw_impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Histories with repeats, rows with one kind of penalty, both or none, long prompts:
    the kernel's one walk per row gives PyTorch's sparse updates."""
    if draw_impl == "pytorch":
        pytest.skip("compares the two itself")
    gen = torch.Generator().manual_seed(6)
    vocab = 1000
    logits = torch.randn(12, vocab, generator=gen) * 4

    def ids(n: int) -> list[int]:
        return torch.randint(0, 40 if n % 2 else vocab, (n,), generator=gen).tolist()  # odd: many repeats

    settings = [dict(repetition_penalty=1.3), dict(presence_penalty=0.5), dict(frequency_penalty=-0.7),
                dict(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=0.4), dict()]
    rows = [row(prompt=ids(300 + i), output=ids(i * 7), **settings[i % len(settings)]) for i in range(12)]
    meta = SamplingMetadata.build(rows)
    native = logits.clone()
    _apply_penalties(native, meta.penalties)
    monkeypatch.setattr(sampler_module.library, "available", lambda: False)
    reference = logits.clone()
    _apply_penalties(reference, meta.penalties)
    assert not torch.equal(native, logits)
    assert torch.allclose(native, reference, atol=1e-5, rtol=0)


def test_penalties_apply_to_their_rows_and_flip_greedy() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0]] * 3)
    rows = [
        row(temperature=0.0, output=[0], repetition_penalty=1.5),  # 5 / 1.5 < 4
        row(temperature=0.0, output=[0]),
        row(temperature=0.0, output=[0, 0], frequency_penalty=0.6),  # 5 - 1.2 < 4
    ]
    meta = SamplingMetadata.build(rows)
    assert meta.penalties.rows.tolist() == [0, 2] and meta.penalties.tokens.tolist() == [0, 0, 0]
    assert meta.penalties.num_prompt.tolist() == [0, 0] and meta.penalties.offsets.tolist() == [0, 1, 3]
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [1, 0, 1]
    assert SamplingMetadata.build(rows[1:2]).no_penalties
