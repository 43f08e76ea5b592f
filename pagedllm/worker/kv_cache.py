"""Sizing and allocating the paged K/V caches."""

from __future__ import annotations

import mmap

import numpy as np
import torch

from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.core.kv_cache_groups import KVCacheGroup, layers_per_block
from pagedllm.kernels import huge_pages
from pagedllm.layers.attention_metadata import AttentionMetadata


def allocate_kv_caches(kv: KVCacheConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each [num_blocks, block_size, num_kv_heads, kv.row_width] in
    ``kv.dtype`` (the 8-bit caches' rows: head_dim codes, then the scale's bytes).

    ``num_kv_heads`` is this rank's share (``kv.num_kv_heads``). The ``j``-th layer of every
    KV cache group gets the same tensors (see ``core/kv_cache_groups.py``): block ids, not
    tensors, keep the groups apart. With one group (every layer global) each layer has
    tensors of its own.

    The memory is zeros (``zeroed_memory``): never-written slots read as 0.0 (masked padding
    must not be NaN; an 8-bit row's codes and scale are 0 too).
    """
    num_slots = layers_per_block(kv.groups)
    dtype = kv.torch_dtype
    shape = (kv.num_blocks, kv.block_size, kv.num_kv_heads, kv.row_width)
    per_layer = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = zeroed_memory(2 * num_slots * per_layer)
    flat = raw.view(dtype).view(num_slots, 2, *shape)
    caches: list[tuple[torch.Tensor, torch.Tensor]] = [None] * kv.num_layers  # type: ignore[list-item]
    for group in kv.groups:
        for j, layer in enumerate(group.layers):
            caches[layer] = (flat[j, 0], flat[j, 1])
    return caches


# Linux 5.14's madvise: fault every page of the range in now, writable. Not in Python's mmap module.
_MADV_POPULATE_WRITE = 23


def zeroed_memory(nbytes: int) -> torch.Tensor:
    """``nbytes`` zero bytes (uint8, 1-D) in an anonymous private mapping, in 2 MiB pages where
    Linux grants them (``huge_pages.advise``), whose pages are mapped now where the kernel can
    (``MADV_POPULATE_WRITE``: one pass at start-up), else on first touch.

    Why: a page first touched inside a step costs a page fault and the kernel's zeroing of it
    in the K/V write, 4 KiB at a time, until the whole pool has been used once
    (docs/benchmarks.md, "Where a step's time goes"); and a decode step reads a few KiB of each
    request's blocks wherever they are, in 4 KiB pages mostly one TLB walk each (decode
    attention over blocks at random places 1.05-1.10x faster in 2 MiB pages; docs/benchmarks.md,
    "AMD EPYC Zen 4, session 50").
    """
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    huge_pages.advise(buf)
    try:
        buf.madvise(_MADV_POPULATE_WRITE)
    except OSError:  # an older kernel: EINVAL; the pages come on first touch
        pass
    return torch.frombuffer(buf, dtype=torch.uint8)


def build_attention_metadata(
    groups: list[KVCacheGroup],
    num_layers: int,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[list[int]]],
    block_size: int,
    num_decode_requests: int | None = None,
) -> list[AttentionMetadata]:
    """The step's attention metadata for each layer: one per KV cache group, shared by its layers.

    Args:
        block_tables: per request, its block table in each group.
        num_decode_requests: the leading requests whose rows take the decode kernel
            (``AttentionMetadata.build``).
    """
    per_layer: list[AttentionMetadata] = [None] * num_layers  # type: ignore[list-item]
    for g, group in enumerate(groups):
        tables = [t[g] for t in block_tables]
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, num_decode_requests)
        for layer in group.layers:
            per_layer[layer] = meta
    return per_layer
