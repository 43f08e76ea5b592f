"""Paged attention and the K/V cache write on the native kernels (csrc/paged_attention.cpp,
prefill_attention.cpp, elementwise.cpp's write_kv_cache).

``decode_attention_supported`` and ``prefill_attention_supported`` say, from a layer's head
counts and size, whether the kernels cover it; the calls themselves raise on tensors outside
their contract (``kernels.args``).

Caches are [num_blocks, block_size, num_kv_heads, row]: row = head_dim values (float32,
bfloat16), or in the 8-bit caches (int8, float8_e4m3fn) head_dim codes and the row's float16
scale (``core.kv_cache_config.kv_row_width``), read as stored: the kernels widen codes in
registers and apply the scale there.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedllm.core.kv_cache_config import kv_row_width
from pagedllm.kernels import abi
from pagedllm.kernels.args import check_cpu, check_index, ptr, require
from pagedllm.kernels.library import native_library

# The K/V cache dtypes the kernels read, each its pagedllm_abi.h cache kind.
_CACHE_KINDS = {
    torch.float32: abi.CONSTANTS["PAGEDLLM_CACHE_F32"],
    torch.bfloat16: abi.CONSTANTS["PAGEDLLM_CACHE_BF16"],
    torch.int8: abi.CONSTANTS["PAGEDLLM_CACHE_INT8"],
    torch.float8_e4m3fn: abi.CONSTANTS["PAGEDLLM_CACHE_FP8"],
}
CACHE_DTYPES = tuple(_CACHE_KINDS)
_DECODE_ENTRIES = {
    torch.float32: "paged_decode_attention_f32",
    torch.bfloat16: "paged_decode_attention_bf16",
    torch.int8: "paged_decode_attention_int8",
    torch.float8_e4m3fn: "paged_decode_attention_fp8",
}


def cache_kind(dtype: torch.dtype) -> int:
    """The kernels' cache kind (``PAGEDLLM_CACHE_*``) of a K/V cache dtype.

    Raises:
        ValueError: for a dtype the kernels do not read.
    """
    if dtype not in _CACHE_KINDS:
        raise ValueError(f"the native kernels read K/V caches of {CACHE_DTYPES}, not {dtype}")
    return _CACHE_KINDS[dtype]
MAX_PREFILL_BLOCK = abi.CONSTANTS["PAGEDLLM_MAX_PREFILL_BLOCK"]  # largest block size of the prefill kernel
# Over an int8 cache, a tile of 16 softmax weights whose largest is at most this has codes 0.
INT8_WEIGHT_FLOOR = 2.0 ** abi.CONSTANTS["PAGEDLLM_INT8_WEIGHT_FLOOR_EXP"]


def decode_attention_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the native decode attention has a kernel for these head counts and size (False
    without a library)."""
    lib = native_library()
    if lib is None or not prefill_attention_supported(num_heads, num_kv_heads, head_dim):
        return False
    return num_heads // num_kv_heads <= lib.pagedllm_limits().contents.max_group


