"""The 8-bit K/V caches' kernels, per ISA and in PyTorch: the scale's bytes, the row write, attention on stored rows."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.core.kv_cache_config import KV_SCALE_BYTES, kv_row_width
from pagedllm.core.kv_cache_config import QUANTIZED_KV_DTYPES as EIGHT_BIT
from pagedllm.kernels import abi
from pagedllm.kernels import attention as kernels
from pagedllm.kernels.attention import attention_in_bfloat16_pairs
from pagedllm.layers.attention import PagedAttention, _write_kv_torch
from pagedllm.layers.attention_metadata import AttentionMetadata
from tests.native_isa import ISAS, on_isa
from tests.utils import assert_int8_attention, bfloat16_pair_bound


def _scales(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Cache rows [..., head_dim + 2] -> their float16 scales as float32 [..., 1]."""
    return rows[..., head_dim:].contiguous().view(torch.float16).float()


def _dequantize(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Cache rows [..., head_dim + 2] as float32 values: codes (torch's own float8 decoding) x scale."""
    return rows[..., :head_dim].float() * _scales(rows, head_dim)


def _half_step(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest rounding error of each value of x [..., D] in codes of its row's ``scale``
    [..., 1]: half a step."""
    if dtype == torch.int8:
        return (scale / 2).expand_as(x)
    # e4m3: 3 mantissa bits (half an ulp: 2^-4 of the value), subnormals in steps of 2^-9 of the scale
    return torch.maximum(x.abs() / 16, scale / 1024)


def _float16_bytes(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float16).view(torch.uint8)


def test_scale_bytes_agree_with_the_kernels() -> None:
    assert KV_SCALE_BYTES == abi.CONSTANTS["PAGEDLLM_KV_SCALE_BYTES"]


def _random_step(dtype: torch.dtype, window: int, poison_scale: float, seed: int = 0):
    """A mixed step (decodes, first and later prefill chunks) over an 8-bit cache of shuffled
    blocks, earlier context written by the PyTorch quantizer; under a window, the blocks wholly
    before every query's window are holes: the table points at a block of codes 1 and scales
    ``poison_scale``."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    block_size, num_blocks, hkv, h, d = 4, 80, 2, 6, 64
    row = kv_row_width(d, dtype)
    k_cache = torch.zeros(num_blocks, block_size, hkv, row, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    poison = num_blocks - 1
    for cache in (k_cache, v_cache):
        cache[poison].view(torch.uint8)[..., :d] = 0x38 if dtype == torch.float8_e4m3fn else 1
        cache[poison].view(torch.uint8)[..., d:] = _float16_bytes(poison_scale)
    free = list(range(num_blocks - 1))
    rng.shuffle(free)
    reqs = [(5, 1), (0, 1), (11, 1), (30, 1), (0, 7), (6, 5), (3, 4), (9, 2), (0, 37), (20, 19)]
    tables, k_new, v_new = [], [], []
    for cached, new in reqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        kk, vv = torch.randn(total, hkv, d) * 3, torch.randn(total, hkv, d)
        kk[:, :, 5] += 20  # an outlier channel, as real keys have
        slots = [table[p // block_size] * block_size + p % block_size for p in range(cached)]
        _write_kv_torch(kk[:cached], vv[:cached], (k_cache, v_cache), torch.tensor(slots, dtype=torch.long))
        if window:
            first_key = max(0, cached - window + 1)  # the first query's window start
            table = [poison if (i + 1) * block_size <= first_key else b for i, b in enumerate(table)]
        tables.append(table), k_new.append(kk[cached:]), v_new.append(vv[cached:])
    query_lens = [n for _, n in reqs]
    seq_lens = [c + n for c, n in reqs]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    q = torch.randn(sum(query_lens), h, d)
    return reqs, tables, meta, q, torch.cat(k_new), torch.cat(v_new), k_cache, v_cache, (h, hkv, d, block_size)


def _dense(q, k, v, scale, window):
    """q [n, H, D] at the last n positions of k, v [L, Hkv, D], float32 throughout."""
    n, h, _ = q.shape
    group = h // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    L = k.shape[0]
    q_pos, k_pos = torch.arange(L - n, L)[None, :, None], torch.arange(L)[None, None, :]
    masked = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else torch.zeros((), dtype=torch.bool))
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(masked, float("-inf")).softmax(-1), v).reshape(n, -1)


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=["int8", "fp8"])
@pytest.mark.parametrize("backend", [*ISAS, "torch"])
def test_attention_reads_the_cache_as_stored(backend: str, dtype: torch.dtype, window: int) -> None:
    """Decode and (chunked) prefill attention over an 8-bit cache equal the float32 reference
    over the dequantized rows (float32 rounding only; over int8 on its integer codes, as
    ``tests.utils.assert_int8_attention`` checks). Holes in the tables are never read by
    the kernels (NaN there would show), never attended by PyTorch (which gathers them: 1e4)."""
    poison = 1e4 if backend == "torch" else float("nan")
    reqs, tables, meta, q, k, v, k_cache, v_cache, (h, hkv, d, block_size) = _random_step(dtype, window, poison)
    attn = PagedAttention(h, hkv, d, d**-0.5, window)
    pairs = False  # prefill in bfloat16 pairs: its rows are held to the rounding's bound
    if backend == "torch":
        out = attn.forward_native(q, k, v, (k_cache, v_cache), meta)
    else:
        with on_isa(backend):
            assert attn.uses_native and attn.native_decode
            out = attn(q, k, v, (k_cache, v_cache), meta)
            pairs = attention_in_bfloat16_pairs(dtype, block_size, decode=False)
    assert torch.isfinite(out).all()
    start = 0
    for (cached, new), table in zip(reqs, tables):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(cached + new)]
        rows_k = k_cache.flatten(0, 1)[slots]
        rows_v = v_cache.flatten(0, 1)[slots]
        first_key = max(0, cached - window + 1) if window else 0
        keys, values = _dequantize(rows_k, d), _dequantize(rows_v, d)
        keys[:first_key] = 0  # holes: never attended (the window masks them), here zeros, not NaN
        values[:first_key] = 0
        queries = q[start : start + new]
        if dtype == torch.int8:  # integer products of codes, as the kernels'
            assert_int8_attention(out[start : start + new], queries, keys[first_key:], rows_v[first_key:], first_key,
                                  d**-0.5, window)
            start += new
            continue
        ref = _dense(queries, keys, values, d**-0.5, window)
        if pairs and new > 1:
            bound = bfloat16_pair_bound(queries, keys, values, d**-0.5)
            assert ((out[start : start + new] - ref).abs() <= bound + 1e-4).all()
        else:
            torch.testing.assert_close(out[start : start + new], ref, atol=1e-4, rtol=1e-4)
        start += new


@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=["int8", "fp8"])
@pytest.mark.parametrize("isa", ISAS)
def test_native_write_quantizes_as_pytorch_within_half_a_step(isa: str, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    t, hkv, d, block_size = 37, 2, 64, 8
    qkv = torch.randn(t, 3 * hkv * d) * torch.logspace(-3, 2, t)[:, None]  # rows of any magnitude
    qkv[3, hkv * d : 2 * hkv * d] = 0  # an all-zero K row: scale 0
    k = qkv[:, hkv * d : 2 * hkv * d].view(t, hkv, d)
    v = qkv[:, 2 * hkv * d :].view(t, hkv, d)  # one row stride for both, as the fused qkv's
    slots = torch.randperm(8 * block_size)[:t]
    shape = (8, block_size, hkv, kv_row_width(d, dtype))
    native = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    torch_path = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    with on_isa(isa):
        kernels.write_kv_cache(k, v, *native, slots)
    _write_kv_torch(k, v, torch_path, slots)
    for a, b, x in zip(native, torch_path, (k, v)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        rows = a.flatten(0, 1)[slots]
        scale = _scales(rows, d)
        assert (scale >= x.abs().amax(-1, keepdim=True) / (127 if dtype == torch.int8 else 448)).all()
        assert ((_dequantize(rows, d) - x).abs() <= _half_step(x, scale, dtype) * 1.0001).all()


@pytest.mark.parametrize("isa", ISAS)
def test_every_e4m3_code_reads_back(isa: str) -> None:
    """A one-key context: attention's output is V's row, here every e4m3 code but the NaNs."""
    d = 64
    codes = torch.arange(256, dtype=torch.uint8)
    codes[[0x7F, 0xFF]] = 0
    k_cache = torch.zeros(4, 1, 1, kv_row_width(d, torch.float8_e4m3fn), dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    v_cache.view(torch.uint8)[:, 0, 0, :d] = codes.view(4, d)
    v_cache.view(torch.uint8)[:, 0, 0, d:] = _float16_bytes(0.75)
    q = torch.randn(4, 1, d)
    with on_isa(isa):
        decoded = kernels.paged_decode_attention(
            q, k_cache, v_cache, torch.arange(4).view(4, 1), torch.ones(4, dtype=torch.long), 1.0
        )
    expected = codes.view(torch.float8_e4m3fn).float().view(4, d) * 0.75
    torch.testing.assert_close(decoded.view(4, d), expected, rtol=0, atol=0)

