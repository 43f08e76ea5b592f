"""GGUF blocks multiplied as stored (kernels/kquant.py, csrc/kquant.cpp): the dot products of
Q4_K, Q5_K, Q6_K, Q8_0 and Q5_0 weights on every ISA against gguf's own dequantization, and
the layer built on them."""

from __future__ import annotations

import ctypes

import gguf
import pytest
import torch

from tests.utils import random_gguf_blocks

from pagedllm.kernels import kquant
from pagedllm.kernels import linear as linear_kernels
from pagedllm.layers.quantization.linear import KQuantLinear

Q = gguf.GGMLQuantizationType
# Each type with input sizes it takes: K-quants in super-blocks of 256, blocks of 32 in pairs.
SIZES = {Q.Q4_K: (256, 768), Q.Q5_K: (256, 512), Q.Q6_K: (256, 768), Q.Q8_0: (64, 640), Q.Q5_0: (64, 896)}


def gguf_values(qtype: Q, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """gguf.quants' dequantization of [n, row bytes] blocks: [n, k] float64."""
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype)).view(-1, k).double()


def without_minus_128(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks [n, row bytes] as quantizers write them: each code of -128 made -127."""
    b = blocks.view(blocks.shape[0], -1, 34)
    return torch.cat([b[..., :2], b[..., 2:].masked_fill(b[..., 2:] == 0x80, 0x81)], -1).view(blocks.shape[0], -1)


def quantized_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] quantized as the kernels do: codes [M, K / 32, 32] and scales [M, K / 32, 1],
    symmetric per group of 32 (max|x| / 127, rounded to nearest even), in float64."""
    g = x.double().view(x.shape[0], -1, 32)
    scale = g.abs().amax(-1, keepdim=True) / 127
    return torch.round(g / scale.clamp_min(1e-300)), scale


@pytest.mark.parametrize("qtype", list(SIZES), ids=lambda q: q.name)
def test_dequantize_equals_gguf(qtype: Q, native_isa: str) -> None:
    """Every code, scale and min where gguf.quants puts it: the native dequantization of random
    blocks equals gguf's (to float32 rounding: one fused multiply-add per weight), rows picked
    or all."""
    for k in SIZES[qtype]:
        blocks = random_gguf_blocks(qtype, 19, k)
        expected = gguf_values(qtype, blocks, k)
        got = kquant.dequantize(int(qtype), blocks, k)
        assert torch.allclose(got.double(), expected, rtol=2**-22, atol=1e-12)
        rows = torch.tensor([18, 0, 7, 7])
        assert torch.equal(kquant.dequantize(int(qtype), blocks, k, rows), got[rows])


@pytest.mark.parametrize("qtype", list(SIZES), ids=lambda q: q.name)
def test_gemm_is_exact_for_its_scheme(qtype: Q, native_isa: str) -> None:
    """The integer sums of the stored codes and int8 activations (per group of 32), scaled:
    equal to gguf's dequantized weights times the quantized activations in float64, on every
    ISA, at M = 1 to 5 (decode), M = 8 to 29 (the prefill panels: M not a multiple of the
    micro-tile), N not a multiple of the 16-row spans or 32-row panels, rows at a stride, with
    a bias; and within int8's rounding of F.linear. Q8_0 also as quantizers write it, codes in
    [-127, 127] (random blocks hold -128, which the prefill panels take as stored on VNNI and
    hand to the decode path where the dot product's sign trick cannot negate it)."""
    n = 37
    torch.manual_seed(0)
    cases = [(k, random_gguf_blocks(qtype, n, k, seed=k)) for k in SIZES[qtype]]
    if qtype == Q.Q8_0:
        cases += [(k, without_minus_128(b)) for k, b in cases]
    for k, blocks in cases:
        w = gguf_values(qtype, blocks, k)
        weight = kquant.StoredWeight([(int(qtype), blocks)], k)
        bias = torch.randn(n)
        for m in (1, 3, 5, 8, 13, 29):
            wide = torch.randn(m, k + 5) * torch.cat([torch.linspace(0.1, 3, k), torch.ones(5)])
            x = wide[:, :k]  # rows at stride k + 5
            x[0] = 0.0  # an all-zero row gives the bias exactly
            xq, xs = quantized_x(x)
            ref = (xq * xs).view(m, k) @ w.T + bias.double()
            magnitude = (xq * xs).view(m, k).abs() @ w.abs().T + bias.double().abs()
            y = kquant.linear(x, weight, bias)
            assert y.shape == (m, n)
            assert ((y.double() - ref).abs() <= 1e-5 * magnitude + 1e-6).all()
            assert torch.equal(y[0], bias)
            exact = x.double() @ w.T + bias.double()
            assert (y.double() - exact).norm() / exact.norm() < 0.02  # int8 activations


@pytest.mark.parametrize("qtype", list(SIZES), ids=lambda q: q.name)
def test_decode_rows_do_not_depend_on_the_batch(qtype: Q, native_isa: str) -> None:
    """Below the prefill panels (M < 8) each row of y has the same bits whatever other rows
    share the call and wherever the row falls in the activation tiles: a request's logits do not
    change with the batch (speculative verification's rows against plain decoding)."""
    k = SIZES[qtype][-1]
    weight = kquant.StoredWeight([(int(qtype), random_gguf_blocks(qtype, 41, k, seed=3))], k)
    bias = torch.randn(41)
    x = torch.randn(7, k) * torch.linspace(0.1, 3, k)
    alone = torch.cat([kquant.linear(x[i : i + 1], weight, bias) for i in range(7)])
    for m in range(2, 8):
        for start in (0, 7 - m):
            assert torch.equal(kquant.linear(x[start : start + m], weight, bias), alone[start : start + m])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_prefill_rows_do_not_depend_on_the_chunks(qtype: Q, native_isa: str) -> None:
    """The prefill panels are unpacked once per chunk of rows (several chunks from a few
    hundred rows at a wide K): a row's bits are the same whatever the chunks, and whatever
    rows share the call."""
    k, n = 4864, 40
    weight = kquant.StoredWeight([(int(qtype), random_gguf_blocks(qtype, n, k, seed=5))], k)
    x = torch.randn(600, k)
    whole = kquant.linear(x, weight)
    for start, stop in ((0, 8), (8, 250), (250, 263), (263, 600)):
        assert torch.equal(kquant.linear(x[start:stop], weight), whole[start:stop])


def test_parts_of_several_formats_stack_along_n(native_isa: str) -> None:
    """A fused weight whose parts the file stores in different formats (Gemma's q, k Q5_0 and
    v Q8_0) equals its parts' GEMMs side by side; adjacent parts of one format merge."""
    k = 640
    parts = [(Q.Q5_0, random_gguf_blocks(Q.Q5_0, 40, k, 1)), (Q.Q5_0, random_gguf_blocks(Q.Q5_0, 8, k, 2)),
             (Q.Q8_0, without_minus_128(random_gguf_blocks(Q.Q8_0, 17, k, 3)))]
    fused = kquant.StoredWeight([(int(t), b) for t, b in parts], k)
    assert [(t, b.shape[0]) for t, b in fused.parts] == [(int(Q.Q5_0), 48), (int(Q.Q8_0), 17)]
    for m in (6, 19):  # decode and prefill
        x = torch.randn(m, k)
        alone = [kquant.linear(x, kquant.StoredWeight([(int(t), b)], k)) for t, b in parts]
        assert torch.equal(kquant.linear(x, fused), torch.cat(alone, dim=1))
        packed = kquant.panels(fused)
        alone = [kquant.linear(x, kquant.panels(kquant.StoredWeight([(int(t), b)], k))) for t, b in parts]
        assert torch.equal(kquant.linear(x, packed), torch.cat(alone, dim=1))
        layer = KQuantLinear(fused, bias=torch.arange(65.0))
        assert torch.equal(layer(x), kquant.linear(x, packed, torch.arange(65.0)))


def test_prefill_of_mixed_k_quant_parts(native_isa: str) -> None:
    """Q4_K_M's fused q/k/v (Q4_K, Q4_K, Q6_K, each part's rows not a multiple of the 32-row
    panels) at prefill sizes: each part's columns equal that part alone, the whole within the
    scheme's rounding of gguf's weights times the quantized activations."""
    k = 512
    parts = [(Q.Q4_K, random_gguf_blocks(Q.Q4_K, 45, k, 1)), (Q.Q6_K, random_gguf_blocks(Q.Q6_K, 21, k, 2))]
    fused = kquant.StoredWeight([(int(t), b) for t, b in parts], k)
    w = torch.cat([gguf_values(t, b, k) for t, b in parts])
    x = torch.randn(23, k)
    y = kquant.linear(x, fused)
    alone = [kquant.linear(x, kquant.StoredWeight([(int(t), b)], k)) for t, b in parts]
    assert torch.equal(y, torch.cat(alone, dim=1))
    xq, xs = quantized_x(x)
    ref = (xq * xs).view(23, k) @ w.T
    magnitude = (xq * xs).view(23, k).abs() @ w.abs().T
    assert ((y.double() - ref).abs() <= 1e-5 * magnitude + 1e-6).all()


@pytest.mark.parametrize("qtype", list(SIZES), ids=lambda q: q.name)
def test_panels_are_the_prefill_panels_at_every_m(qtype: Q, native_isa: str) -> None:
    """Repacked into panels (``kquant.panels``: the file's bytes rearranged, 32 rows rounded
    up), a weight gives at every M, on every ISA, the bits the stored blocks' prefill panels
    give (M >= 8: the same codes, scales and tile), each row the same alone as in any batch:
    a request's logits do not move with the batch, a prefix hit or a chunk's length. Rows at
    a stride, a bias, N not a multiple of 32, M of one tile and of several, the first of
    which keeps its decoded scales (and codes) for the others from ``kKQuantRecordFrom``."""
    n = 45
    for k in SIZES[qtype]:
        blocks = random_gguf_blocks(qtype, n, k, seed=k + 1)
        if qtype == Q.Q8_0:  # as quantizers write it: -128 has its own test
            blocks = without_minus_128(blocks)
        stored = kquant.StoredWeight([(int(qtype), blocks)], k)
        packed = kquant.panels(stored)
        assert packed is not None and packed.nbytes() == 64 * blocks.shape[1]  # 45 rows -> 2 panels of 32
        bias = torch.randn(n)
        x = (torch.randn(61, k + 3) * torch.linspace(0.1, 3, k + 3))[:, :k]
        whole = kquant.linear(x, packed, bias)  # 61 rows: bit planes decoded once, not per tile
        assert torch.equal(whole, kquant.linear(x, stored, bias))  # the stored prefill panels
        assert torch.equal(torch.cat([kquant.linear(x[i : i + 1], packed, bias) for i in range(61)]), whole)
        for start, stop in ((0, 2), (3, 8), (5, 14), (2, 17), (7, 60)):
            assert torch.equal(kquant.linear(x[start:stop], packed, bias), whole[start:stop])


def test_panels_keep_minus_128_as_stored_where_the_dot_product_cannot(native_isa: str) -> None:
    """A Q8_0 code of -128 (legal, never written by quantizers) packs where the ISA's dot
    product takes it (VNNI), else ``panels`` declines and the layer keeps the blocks as stored
    (the decode path's arithmetic takes it); the layer's result is the GEMM's either way."""
    k, n = 128, 33
    blocks = random_gguf_blocks(Q.Q8_0, n, k, seed=9).view(n, -1, 34)
    blocks[3, 1, 2 + 5] = 0x80
    blocks = blocks.view(n, -1)
    stored = kquant.StoredWeight([(int(Q.Q8_0), blocks), (int(Q.Q5_0), random_gguf_blocks(Q.Q5_0, 7, k))], k)
    packed = kquant.panels(stored)
    assert (packed is not None) == (native_isa in ("avx512_bf16", "avx512_vnni"))
    layer = KQuantLinear(stored)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))  # no code on a rounding tie of float64's
    assert torch.equal(layer(x), kquant.linear(x, packed or stored))
    w = torch.cat([gguf_values(Q.Q8_0, blocks, k), gguf_values(Q.Q5_0, stored.parts[1][1], k)])
    xq, xs = quantized_x(x)
    ref = (xq * xs).view(3, k) @ w.T
    assert ((layer(x).double() - ref).abs() <= 1e-5 * ((xq * xs).view(3, k).abs() @ w.abs().T) + 1e-6).all()


