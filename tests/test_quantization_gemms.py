"""The integer GEMMs on every ISA's kernels: w8a8 and w4a8 layers exact for their schemes
against float64 references, exact at the largest codes, rows independent of the batch, a
tensor-parallel slice packed with the whole rows' maxima, non-finite weights refused, and
GGUF Q4 blocks run as stored."""

from __future__ import annotations

import gguf
import pytest
import torch

from pagedllm.kernels import linear as linear_kernels
from pagedllm.layers.quantization.linear import Q8A8Linear, W4A8Linear, W8A8Linear, prompt_rows
from pagedllm.layers.quantization.weights import Int4Weight, quantize_q4a8
from tests.test_kquant import gguf_values
from tests.test_q8a8 import quantizer_blocks


# N, K with ragged panels and groups; the batches cover M = 1, partial micro-tiles on every
# ISA (1 to 4 rows per tile), several tiles, and (at K = 200) more rows than one L2 chunk holds.
INT8_SHAPES = [(5, 7), (40, 64), (96, 577), (100, 200)]


@pytest.mark.parametrize("n,k", INT8_SHAPES)
def test_w8a8_linear_is_exact_for_its_scheme(n, k, native_isa) -> None:
    """Integer sums of int8 weights, symmetric per output feature, and int8 activations,
    symmetric per group of 32 input features, each group's sum scaled by x's scale and the
    total by the row's: equal to the same scheme in float64, on every ISA's kernels."""
    gen = torch.Generator().manual_seed(k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    layer = W8A8Linear(w, b)
    pad = -k % 32
    ws = w.double().abs().amax(-1) / 127
    wq = torch.nn.functional.pad(torch.round(w.double() / ws.unsqueeze(1)), (0, pad)).view(n, -1, 32)
    for m in (1, 7, 13, 64) if k != 200 else (3, 17, 1402):
        x = torch.randn(m, k, generator=gen) * torch.linspace(0.1, 3, k)
        x[0] = 0.0  # an all-zero row stays exact
        x[1:, 3] = 1e3  # an outlier costs precision in its own group only
        g = torch.nn.functional.pad(x.double(), (0, pad)).view(m, -1, 32)
        xs = g.abs().amax(-1, keepdim=True) / 127
        xq = torch.round(g / xs.clamp_min(1e-300))
        ref = torch.einsum("mgk,ngk,mg->mn", xq, wq, xs[..., 0]) * ws + b
        torch.testing.assert_close(layer(x), ref.float(), atol=1e-4, rtol=1e-5)
        assert torch.equal(layer(x)[0], b)
        exact = torch.nn.functional.linear(x, w, b)
        assert (layer(x) - exact).norm() / exact.norm() < 0.01


@pytest.mark.parametrize("n,k", INT8_SHAPES)
def test_w4a8_linear_is_exact_for_its_scheme(n, k, native_isa) -> None:
    """4-bit weights ``d * q + m`` (float16 d, m) per group of 32 against int8 activations,
    symmetric per group of 32, with each group's code sum for the m term (llama.cpp's
    Q4_1 x Q8_1): equal to the same integer arithmetic in float64 on every ISA's kernels, at
    batch sizes 1 to 64, rows at a stride; and close to F.linear. (No prompt rows: the int8
    scheme on every CPU, AMX's too.)"""
    gen = torch.Generator().manual_seed(k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    qw = quantize_q4a8(w)
    groups = -(-k // 32)
    assert qw.q.shape == (n, k) and qw.scales.shape == qw.mins.shape == (n, groups)
    assert int(qw.q.max()) <= 15 and torch.equal(qw.scales, qw.scales.half().float())
    layer = W4A8Linear(qw, b)
    pad = -k % 32
    wq = torch.nn.functional.pad(qw.q.double(), (0, pad)).view(n, groups, 32)
    d, mins = qw.scales.double(), qw.mins.double()
    for m in (1, 2, 5, 13, 64) if k != 200 else (3, 17, 1402):
        wide = torch.randn(m, k + 9, generator=gen) * torch.cat([torch.linspace(0.1, 3, k), torch.ones(9)])
        x = wide[:, :k]  # rows at stride k + 9
        x[0] = 0.0  # an all-zero row stays exact
        if m > 1:
            x[1:, 3] = 1e3  # an outlier costs precision in its own group only
        g = torch.nn.functional.pad(x.double(), (0, pad)).view(m, groups, 32)
        xs = g.abs().amax(-1) / 127
        xq = torch.round(g / xs.clamp_min(1e-300).unsqueeze(-1))
        dot, xsum = torch.einsum("mgk,ngk->mng", xq, wq), xq.sum(-1).unsqueeze(1)
        ref = (xs.unsqueeze(1) * (d * dot + mins * xsum)).sum(-1) + b
        # The d and m terms largely cancel (m is about -d * the mean code): float32 rounding
        # is relative to their magnitudes, not to the result's.
        magnitude = (xs.unsqueeze(1) * ((d * dot).abs() + (mins * xsum).abs())).sum(-1) + b.abs()
        y = layer(x)
        assert ((y.double() - ref).abs() <= 1e-6 * magnitude + 1e-6).all()
        assert torch.equal(y[0], b)
        exact = torch.nn.functional.linear(x, w, b)
        assert (y - exact).norm() / exact.norm() < 0.1  # 4-bit weights: about 4% on Gaussian ones


@pytest.mark.parametrize("n,k", INT8_SHAPES)
def test_w4a8_linear_on_q4_0_blocks_takes_the_symmetric_tile(n, k, native_isa) -> None:
    """GGUF Q4_0's blocks (every m = -8 d in float16): the layer packs them without m (the file's
    4.5 bits a weight) and runs the symmetric tile, whose -8 goes into the integer sums, ``sum_g xs d (sum x q - 8 sum x)``: equal to that in float64
    to float32's rounding of its own terms (no cancelling m term), on every ISA's kernels, each
    row's bits the same in any batch, in the one-call decoder's descriptor too; a weight with
    one other m takes the general tile."""
    gen = torch.Generator().manual_seed(k + 1)
    groups, pad = -(-k // 32), -k % 32
    d = (torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).half().float()
    qw = Int4Weight(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen), d, -8 * d)
    b = torch.randn(n, generator=gen)
    layer = W4A8Linear(qw, b)
    assert layer.symmetric and layer.native_desc().kind == linear_kernels.LINEAR_Q4A8_SYMMETRIC
    wq = torch.nn.functional.pad(qw.q.double() - 8, (0, pad)).view(n, groups, 32)
    m = 64 if k != 200 else 1402
    x = torch.randn(m, k + 5, generator=gen)[:, :k] * torch.linspace(0.1, 3, k)
    # x's codes as the kernel rounds them (float32 x times 127 / the group's largest), so that a
    # value at a tie in one rounding and not the other cannot move a code.
    g = torch.nn.functional.pad(x, (0, pad)).view(m, groups, 32)
    amax = g.abs().amax(-1)
    xq = torch.round(g * (127 / amax).unsqueeze(-1)).double()
    xs = (amax / 127).double()
    terms = xs.unsqueeze(1) * d.double() * torch.einsum("mgk,ngk->mng", xq, wq)
    ref, magnitude = terms.sum(-1) + b, terms.abs().sum(-1) + b.abs()
    y = layer(x)
    assert ((y.double() - ref).abs() <= 1e-6 * magnitude + 1e-6).all()
    for first, last in ((0, 1), (5, 6), (3, 34), (m - 7, m)):
        assert torch.equal(layer(x[first:last]), y[first:last])
    assert layer.packed.numel() == -(-n // 32) * groups * 576  # no mins: Q4_0's 4.5 bits a weight
    with_mins = linear_kernels.linear_pack_q4a8(qw.q, qw.scales, qw.mins)
    general = linear_kernels.linear_q4a8(x, with_mins, layer.padded_bias, n)
    assert ((general.double() - ref).abs() <= 1e-5 * magnitude + 1e-5).all()
    mins = qw.mins.clone()
    mins[-1, -1] += 1e-3
    assert not W4A8Linear(Int4Weight(qw.q, qw.scales, mins), b).symmetric


@pytest.mark.parametrize("kind", ["w4a8", "q4_0", "w8a8", "q8a8"])
@pytest.mark.parametrize("n,k", [*INT8_SHAPES, (1250, 96)])  # 40 panels: a thread decodes the next while it multiplies
def test_prompt_rows_on_amx_tiles(n, k, kind, native_isa) -> None:
    """Where the library runs AMX (Intel, AMX-BF16), a step's prompt rows (``prompt_rows``)
    are x rounded to bfloat16 times the weights in bfloat16 (w4a8's ``d * q + m``, q8a8's
    ``d * q``, w8a8's codes, exact, then the column's scale), their products summed in
    float32: equal to that in float64 to float32's rounding, nearer F.linear than the int8
    scheme, and each row's bits the same however many rows share the call (1 to 77, tiles cut
    short); the rows before them keep the int8 scheme's bits. Rows at a stride, ragged panels
    and groups."""
    if not linear_kernels.amx_tiles():
        pytest.skip("no AMX tiles on this CPU or library (or PAGEDLLM_DISABLE_AMX=1)")
    if kind == "q8a8":
        k = -(-k // 32) * 32  # Q8_0 rows are whole blocks of 32
    gen = torch.Generator().manual_seed(k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    if kind in ("w4a8", "q4_0"):
        qw = quantize_q4a8(w)
        if kind == "q4_0":  # GGUF Q4_0's blocks: packed without m, the symmetric tiles
            qw = Int4Weight(qw.q, qw.scales, -8 * qw.scales)
        layer = W4A8Linear(qw, b)
        assert layer.symmetric == (kind == "q4_0")
        wd = qw.scales.repeat_interleave(32, 1)[:, :k] * qw.q.float() + qw.mins.repeat_interleave(32, 1)[:, :k]
        weights = wd.bfloat16().double()
        if kind == "q4_0":
            w = wd  # no longer near w: F.linear of the blocks' own values is the reference
    elif kind == "w8a8":
        layer = W8A8Linear(w, b)
        amax = w.abs().amax(-1, keepdim=True)
        weights = torch.round(w * (127 / amax)).double() * (amax / 127).double()  # codes, scaled
    else:
        blocks = quantizer_blocks(n, k, seed=k)
        layer = Q8A8Linear(linear_kernels.linear_pack_q8_0(blocks, k), k, n, b)
        w = gguf_values(gguf.GGMLQuantizationType.Q8_0, blocks, k).float()
        weights = w.bfloat16().double()
    x = torch.randn(77, k + 9, generator=gen)[:, :k] * torch.linspace(0.1, 3, k)
    vector = layer(x)
    with prompt_rows(0):
        y = layer(x)
    ref = x.bfloat16().double() @ weights.T + b
    magnitude = x.bfloat16().double().abs() @ weights.abs().T + b.abs()
    assert ((y.double() - ref).abs() <= 1e-6 * magnitude + 1e-6).all()
    exact = torch.nn.functional.linear(x, w, b)
    assert (y - exact).norm() <= (vector - exact).norm() * 1.01
    for first, last in ((0, 1), (5, 6), (3, 34), (40, 77)):
        with prompt_rows(0):
            assert torch.equal(layer(x[first:last]), y[first:last])
    for first in (1, 31, 33):
        with prompt_rows(first):
            mixed = layer(x)
        assert torch.equal(mixed[:first], vector[:first]) and torch.equal(mixed[first:], y[first:])


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int8_gemms_exact_at_the_largest_codes(sign, native_isa) -> None:
    """Every product at its largest: 4-bit codes 15 (int8 weight codes 127) against activation
    codes all 127 of one sign (x = +-127: scale 1): no partial sum overflows on any ISA (AVX2
    adds a group's 4-bit products in int16), so y is exact, at K = 256 and 96 and M = 5."""
    for k, m in ((256, 5), (96, 5), (96, 33), (100, 35)):  # 33, 35 rows: AVX2's int16 tile (from 32 rows)
        n, groups = 40, -(-k // 32)
        x = torch.full((m, k), sign * 127)
        codes = torch.full((n, k), 15, dtype=torch.uint8)
        q4 = linear_kernels.linear_pack_q4a8(codes, torch.ones(n, groups), torch.zeros(n, groups))
        assert torch.equal(linear_kernels.linear_q4a8(x, q4, None, n), torch.full((m, n), sign * 15 * 127 * k))
        w8 = linear_kernels.linear_pack_w8a8(torch.full((n, k), 127.0))
        assert torch.equal(linear_kernels.linear_w8a8(x, w8, None, n), torch.full((m, n), sign * 127 * 127 * k))


@pytest.mark.parametrize("k", [96, 577])
def test_w8a8_rows_do_not_depend_on_the_batch(k, native_isa) -> None:
    """Each row of a w8a8 GEMM equals that row computed alone, bit for bit: at 1-31 rows AVX2
    runs the int8 tile, from 32 rows the int16 one on widened panels (K ragged against its
    pairs and groups, tails of 1 row, codes of both signs up to 127); both sums are exact and
    scaled in the same order."""
    gen = torch.Generator().manual_seed(k)
    n, m = 70, 37
    w = torch.randn(n, k, generator=gen)
    w[:, 5] = 50.0  # codes of +-127 in that group
    w[::2, 6] = -50.0
    packed = linear_kernels.linear_pack_w8a8(w)
    x = torch.randn(m, k, generator=gen)
    x[:, 7] = torch.where(torch.arange(m) % 2 == 0, 40.0, -40.0)
    batch = linear_kernels.linear_w8a8(x, packed, None, n)
    for i in range(m):
        assert torch.equal(batch[i : i + 1], linear_kernels.linear_w8a8(x[i : i + 1], packed, None, n)), i
    assert torch.equal(batch[:31], linear_kernels.linear_w8a8(x[:31], packed, None, n))


@pytest.mark.parametrize("kind", ["f32", "w8a8", "w4a8", "q8a8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_over_blocks_of_panels_equal_the_rows_in_small_calls(kind, threads, native_isa) -> None:
    """From 128 rows a thread runs each tile of rows over a block of up to 8 panels before the
    next tile (csrc/linear.cpp's for_panel_tiles); below, each panel over all rows. The tiles'
    arithmetic is the same either way: 150 rows over 35 panels (the last of 12 columns, with a
    bias) equal the same rows in calls of 100 and 50, bit for bit, on one and two threads
    (blocks of 8 + 1 panels and of 5)."""
    gen = torch.Generator().manual_seed(3)
    n, k, m = 1100, 96, 150
    w, b = torch.randn(n, k, generator=gen), torch.randn(-(-n // 32) * 32, generator=gen)
    if kind == "f32":
        packed = linear_kernels.linear_pack_f32(w)
        gemm = lambda x: linear_kernels.linear_f32(x, packed, b, n)  # noqa: E731
    elif kind == "w8a8":
        packed8 = linear_kernels.linear_pack_w8a8(w)
        gemm = lambda x: linear_kernels.linear_w8a8(x, packed8, b, n)  # noqa: E731
    elif kind == "w4a8":
        qw = quantize_q4a8(w)
        packed4 = linear_kernels.linear_pack_q4a8(qw.q, qw.scales, qw.mins)
        gemm = lambda x: linear_kernels.linear_q4a8(x, packed4, b, n)  # noqa: E731
    else:
        packed_q8 = linear_kernels.linear_pack_q8_0(quantizer_blocks(n, k, seed=3), k)
        gemm = lambda x: linear_kernels.linear_q8a8(x, packed_q8, b, n)  # noqa: E731
    x = torch.randn(m, k, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole, parts = gemm(x), torch.cat([gemm(x[:100]), gemm(x[100:])])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(whole, parts)


def test_w8a8_slice_with_the_whole_rows_maxima_is_the_whole_rows_codes(native_isa) -> None:
    """A tensor-parallel rank's slice of each row (here the last 64 of 96 inputs), packed with
    the whole rows' max|w|, computes what the whole weight does on inputs zero outside the slice,
    bit for bit; a max below a row's own is refused."""
    gen = torch.Generator().manual_seed(3)
    n, k = 40, 96
    w = torch.randn(n, k, generator=gen)
    w[5, 2] = 9.0  # a row whose largest weight is outside the slice
    x = torch.randn(7, k, generator=gen)
    x[:, :32] = 0.0
    whole = linear_kernels.linear_w8a8(x, linear_kernels.linear_pack_w8a8(w), None, n)
    row_max = w.abs().amax(dim=1)
    part = linear_kernels.linear_w8a8(x[:, 32:], linear_kernels.linear_pack_w8a8(w[:, 32:], row_max), None, n)
    assert torch.equal(part, whole)
    for bad in (row_max / 2, torch.where(torch.arange(n) == 3, float("nan"), row_max)):
        with pytest.raises(ValueError, match="row_max: non-finite, or below some row's own"):
            linear_kernels.linear_pack_w8a8(w, bad)


def test_w8a8_packing_refuses_non_finite_weights_and_zeroes_tiny_rows(native_isa) -> None:
    """NaN or inf cannot be int8 codes (a NaN once hid its row's maximum and wrapped codes past
    127): refused; a row whose max|w| is under 1e-30 (127 / max would overflow) is zero."""
    w = torch.randn(40, 64)
    for value in (float("nan"), float("inf")):
        bad = w.clone()
        bad[0, 60] = value
        with pytest.raises(ValueError, match="weight: 1 non-finite values"):
            linear_kernels.linear_pack_w8a8(bad)
    w[1] = 1e-37
    w[2] = 1e-20  # small, still quantized
    x = torch.rand(3, 64) + 0.5  # positive: the row sums do not cancel
    y = linear_kernels.linear_w8a8(x, linear_kernels.linear_pack_w8a8(w), None, 40)
    assert torch.equal(y[:, 1], torch.zeros(3)) and torch.isfinite(y).all()
    torch.testing.assert_close(y[:, 2], x.sum(1) * 1e-20, rtol=0.02, atol=0)


def test_w4a8_takes_gguf_q4_blocks_as_stored(native_isa) -> None:
    """Q4_0 and Q4_1 blocks run as they are: the layer computes with their exact d and m."""
    gen = torch.Generator().manual_seed(1)
    n, k = 40, 96
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) / 8).half().float()
    for qw in (Int4Weight(q, d, -8 * d), Int4Weight(q, d, (torch.randn(n, k // 32, generator=gen) / 4).half().float())):
        x = torch.randn(3, k, generator=gen)
        exact = torch.nn.functional.linear(x, qw.dequantize())
        y = W4A8Linear(qw)(x)
        assert (y - exact).norm() / exact.norm() < 0.01  # only the activations' int8 rounding

