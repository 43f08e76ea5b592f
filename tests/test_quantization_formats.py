"""Weight-only quantization formats and the layers that run them: int8 and int4 round trips
and their error bounds, int4's scale search, GGUF's Q8_0/Q4_0/Q4_1 blocks unpacked to gguf's
own values bit for bit, and the packed-kernel layers (int8, int4, int8 blocks) against float
references."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagedllm.layers.quantization.gguf import unpack_q4_0, unpack_q4_1, unpack_q8_0
from pagedllm.layers.quantization.linear import Int4Linear, Int8BlockLinear, Int8Linear, make_linear
from pagedllm.layers.quantization.weights import Int8Weight, quantize_int4, quantize_int8


def weights(n: int = 72, k: int = 256, seed: int = 0) -> torch.Tensor:
    """[n, k] float32 with row scales spread over 100x, an outlier, an all-zero row and a constant group."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n).unsqueeze(1)
    w[3, 17] = 8.0
    w[5] = 0.0
    w[6, 32:64] = 0.25
    return w


# --- formats ----------------------------------------------------------------------------------


def test_int8_round_trip_within_half_a_step() -> None:
    w = weights()
    qw = quantize_int8(w)
    assert qw.q.dtype == torch.int8 and qw.scales.shape == (w.shape[0], 1) and qw.group_size == w.shape[1]
    assert int(qw.q.abs().max()) <= 127
    assert torch.equal(qw.scales, qw.scales.bfloat16().float())  # the kernel's scales exactly
    assert ((qw.dequantize() - w).abs() <= qw.scales / 2).all()
    assert torch.equal(qw.dequantize()[5], torch.zeros(w.shape[1]))


def test_int8_slice_with_the_whole_rows_maxima_is_the_whole_rows_codes() -> None:
    """A tensor-parallel rank's slice of each row, quantized with the whole rows' max|w|, has
    the whole weight's codes and scales."""
    w = weights()
    whole, part = quantize_int8(w), quantize_int8(w[:, 64:], w.abs().amax(dim=1))
    assert torch.equal(part.q, whole.q[:, 64:]) and torch.equal(part.scales, whole.scales)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_min_max_round_trip_within_half_a_step(group_size: int) -> None:
    w = weights()
    qw = quantize_int4(w, group_size, search=False)
    assert qw.group_size == group_size and int(qw.q.max()) <= 15
    scales = qw.scales.repeat_interleave(group_size, 1)
    zeros = (qw.mins + 8 * qw.scales).repeat_interleave(group_size, 1)
    assert torch.equal(zeros, zeros.bfloat16().float())  # the kernel's zero points exactly
    assert ((qw.dequantize() - w).abs() <= scales / 2 + zeros.abs() / 512).all()
    assert torch.equal(qw.dequantize()[5], torch.zeros(w.shape[1]))


