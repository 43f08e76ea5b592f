"""The block pool as the front end sees it: rebuilt by replaying the core's block operations."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedllm.core.kv_events import BlockOp, BlockOpKind


class BlockMap:
    """Per block: reference count, cached or not, KV cache group, and who holds it at which table index.

    Args:
        num_blocks: blocks in the pool.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.cached = [False] * num_blocks
        self.group = [-1] * num_blocks  # the group of its last holder; -1: never used
        self.holders: list[dict[str, int]] = [{} for _ in range(num_blocks)]  # request id -> table index
        self.last_holder: list[tuple[str, int] | None] = [None] * num_blocks  # whose prefix a free block keeps

    def apply(self, ops: Iterable[BlockOp]) -> set[int]:
        """Replay ``ops`` in order; return the ids of the blocks they touched.

        Raises:
            IndexError: a block id outside the pool.
        """
        touched: set[int] = set()
        for op in ops:
            kind = op.kind
            if kind == BlockOpKind.RESET:
                touched.update(b for b, c in enumerate(self.cached) if c)
                self.cached = [False] * self.num_blocks
                continue
            touched.update(op.block_ids)
            for i, b in enumerate(op.block_ids):
                index = op.first_index + i
                if kind == BlockOpKind.NEW:
                    self.ref[b] = 1
                    self.cached[b] = False
                    self.holders[b] = {op.request_id: index}
                    self.group[b] = op.group
                elif kind == BlockOpKind.HIT:
                    self.ref[b] += 1
                    self.holders[b][op.request_id] = index
                    self.group[b] = op.group
                elif kind == BlockOpKind.FREE:
                    self.ref[b] -= 1
                    self.holders[b].pop(op.request_id, None)
                    if self.ref[b] == 0:
                        self.last_holder[b] = (op.request_id, index)
                elif kind == BlockOpKind.CACHED:
                    self.cached[b] = True
        return touched

    def cell(self, b: int) -> tuple[str | None, int, list[list[Any]] | None]:
        """Block ``b`` for the page: its first holder (for a cached free block: its last holder;
        None when free and uncached), that holder's table index (-1 with no holder), and, when
        several requests hold it, their ``[request id, table index]`` pairs."""
        holders = self.holders[b]
        if holders:
            rid, i = next(iter(holders.items()))
            return rid, i, [[r, j] for r, j in holders.items()] if len(holders) > 1 else None
        if self.cached[b] and self.last_holder[b] is not None:
            rid, i = self.last_holder[b]
            return rid, i, None
        return None, -1, None

    def rows(self, block_ids: Iterable[int]) -> list[list[Any]]:
        """The given blocks as ``[id, ref, cached (0/1), group, holder, index, shared]``
        (``cell``'s holder, index and shared pairs), in id order."""
        return [[b, self.ref[b], int(self.cached[b]), self.group[b], *self.cell(b)] for b in sorted(block_ids)]

    def snapshot(self) -> dict[str, Any]:
        """The map for the page: per-block arrays and the holders of shared blocks.

        ``owner[b]`` indexes ``owners`` (the first holder; -1 when free), ``index[b]`` is that
        holder's table index (for a cached free block: its last holder's), ``shared`` maps a
        block id held by several requests to their ``[request id, table index]`` pairs.
        """
        owners: list[str] = []
        owner_index: dict[str, int] = {}
        owner, index = [-1] * self.num_blocks, [-1] * self.num_blocks
        shared: dict[str, list[list[Any]]] = {}
        for b in range(self.num_blocks):
            rid, i, pairs = self.cell(b)
            if rid is None:
                continue
            if pairs is not None:
                shared[str(b)] = pairs
            if rid not in owner_index:
                owner_index[rid] = len(owners)
                owners.append(rid)
            owner[b], index[b] = owner_index[rid], i
        return {
            "ref": self.ref, "cached": [int(c) for c in self.cached], "group": self.group,
            "owner": owner, "index": index, "owners": owners, "shared": shared,
        }