def test_refuses_what_it_does_not_take(native_isa: str) -> None:
    """Sizes a type cannot hold (a K-quant row of 640, a Q8_0 row of 96), types it does not
    read (Q4_0: w4a8's), mismatched blocks, x or bias: clear errors, nothing computed."""
    assert kquant.row_bytes(int(Q.Q4_K), 640) == 0 and kquant.row_bytes(int(Q.Q8_0), 96) == 0
    assert kquant.row_bytes(int(Q.Q4_0), 64) == 0
    assert kquant.row_bytes(int(Q.Q6_K), 512) == 2 * 210
    with pytest.raises(ValueError, match="need uint8"):
        kquant.StoredWeight([(int(Q.Q4_K), torch.zeros(4, 144, dtype=torch.uint8))], 512)
    weight = kquant.StoredWeight([(int(Q.Q4_K), random_gguf_blocks(Q.Q4_K, 4, 256))], 256)
    with pytest.raises(ValueError, match="x: need float32"):
        kquant.linear(torch.zeros(2, 255), weight)
    with pytest.raises(ValueError, match="bias"):
        kquant.linear(torch.zeros(2, 256), weight, torch.zeros(3))
    with pytest.raises(ValueError, match="parts"):
        kquant.StoredWeight([(int(t), random_gguf_blocks(t, 2, 256)) for t in (Q.Q4_K, Q.Q6_K) * 3], 256)


