"""GGUF Q8_0 weights on the w8a8 panels (kernels.linear's q8a8: ``linear_pack_q8_0``,
``linear_q8a8``; ``Q8A8Linear``): the codes and float16 scales copied bit for bit, the sums
exact for the Q8_0 x Q8_0 scheme on every ISA, rows independent of the batch, and the layer a
GGUF model's all-Q8_0 layers (a tied lm_head) take."""

from __future__ import annotations

import gguf
import pytest
import torch

from tests.test_kquant import gguf_values, quantized_x
from tests.utils import random_gguf_blocks

from pagedllm.kernels import kquant
from pagedllm.kernels import linear as kernels
from pagedllm.layers.quantization.linear import KQuantLinear, Q8A8Linear, stored_linear

Q8_0 = gguf.GGMLQuantizationType.Q8_0
# The ISAs whose int8 dot product takes a code of -128 (weights stored as q + 128: kDotXSums).
TAKES_MINUS_128 = ("avx512_bf16", "avx512_vnni")


def quantizer_blocks(n: int, k: int, seed: int) -> torch.Tensor:
    """Random Q8_0 blocks with codes in [-127, 127], as llama.cpp's and gguf's quantizers write them."""
    blocks = random_gguf_blocks(Q8_0, n, k, seed=seed).view(n, -1, 34)
    codes = blocks[..., 2:]
    return torch.cat([blocks[..., :2], codes.masked_fill(codes == 0x80, 0x81)], -1).view(n, -1)