def _group_sse(w: torch.Tensor, qw) -> torch.Tensor:
    """[N, K / group_size] sum of squared reconstruction errors per group."""
    return (qw.dequantize() - w).square().view(w.shape[0], -1, qw.group_size).sum(-1)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int4_search_never_worse_than_min_max(group_size: int, seed: int) -> None:
    w = weights(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    w[10:20] = torch.rand(10, w.shape[1], generator=gen) - 0.3  # skewed, uniform groups too
    qw, plain = quantize_int4(w, group_size), quantize_int4(w, group_size, search=False)
    assert qw.q.dtype == torch.uint8 and int(qw.q.max()) <= 15 and qw.scales.shape == plain.scales.shape
    zeros = qw.mins + 8 * qw.scales
    assert torch.equal(zeros, zeros.bfloat16().float()) and torch.equal(qw.scales, qw.scales.bfloat16().float())
    assert (qw.scales > 0).all()
    sse, plain_sse = _group_sse(w, qw), _group_sse(w, plain)
    assert (sse <= plain_sse).all()  # per group, by construction
    assert float(sse.sum()) < 0.85 * float(plain_sse.sum())  # and clearly better overall
    # Per element, the min/max bound holds up to sqrt(group_size) (each error^2 <= its group's sum).
    s = plain.scales.repeat_interleave(group_size, 1)
    z = (plain.mins + 8 * plain.scales).repeat_interleave(group_size, 1)
    assert ((qw.dequantize() - w).abs() <= group_size**0.5 * (s / 2 + z.abs() / 512)).all()
    assert torch.equal(qw.dequantize()[5], torch.zeros(w.shape[1]))  # the all-zero row stays exact
    if group_size == 32:
        assert torch.equal(qw.dequantize()[6, 32:64], w[6, 32:64])  # and the constant group


def test_int4_search_recovers_a_coarser_grid() -> None:
    """Weights already on a 4-bit grid whose codes span only 0..14 (a GGUF 4-bit block whose
    scale was fitted, not min/max, requantized from float): min/max's 15 steps miss the grid,
    the search's 14-step trial finds it exactly."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 15, (64, 8, 32), generator=gen).float()
    codes[..., 0], codes[..., 1] = 0, 14
    d = (torch.rand(64, 8, 1, generator=gen) * 0.02 + 0.005).bfloat16().float()
    w = (d * (codes - 7)).view(64, 256)
    plain_err = float((quantize_int4(w, 32, search=False).dequantize() - w).square().sum())
    assert plain_err > 0
    assert torch.equal(quantize_int4(w, 32).dequantize(), w)


def test_int4_group_size_must_divide_input_dim() -> None:
    with pytest.raises(ValueError, match="group size 128 does not divide the input dimension 96"):
        quantize_int4(torch.randn(16, 96), 128)


def _gguf_blocks(w: np.ndarray, qtype: Q) -> tuple[torch.Tensor, np.ndarray]:
    """(blocks [N, K / 32, bytes], gguf's own dequantization [N, K]) of ``w`` quantized by gguf."""
    raw = gguf.quants.quantize(w, qtype)
    blocks = torch.from_numpy(raw).view(w.shape[0], -1, gguf.GGML_QUANT_SIZES[qtype][1])
    return blocks, gguf.quants.dequantize(raw, qtype)


@pytest.mark.parametrize(("qtype", "unpack"), [(Q.Q8_0, unpack_q8_0), (Q.Q4_0, unpack_q4_0), (Q.Q4_1, unpack_q4_1)])
def test_gguf_blocks_unpack_to_gguf_values_exactly(qtype: Q, unpack) -> None:
    w = weights(48, 160).numpy()
    blocks, expected = _gguf_blocks(w, qtype)
    assert torch.equal(unpack(blocks).dequantize(), torch.from_numpy(expected))
    # Random bytes too: every code in every nibble position, scales and mins of any sign.
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (40, 5, blocks.shape[-1]), dtype=torch.uint8, generator=gen)
    for offset in (0, 2) if qtype == Q.Q4_1 else (0,):
        blocks[..., offset : offset + 2] = torch.randn(40, 5, 1, generator=gen).half().view(torch.uint8)
    expected = gguf.quants.dequantize(blocks.flatten(1).numpy(), qtype)
    assert torch.equal(unpack(blocks).dequantize(), torch.from_numpy(expected))


# --- layers -----------------------------------------------------------------------------------


def _kernel_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """What the layer computes, in float32: bfloat16 inputs times the exact quantized weights."""
    return x.bfloat16().float() @ w.T + bias


@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("layout", ["int8", "int4-g32", "int4-g64", "int4-g128", "int8-blocks"])
def test_quantized_linear_matches_float_reference(layout: str, batch: int) -> None:
    w = weights(72, 256)  # 72 rows: the int4 kernel's 16-row padding is exercised
    gen = torch.Generator().manual_seed(batch)
    x, bias = torch.randn(batch, 256, generator=gen), torch.randn(72, generator=gen)
    if layout == "int8":
        qw, cls, tol = quantize_int8(w), Int8Linear, 0.02
    elif layout == "int8-blocks":  # GGUF Q8_0 with scales the kernel holds exactly
        scales = (w.view(72, 8, 32).abs().amax(-1) / 127).clamp_min(1e-8).bfloat16().float()
        q = (w / scales.repeat_interleave(32, 1)).round().clamp(-128, 127).to(torch.int8)
        qw, cls, tol = Int8Weight(q, scales), Int8BlockLinear, 0.02
    else:
        qw, cls, tol = quantize_int4(w, int(layout.rpartition("g")[2])), Int4Linear, 0.15
    layer = make_linear(qw, bias)
    assert type(layer) is cls
    for dtype in (torch.float32, torch.bfloat16):
        y = layer(x.to(dtype))
        assert y.dtype == dtype and y.shape == (batch, 72)
    y = layer(x)
    # Against the exact quantized weights: only bfloat16 rounding of the output apart.
    expected = _kernel_reference(x, qw.dequantize(), bias)
    torch.testing.assert_close(y, expected, rtol=2**-7, atol=1e-3 * float(expected.abs().max()))
    # Against the float weights: within the format's error.
    reference = x @ w.T + bias
    assert float((y - reference).norm() / reference.norm()) < tol

