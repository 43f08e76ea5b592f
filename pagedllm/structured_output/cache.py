"""A least-recently-used map bounded by its number of entries and by the bytes they hold."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    """LRU entries, each with a size in bytes given when it is put; not thread-safe.

    Args:
        max_entries: entries kept at most.
        max_bytes: total size kept at most; the newest entry is kept even if it alone is larger.
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[K, V]]:
        """(key, value) of every entry, least recently used first."""
        return [(key, value) for key, (value, _) in self._entries.items()]

    def get(self, key: K) -> V | None:
        """The value under ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V, size: int) -> None:
        """Keep ``value`` under ``key`` (replacing what was there), then drop the least recently
        used entries while over either bound."""
        if key in self._entries:
            self.num_bytes -= self._entries.pop(key)[1]
        self._entries[key] = (value, size)
        self.num_bytes += size
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes):
            self.num_bytes -= self._entries.popitem(last=False)[1][1]
