"""KV cache groups: layers that share one block table because they attend the same way.

A model whose layers all attend to the whole context has one group holding every layer.
A model that mixes sliding-window and global layers (Gemma 3: five of six layers slide)
has a group per attention kind, and those are cut into groups of equal size so that one
block in the pool is the same number of bytes whatever group holds it (vLLM's hybrid KV
cache manager). A block is a page of ``block_size`` slots in ``layers_per_block`` layers:
position ``j`` of every group uses the same K/V tensor, and the pool never gives one block
id to two groups at once, so the groups share all the memory and one budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import ModelConfig


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing a block table. ``window`` > 0: a sliding-window group of that many tokens."""

    layers: tuple[int, ...]
    window: int

    def first_needed_block(self, first_query_pos: int, block_size: int) -> int:
        """Index of the first block a query at ``first_query_pos`` or later can still read."""
        if not self.window:
            return 0
        return max(0, first_query_pos - self.window + 1) // block_size


def kv_cache_groups(config: ModelConfig) -> list[KVCacheGroup]:
    """Group the layers by window, then cut each kind into runs of ``layers_per_block`` layers.

    ``layers_per_block`` is the size of the smallest kind, so each group but possibly the last
    of a kind is full; a shorter group leaves its missing layers' share of a block unused.
    """
    by_window: dict[int, list[int]] = {}
    for layer in range(config.num_layers):
        by_window.setdefault(config.layer_window(layer), []).append(layer)
    size = min(len(layers) for layers in by_window.values())
    groups = []
    for window, layers in sorted(by_window.items()):
        for i in range(0, len(layers), size):
            groups.append(KVCacheGroup(tuple(layers[i : i + size]), window))
    return groups


def layers_per_block(groups: list[KVCacheGroup]) -> int:
    return max(len(g.layers) for g in groups)


def blocks_per_request(groups: list[KVCacheGroup], num_tokens: int, block_size: int, max_chunk: int) -> int:
    """The most blocks a request of ``num_tokens`` holds at once, over all groups.

    A global group holds a block per ``block_size`` tokens; a sliding-window group at most
    the window before a step's first token plus the step's chunk of ``max_chunk`` tokens.
    """
    n = -(-num_tokens // block_size)
    return sum(min(n, (g.window - 1 + max_chunk) // block_size + 2) if g.window else n for g in groups)


def max_request_tokens(groups: list[KVCacheGroup], num_blocks: int, block_size: int, max_chunk: int, limit: int) -> int:
    """The longest request (at most ``limit`` tokens) whose blocks fit in ``num_blocks``."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_per_request(groups, mid, block_size, max_chunk) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
