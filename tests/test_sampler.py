"""Sampler: each stage's semantics on hand-made distributions, seeds, logprobs, batch mixes."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.kernels import library
from pagedllm.layers import sampler as sampler_module
from pagedllm.layers.logprobs import RowLogprobs, largest
from pagedllm.layers.sampler import (
    RowDraw,
    Sampler,
    SamplerOutput,
    _apply_penalties,
    _nucleus_size,
    process_logits,
)
from pagedllm.layers.sampling_metadata import SamplingMetadata, SamplingRow
from pagedllm.sampling_params import SamplingParams


def row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: list[int] | None = None,
    seed: int | None = None,
    **params: object,
) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(seed=seed, **params),
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        eos_token_ids=eos or [],
        generator=None if seed is None else torch.Generator().manual_seed(seed),
    )


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    return Sampler()(logits, SamplingMetadata.build(rows))


def sampled_set(probs: list[float], n: int = 4000, **params: object) -> set[int]:
    """The tokens drawn in ``n`` rows that all have distribution ``probs``."""
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()
    return set(sample(logits, [row(**params)] * n).sampled_token_ids.tolist())


@pytest.fixture(autouse=True, params=["native", "pytorch"])
def draw_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with the random draw, logprobs and penalties on the native kernels and in PyTorch."""
    if request.param == "native" and not library.available():
        pytest.skip("no native kernels here")
    if request.param == "pytorch":
        monkeypatch.setattr(RowDraw, "forward_cpu", RowDraw.forward_native)
        monkeypatch.setattr(RowLogprobs, "forward_cpu", RowLogprobs.forward_native)
        monkeypatch.setattr(sampler_module.library, "available", lambda: False)  # penalties in PyTorch
    torch.manual_seed(0)
    return request.param


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


def test_temperature_reshapes_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    n = 20000
    for temperature in (0.5, 1.0, 2.0):
        batch = logits.expand(n, -1).contiguous()
        tokens = sample(batch, [row(temperature=temperature)] * n).sampled_token_ids
        freq = torch.bincount(tokens, minlength=3).float() / n
        expected = (logits / temperature).softmax(-1)
        assert torch.allclose(freq, expected, atol=0.015), temperature


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


# -- token controls: allowed_token_ids, bad_words, logit_bias ------------------------------------
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
