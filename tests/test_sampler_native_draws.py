"""Sampler: the native draw kernel against PyTorch's draw and a float64 full sort, on top-k / top-p / min-p rows."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.kernels import library
from pagedllm.layers.sampler import RowDraw
from pagedllm.layers.sampling_metadata import SamplingMetadata, SamplingRow
from tests.utils import row

pytestmark = pytest.mark.usefixtures("draw_impl")  # each test on the native kernels and in PyTorch (conftest.py)


def _draws_at_seed(seed: int, logits: torch.Tensor, rows: list[SamplingRow], native: bool) -> torch.Tensor:
    draw = RowDraw()
    if not native:
        draw._forward = draw.forward_native
    torch.manual_seed(seed)
    return draw(logits, SamplingMetadata.build(rows))


@pytest.mark.skipif(not library.available(), reason="no native kernels here")
def test_native_and_pytorch_draws_agree_at_the_same_uniforms(draw_impl: str) -> None:
    """Both implementations draw in the same order (most likely first under top-k / top-p,
    else vocabulary order) at the same uniform: the same token but where float rounding puts
    the uniform on a boundary between two tokens."""
    if draw_impl == "pytorch":
        pytest.skip("compares the two itself")
    vocab, n = 5000, 400
    settings = [
        dict(), dict(temperature=0.7), dict(top_p=0.9), dict(top_k=40), dict(top_k=40, top_p=0.8, temperature=1.3),
        dict(min_p=0.05), dict(min_p=0.1, top_p=0.95), dict(top_p=0.999, temperature=2.0), dict(top_k=1),
        dict(top_k=vocab), dict(top_k=10**9, min_p=0.05),  # top-k keeping every token: most likely first too
    ]
    gen = torch.Generator().manual_seed(1)
    for scale in (8.0, 3.0, 1.0, 0.1):  # peaked to flat
        logits = torch.randn(n, vocab, generator=gen) * scale
        logits[::7, :100] = float("-inf")  # banned tokens are never drawn
        for params in settings:
            rows = [row(**params)] * n
            native = _draws_at_seed(3, logits, rows, native=True)
            reference = _draws_at_seed(3, logits, rows, native=False)
            assert torch.isfinite(logits.gather(1, native[:, None])).all(), (scale, params)
            assert (native == reference).float().mean() >= 0.98, (scale, params)  # measured >= 0.995


@pytest.mark.skipif(not library.available(), reason="no native kernels here")
def test_native_draws_rows_whose_maximum_is_the_largest_finite_floats(draw_impl: str) -> None:
    """A finite maximum of 3e38 and more is a row to draw from, not one without a finite
    maximum (token 0, here banned): the kernel draws its most likely token, as PyTorch does."""
    if draw_impl == "pytorch":
        pytest.skip("compares the two itself")
    logits = torch.randn(4, 50)
    logits[:, 0] = float("-inf")
    logits[:, 9] = torch.tensor([3e38, 3.2e38, torch.finfo(torch.float32).max, 1e30])
    for params in (dict(), dict(top_p=0.9), dict(top_k=5, min_p=0.1)):
        rows = [row(**params)] * 4
        assert _draws_at_seed(3, logits, rows, native=True).tolist() == [9] * 4, params
        assert _draws_at_seed(3, logits, rows, native=False).tolist() == [9] * 4, params


def _exact_draw(x: torch.Tensor, t: float, k: int, p: float, min_p: float, u: float) -> int:
    """The kernel's semantics in float64 over a full sort: most likely first, ties by token id;
    ``p`` as the kernel reads it, in float32 (rows of ties put the nucleus's edge on a whole
    number of tokens)."""
    p = float(torch.tensor(p, dtype=torch.float32))
    ids = sorted(range(len(x)), key=lambda i: (-float(x[i]), i))
    m = float(x.max())
    w = [math.exp((float(x[i]) - m) / t) for i in ids]
    survivors = [j for j, v in enumerate(w) if j == 0 or v >= min_p]  # min-p first (vLLM V1)
    ids, w = [ids[j] for j in survivors], [w[j] for j in survivors]
    if 0 < k < len(w):
        ids, w = ids[:k], w[:k]
    limit, before, n = p * sum(w), 0.0, 0
    while n < len(w) and (p >= 1.0 or before < limit):
        before, n = before + w[n], n + 1
    kept = list(zip(ids[:n], w[:n]))
    target, mass = u * sum(v for _, v in kept), 0.0
    for i, v in kept:
        mass += v
        if mass >= target:
            return i
    return kept[-1][0]


@pytest.mark.skipif(not library.available(), reason="no native kernels here")
def test_native_draws_match_a_full_sort_on_rows_of_ties(draw_impl: str) -> None:
    """Integer logits tie by the thousand and flat rows keep thousands of tokens: the kernel's
    selection by weight (a quickselect, no sort) draws what a full sort does, equal logits
    ordered by token id."""
    if draw_impl == "pytorch":
        pytest.skip("calls the kernel itself")
    from pagedllm.kernels.sampling import sample_rows

    gen = torch.Generator().manual_seed(2)
    vocab, n = 3000, 40
    tied = torch.randint(0, 5, (n, vocab), generator=gen).float()
    flat = torch.randn(n, vocab, generator=gen) * 0.5
    u = torch.rand(n, generator=gen).clamp_min(1e-6)
    for logits in (tied, flat):
        cases = ((1.0, 0, 0.9, 0.0), (0.7, 1000, 0.7, 0.0), (1.0, 2000, 1.0, 0.0), (1.3, 0, 0.3, 0.5), (1.0, 100, 0.9, 0.01))
        for t, k, p, min_p in cases:
            full = lambda v: torch.full((n,), v)  # noqa: E731
            drawn = sample_rows(logits, full(t), full(k).long(), full(p), full(min_p), u).tolist()
            expected = [_exact_draw(logits[r], t, k, p, min_p, float(u[r])) for r in range(n)]
            # float32 weights against float64: a uniform within ~1e-6 of a boundary may go either way
            assert sum(a == b for a, b in zip(drawn, expected)) >= n - 1, (t, k, p, min_p)