def test_packing_copies_codes_and_scales(native_isa: str) -> None:
    """Panel p's code of row 32 p + c at input k sits at ((p * K/4 + k/4) * 32 + c) * 4 + k % 4
    (in the ISA's byte encoding: q + 128 where the dot product takes x sums), its group's d at
    (p * G + k / 32) * 32 + c, float16 bits as stored; rows past N are code 0 and d 0."""
    n, k = 37, 64
    blocks = quantizer_blocks(n, k, seed=1)
    codes, d = kernels.linear_pack_q8_0(blocks, k)
    b = blocks.view(n, k // 32, 34)
    q = b[..., 2:].reshape(n, k).view(torch.int8)
    stored = (q.view(torch.uint8) ^ 0x80).view(torch.int8) if native_isa in TAKES_MINUS_128 else q
    panels = codes.view(2, k // 4, 32, 4)
    for row in (0, 31, 32, 36):
        p, c = divmod(row, 32)
        assert torch.equal(panels[p, :, c, :].reshape(k), stored[row])
        assert torch.equal(d.view(2, k // 32, 32)[p, :, c], b[row, :, :2].contiguous().view(torch.float16).view(-1))
    zero = -128 if native_isa in TAKES_MINUS_128 else 0  # code 0 as stored
    assert (panels[1, :, 5:] == zero).all() and not d.view(2, k // 32, 32)[1, :, 5:].any()


def test_gemm_is_exact_for_its_scheme(native_isa: str) -> None:
    """The int32 sums of the stored codes and x's int8 codes (per group of 32), scaled by d and
    x's scale: equal to gguf's dequantized weights times the quantized activations in float64 at
    M = 1 to 29 (not multiples of the micro-tile), N not a multiple of the panels, rows at a
    stride, with a bias; the same values as the K-quant GEMM's on the same blocks (its prefill
    panels run this tile: without a bias, the same bits)."""
    n = 37
    torch.manual_seed(0)  # x drawn away from float64's rounding ties of the reference's codes
    for k in (64, 640):
        blocks = quantizer_blocks(n, k, seed=k)
        w = gguf_values(Q8_0, blocks, k)
        packed = kernels.linear_pack_q8_0(blocks, k)
        stored = kquant.StoredWeight([(int(Q8_0), blocks)], k)
        bias = torch.randn(n)
        padded = torch.cat([bias, torch.zeros(-n % kernels.PANEL)])
        for m in (1, 2, 3, 5, 8, 13, 29):
            wide = torch.randn(m, k + 5) * torch.cat([torch.linspace(0.1, 3, k), torch.ones(5)])
            x = wide[:, :k]  # rows at stride k + 5
            x[0] = 0.0  # an all-zero row gives the bias exactly
            xq, xs = quantized_x(x)
            ref = (xq * xs).view(m, k) @ w.T + bias.double()
            magnitude = (xq * xs).view(m, k).abs() @ w.abs().T + bias.double().abs()
            y = kernels.linear_q8a8(x, packed, padded, n)
            assert y.shape == (m, n)
            assert ((y.double() - ref).abs() <= 1e-5 * magnitude + 1e-6).all()
            assert torch.equal(y[0], bias)
            assert torch.allclose(y, kquant.linear(x, stored, bias), rtol=1e-5, atol=1e-5)
            if m >= 8:
                assert torch.equal(kernels.linear_q8a8(x, packed, None, n), kquant.linear(x, stored))


def test_rows_do_not_depend_on_the_batch(native_isa: str) -> None:
    """Each row of y has the same bits whatever rows share the call and wherever it falls in the
    micro-tiles: a request's logits do not change with its batch, its speculative verification
    or its prefill's chunking."""
    n, k = 41, 640
    packed = kernels.linear_pack_q8_0(quantizer_blocks(n, k, seed=3), k)
    x = torch.randn(11, k) * torch.linspace(0.1, 3, k)
    alone = torch.cat([kernels.linear_q8a8(x[i : i + 1], packed, None, n) for i in range(11)])
    for m in range(2, 12):
        for start in (0, 11 - m):
            assert torch.equal(kernels.linear_q8a8(x[start : start + m], packed, None, n), alone[start : start + m])


def test_minus_128_packs_only_where_the_dot_product_takes_it(native_isa: str) -> None:
    """A code of -128 (never written by the quantizers, legal in the format): VNNI's dot product
    (weights as q + 128) takes it, exactly; elsewhere the sign trick cannot negate it, packing
    declines and the layer is the K-quant GEMM's, which reads such blocks."""
    n, k = 33, 64
    blocks = quantizer_blocks(n, k, seed=4)
    blocks.view(n, -1, 34)[5, 1, 7] = 0x80
    packed = kernels.linear_pack_q8_0(blocks, k)
    layer = stored_linear(kquant.StoredWeight([(int(Q8_0), blocks)], k))
    if native_isa in TAKES_MINUS_128:
        assert packed is not None and isinstance(layer, Q8A8Linear)
        x = torch.randn(3, k)
        xq, xs = quantized_x(x)
        ref = (xq * xs).view(3, k) @ gguf_values(Q8_0, blocks, k).T
        assert torch.allclose(layer(x).double(), ref, rtol=1e-5, atol=1e-5)
    else:
        assert packed is None and isinstance(layer, KQuantLinear)


def test_stored_linear_takes_q8a8_for_all_q8_0_weights_only(native_isa: str) -> None:
    """A weight all of Q8_0 blocks becomes a Q8A8Linear, with the K-quant layer's outputs (to
    float32 rounding), in the one-call decoder's descriptor as kind LINEAR_Q8A8; a fused weight
    with parts of other formats stays a KQuantLinear. Wrong shapes are refused."""
    k = 256
    q8 = quantizer_blocks(40, k, seed=6)
    layer = stored_linear(kquant.StoredWeight([(int(Q8_0), q8)], k), bias=torch.arange(40.0))
    assert isinstance(layer, Q8A8Linear) and layer.native_desc().kind == kernels.LINEAR_Q8A8
    x = torch.randn(4, k)
    expected = KQuantLinear(kquant.StoredWeight([(int(Q8_0), q8)], k), bias=torch.arange(40.0))(x)
    assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-5)
    q4k = random_gguf_blocks(gguf.GGMLQuantizationType.Q4_K, 8, k, seed=7)
    mixed = kquant.StoredWeight([(int(Q8_0), q8), (int(gguf.GGMLQuantizationType.Q4_K), q4k)], k)
    assert isinstance(stored_linear(mixed), KQuantLinear)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.linear_pack_q8_0(q8, 250)
    with pytest.raises(ValueError, match="Q8_0 blocks"):
        kernels.linear_pack_q8_0(q8[:, :-1], k)
    with pytest.raises(ValueError, match="q8a8 scales"):
        kernels.linear_q8a8(x, (layer.packed, layer.d[:-1]), None, 40)