def test_the_header_declares_the_stored_weight() -> None:
    """The ABI parser reads the K-quant weight's nested array of parts from the header."""
    from pagedllm.kernels import abi

    parts = dict(abi.STRUCTS["KQuantWeight"]._fields_)["parts"]
    assert parts._type_ is abi.STRUCTS["KQuantPart"] and parts._length_ == kquant.MAX_PARTS
    assert abi.FUNCTIONS["kquant_row_bytes"][0] is ctypes.c_int64


def test_prompt_rows_on_amx_tiles(native_isa: str) -> None:
    """Where the library runs AMX (Intel, AMX-BF16), a weight in panels takes its prompt rows
    (``prompt_from``) on the bfloat16 tiles, every format and a weight of two parts (a fused
    projection, 11 panels): x and gguf's dequantized weights rounded to bfloat16, their products summed in
    float32, equal to that in float64 to float32's rounding and nearer the float64 product than
    the int8 scheme; each row's bits the same however many rows share the call, the rows before
    ``prompt_from`` the int8 scheme's."""
    if not linear_kernels.amx_tiles():
        pytest.skip("no AMX tiles on this CPU or library (or PAGEDLLM_DISABLE_AMX=1)")
    for qtype, k in ((Q.Q4_K, 512), (Q.Q5_K, 256), (Q.Q6_K, 512), (Q.Q5_0, 128), (Q.Q8_0, 128)):
        # 11 panels: a thread decodes its next panel while it multiplies the current one
        parts = [(int(qtype), random_gguf_blocks(qtype, n, k, seed=n)) for n in (296, 24)]
        if qtype == Q.Q8_0:
            parts = [(t, without_minus_128(blocks)) for t, blocks in parts]
        weight = kquant.panels(kquant.StoredWeight(parts, k))
        w = torch.cat([gguf_values(qtype, blocks, k) for _, blocks in parts])
        bias = torch.randn(320)
        x = torch.randn(70, k + 3)[:, :k]
        y, vector = kquant.linear(x, weight, bias, prompt_from=0), kquant.linear(x, weight, bias)
        ref = x.bfloat16().double() @ w.bfloat16().double().T + bias.double()
        magnitude = x.bfloat16().double().abs() @ w.abs().T + bias.abs().double()
        assert ((y.double() - ref).abs() <= 1e-6 * magnitude).all(), qtype.name
        exact = x.double() @ w.T + bias.double()
        assert (y.double() - exact).norm() < (vector.double() - exact).norm(), qtype.name
        for first, last in ((0, 1), (5, 6), (3, 40), (33, 70)):
            assert torch.equal(kquant.linear(x[first:last], weight, bias, prompt_from=0), y[first:last])
        mixed = kquant.linear(x, weight, bias, prompt_from=30)
        assert torch.equal(mixed[:30], vector[:30]) and torch.equal(mixed[30:], y[30:])
