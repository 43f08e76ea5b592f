"""Sizing and allocating the per-layer paged K/V caches."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


def allocate_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim].

    The memory comes from numpy's calloc: zero pages the OS maps lazily, so start-up does
    not touch gigabytes, and never-written slots read as 0.0 (masked padding must not be NaN).
    """
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    per_layer = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(2 * config.num_layers * per_layer, dtype=np.uint8))
    flat = raw.view(dtype).view(config.num_layers, 2, *shape)
    return [(flat[i, 0], flat[i, 1]) for i in range(config.num_layers)]
