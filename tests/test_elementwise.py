"""The native fused elementwise kernels (csrc/elementwise.cpp) against their PyTorch definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import attention, elementwise, linear
from pagedllm.layers.activation import GeluTanhAndMul, SiluAndMul
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary import ApplyRotary, RotaryEmbedding
from pagedllm.layers.sampler import RowArgmax

pytestmark = pytest.mark.usefixtures("native_isa")  # each test on every ISA's kernels


@pytest.mark.parametrize("rows", [1, 5, 100])  # 100: the rows split over threads
@pytest.mark.parametrize("hidden", [24, 576])  # 24: a partial vector
def test_add_rms_norm(rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(hidden, 1e-5, torch.float32)
    assert norm.uses_native
    norm.weight.data = torch.randn(hidden, generator=gen)
    x, residual = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    total = x + residual
    out, stream = norm(x, residual.clone())
    torch.testing.assert_close(stream, total, atol=0, rtol=0)
    torch.testing.assert_close(out, F.rms_norm(total, (hidden,), norm.weight, 1e-5), atol=1e-5, rtol=1e-5)
    out, stream = norm(x)  # the first block: no residual yet, x is the stream
    assert stream is x
    torch.testing.assert_close(out, F.rms_norm(x, (hidden,), norm.weight, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [3, 100])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rotary_in_place(rows: int, head_dim: int) -> None:
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, torch.float32)
    positions = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(0))
    cos, sin = rope(positions)
    qkv = torch.randn(rows, 7 * head_dim)  # 5 q/k heads, then 2 v heads left alone
    x = qkv[:, : 5 * head_dim].view(rows, 5, head_dim)
    expected = torch.addcmul(x * cos, x.roll(head_dim // 2, -1), sin)
    v = qkv[:, 5 * head_dim :].clone()
    assert ApplyRotary()(x, cos, sin).data_ptr() == x.data_ptr()  # rotated in place
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, 5 * head_dim :], v)


@pytest.mark.parametrize("rows", [2, 100])
def test_silu_and_mul(rows: int) -> None:
    gate_up = torch.randn(rows, 2 * 40) * 30  # large |gate|: both tails of the sigmoid
    gate, up = gate_up.chunk(2, -1)
    expected = F.silu(gate) * up
    torch.testing.assert_close(SiluAndMul()(gate_up.clone()), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [2, 100])
def test_gelu_tanh_and_mul(rows: int) -> None:
    gate_up = torch.randn(rows, 2 * 40) * 10  # |gate| up to ~40: both tails of tanh
    gate, up = gate_up.chunk(2, -1)
    expected = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(GeluTanhAndMul()(gate_up.clone()), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 100])
def test_write_kv(dtype: torch.dtype, rows: int) -> None:
    k_cache, v_cache = torch.zeros(20, 16, 3, 64, dtype=dtype), torch.zeros(20, 16, 3, 64, dtype=dtype)
    qkv = torch.randn(rows, 9 * 64)  # k and v as views of the fused projection's rows
    k, v = qkv[:, 3 * 64 : 6 * 64].view(rows, 3, 64), qkv[:, 6 * 64 :].view(rows, 3, 64)
    slots = torch.randperm(20 * 16)[:rows]
    attention.write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 3, 64)[slots], k.to(dtype))  # bfloat16: round to nearest even
    assert torch.equal(v_cache.view(-1, 3, 64)[slots], v.to(dtype))
    assert int((k_cache.view(-1, 3 * 64) != 0).any(1).sum()) == rows  # no other slot touched


@pytest.mark.parametrize("shape", [(1, 5), (3, 37), (32, 49152)])
def test_greedy_argmax_takes_the_first_maximum(shape: tuple[int, int]) -> None:
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1]))
    logits[0, -1] = 100.0  # in the last, partial vector
    if shape[0] > 2:
        logits[2, 1] = logits[2, -2] = 100.0  # a tie: the first index wins, as in argmax
    assert torch.equal(RowArgmax()(logits), logits.argmax(-1))


def test_misuse_raises() -> None:
    """Calls outside a kernel's contract (shapes, index dtypes, other dtypes or devices) raise
    before reaching C."""
    k = torch.randn(4, 2, 64)
    cache = torch.zeros(3, 16, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping: need contiguous int64 \\[4\\]"):
        attention.write_kv_cache(k, k, cache, cache.clone(), torch.arange(4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"kv_heads \| 2, row of 64\] .* got \[3, 16, 4, 64\]"):
        attention.write_kv_cache(k, k, torch.zeros(3, 16, 4, 64), torch.zeros(3, 16, 4, 64), torch.arange(4))
    with pytest.raises(ValueError, match=r"one dtype of .* got .* torch.float16"):
        attention.write_kv_cache(k, k, cache.half(), cache.half(), torch.arange(4))
    with pytest.raises(ValueError, match="weight \\[5\\]"):
        elementwise.add_rms_norm(None, torch.randn(3, 8), torch.ones(5), 1e-5)
    packed = linear.linear_pack_f32(torch.randn(40, 16))
    with pytest.raises(ValueError, match="packed weight"):
        linear.linear_f32(torch.randn(2, 17), packed, None, 40)
    with pytest.raises(ValueError, match="bias: need float32 \\[64\\]"):
        linear.linear_f32(torch.randn(2, 16), packed, torch.zeros(40), 40)
    with pytest.raises(ValueError, match="CPU tensors"):
        elementwise.argmax_rows(torch.randn(2, 5, device="meta"))
    with pytest.raises(ValueError, match="float32"):
        elementwise.silu_and_mul(torch.randn(2, 8, dtype=torch.bfloat16))


def test_layers_hand_other_dtypes_to_pytorch() -> None:
    """A layer built on the kernels runs a call of another dtype (a model cast after it was
    built) in PyTorch: the run-time check each forward_cpu makes."""
    gate_up = torch.randn(3, 16, dtype=torch.bfloat16)
    gate, up = gate_up.float().chunk(2, -1)
    act = SiluAndMul()
    assert act.uses_native
    torch.testing.assert_close(act(gate_up.clone()).float(), F.silu(gate) * up, atol=2e-2, rtol=2e-2)
    norm = RMSNorm(8, 1e-5, torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(norm(x)[0], F.rms_norm(x, (8,), norm.weight, 1e-5))
