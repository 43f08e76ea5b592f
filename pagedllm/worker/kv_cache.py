"""Sizing and allocating the paged K/V caches."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.core.kv_cache_groups import KVCacheGroup, layers_per_block
from pagedllm.layers.attention import AttentionMetadata


def allocate_kv_caches(kv: KVCacheConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each [num_blocks, block_size, num_kv_heads, kv.row_width] in
    ``kv.dtype`` (the 8-bit caches' rows: head_dim codes, then the scale's bytes).

    ``num_kv_heads`` is this rank's share (``kv.num_kv_heads``). The ``j``-th layer of every
    KV cache group gets the same tensors (see ``core/kv_cache_groups.py``): block ids, not
    tensors, keep the groups apart. With one group (every layer global) each layer has
    tensors of its own.

    The memory comes from numpy's calloc: zero pages the OS maps lazily, so start-up does
    not touch gigabytes, and never-written slots read as 0.0 (masked padding must not be NaN; an
    8-bit row's codes and scale are 0 too).
    """
    num_slots = layers_per_block(kv.groups)
    dtype = kv.torch_dtype
    shape = (kv.num_blocks, kv.block_size, kv.num_kv_heads, kv.row_width)
    per_layer = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(2 * num_slots * per_layer, dtype=np.uint8))
    flat = raw.view(dtype).view(num_slots, 2, *shape)
    caches: list[tuple[torch.Tensor, torch.Tensor]] = [None] * kv.num_layers  # type: ignore[list-item]
    for group in kv.groups:
        for j, layer in enumerate(group.layers):
            caches[layer] = (flat[j, 0], flat[j, 1])
    return caches


def build_attention_metadata(
    groups: list[KVCacheGroup],
    num_layers: int,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[list[int]]],
    block_size: int,
) -> list[AttentionMetadata]:
    """The step's attention metadata for each layer: one per KV cache group, shared by its layers.

    Args:
        block_tables: per request, its block table in each group.
    """
    per_layer: list[AttentionMetadata] = [None] * num_layers  # type: ignore[list-item]
    for g, group in enumerate(groups):
        meta = AttentionMetadata.build(query_lens, seq_lens, [t[g] for t in block_tables], block_size)
        for layer in group.layers:
            per_layer[layer] = meta
    return per_layer