def prefill_attention_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the native prefill attention (and the K/V write) cover these head counts and
    size, at block sizes up to ``MAX_PREFILL_BLOCK`` (False without a library)."""
    lib = native_library()
    return lib is not None and head_dim in _head_dims(lib) and num_heads % num_kv_heads == 0


def attention_in_bfloat16_pairs(cache_dtype: torch.dtype, block_size: int, decode: bool) -> bool:
    """Whether the library in use multiplies bfloat16 pairs in attention over such a cache
    (csrc's pair modes: the queries and softmax weights rounded to bfloat16, fp8 K/V rows as
    code x scale rounded; sums float32): on a library built with AVX-512 BF16, decode over a
    bfloat16 cache, prefill over a bfloat16 or fp8 cache of an even block size. Never over an
    int8 cache: both kernels multiply its codes as integers. False without a library."""
    lib = native_library()
    if lib is None or "avx512_bf16" not in lib.pagedllm_requires().decode().split():
        return False
    if decode:
        return cache_dtype == torch.bfloat16
    return cache_dtype in (torch.bfloat16, torch.float8_e4m3fn) and block_size % 2 == 0


def int8_cache_queries(q: torch.Tensor, scale: float) -> torch.Tensor:
    """The queries an int8 cache's scores take (csrc/kv_rows.h's ``quantize_query``), as
    float32 values of q's shape [..., head_dim]: per head, x = q * scale as codes
    x * (127 / max|x|) rounded to nearest even, times max|x| / 127, divided by scale again
    (so that a caller scores them at ``scale`` as it would q)."""
    x = q.float() * scale
    amax = x.abs().amax(-1, keepdim=True)
    # 127 / max|x| rounded once, as the kernels divide (PyTorch's scalar / tensor multiplies by
    # the reciprocal, which moves a code at a tie now and then).
    inv = torch.where(amax > 0, amax.new_tensor(127.0) / amax, 0.0)
    codes = torch.where(amax > 0, x * inv, 0.0).round()
    return codes * (amax / 127.0) / scale


@functools.cache
def _head_dims(lib: ctypes.CDLL) -> tuple[int, ...]:
    """The head sizes ``lib``'s attention kernels take (its ``pagedllm_limits()``)."""
    limits = lib.pagedllm_limits().contents
    return tuple(limits.head_dims[: limits.num_head_dims])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Decode attention read in place through block tables.

    Args:
        q: [B, num_heads, head_dim], float (the kernel computes in float32); heads as
            ``decode_attention_supported`` accepts.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, row] of a ``CACHE_DTYPES``
            dtype, contiguous (row: see the module docstring).
        block_tables: [B, max_blocks] int64, contiguous; seq_lens: [B] int64 (keys per request).
        window: > 0: attend only to the last ``window`` keys; 0: all keys.

    Returns:
        [B, num_heads, head_dim] in q's dtype.

    Raises:
        RuntimeError: no native library here.
        ValueError: tensors outside this contract, or heads the kernel lacks.
    """
    lib = require()
    check_cpu(q, k_cache, v_cache)
    b, hq, d = q.shape
    _check_cache(k_cache, v_cache, hq, d)
    check_index(block_tables, "block_tables", (b, block_tables.shape[-1]))
    check_index(seq_lens, "seq_lens", (b,))
    q32 = q.float().contiguous()
    out = torch.empty_like(q32)
    kernel = getattr(lib, _DECODE_ENTRIES[k_cache.dtype])
    status = kernel(
        ptr(q32), ptr(k_cache), ptr(v_cache), ptr(block_tables), block_tables.shape[1], ptr(seq_lens),
        ptr(out), b, hq, k_cache.shape[2], d, k_cache.shape[1], scale, window,
    )
    if status != 0:
        raise ValueError(f"no decode attention kernel for {hq} heads over {k_cache.shape[2]} KV heads of {d}")
    return out.to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    spans: torch.Tensor,
    scale: float,
    window: int,
    out: torch.Tensor,
) -> None:
    """Causal attention of every prefill request's query rows over its paged context, into ``out``.

    Args:
        q: [T, num_heads, head_dim] float32, heads contiguous (rows at any stride).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, row] of a ``CACHE_DTYPES``
            dtype, contiguous, block_size <= ``MAX_PREFILL_BLOCK``, already holding this
            step's K/V. Float32 arithmetic, or bfloat16 pairs where
            ``attention_in_bfloat16_pairs``.
        block_tables: [R, max_blocks] int64, contiguous: each prefill request's blocks.
        spans: [3, R] int64, contiguous: per request its first query row, query count and keys.
        window: > 0: a query at position p sees keys p - window + 1 .. p; 0: all before it.
        out: [T, num_heads * head_dim] float32, contiguous; the prefill rows are written.

    Raises:
        RuntimeError: no native library here.
        ValueError: tensors outside this contract, or heads the kernel lacks.
    """
    lib = require()
    check_cpu(q, k_cache, v_cache, out)
    t, hq, d = q.shape
    if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != d:
        raise ValueError(f"prefill attention: q must be float32 with contiguous heads, got {q.dtype} {q.stride()}")
    _check_cache(k_cache, v_cache, hq, d)
    r = block_tables.shape[0]
    check_index(block_tables, "block_tables", (r, block_tables.shape[-1]))
    check_index(spans, "spans", (3, r))
    if out.shape != (t, hq * d) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 [{t}, {hq * d}], got {out.dtype} {list(out.shape)}")
    status = lib.paged_prefill_attention(
        cache_kind(k_cache.dtype), ptr(q), q.stride(0), ptr(k_cache), ptr(v_cache),
        ptr(block_tables), block_tables.shape[1], ptr(spans[0]), ptr(spans[1]), ptr(spans[2]),
        ptr(out), r, hq, k_cache.shape[2], d, k_cache.shape[1], scale, window,
    )
    if status != 0:
        raise ValueError(f"no prefill attention kernel for head size {d} or block size {k_cache.shape[1]}")


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``k_cache`` / ``v_cache`` slot ``slot_mapping[t]`` = row t of k / v, converted to the
    cache's dtype in one pass (8-bit caches: each head quantized with its own scale, once).

    Args:
        k, v: [T, num_kv_heads, head_dim] float32, heads contiguous, one row stride for both.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, row] of a ``CACHE_DTYPES``
            dtype, contiguous.
        slot_mapping: [T] int64, each < num_blocks * block_size.

    Raises:
        RuntimeError: no native library here.
        ValueError: tensors outside this contract.
    """
    lib = require()
    check_cpu(k, v, k_cache, v_cache)
    t, hkv, d = k.shape
    if (
        k.dtype != torch.float32 or v.dtype != torch.float32 or k.stride(0) != v.stride(0)
        or k.stride(1) != d or v.stride(1) != d or k.stride(2) != 1 or v.stride(2) != 1
    ):
        raise ValueError(f"k, v must be float32 rows of contiguous heads at one stride, got {k.dtype}, {v.dtype}")
    _check_cache(k_cache, v_cache, hkv, d)
    if v.shape != k.shape or k_cache.shape[2] != hkv:
        raise ValueError(f"k, v {list(k.shape)}, {list(v.shape)} do not fit the cache {list(k_cache.shape)}")
    check_index(slot_mapping, "slot_mapping", (t,))
    status = lib.write_kv_cache(
        cache_kind(k_cache.dtype), ptr(k), ptr(v), k.stride(0), ptr(k_cache), ptr(v_cache),
        ptr(slot_mapping), t, hkv, d,
    )
    if status != 0:
        raise ValueError(f"no K/V write for a {k_cache.dtype} cache of head size {d}")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, head_dim: int) -> None:
    """K and V caches alike, contiguous, of a dtype the kernels read and rows of head_dim, with a
    KV head count dividing num_heads."""
    if (
        k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype
        or k_cache.dtype not in CACHE_DTYPES or not k_cache.is_contiguous() or not v_cache.is_contiguous()
        or k_cache.shape[3] != kv_row_width(head_dim, k_cache.dtype) or num_heads % k_cache.shape[2]
    ):
        raise ValueError(
            f"kv cache: need two contiguous [blocks, block_size, kv_heads | {num_heads}, row of {head_dim}] of one "
            f"dtype of {CACHE_DTYPES}, got {list(k_cache.shape)} {k_cache.dtype}, {list(v_cache.shape)} {v_cache.dtype}"
        )
