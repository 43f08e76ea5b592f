"""Give the C heap's free pages back to the kernel (glibc ``malloc_trim``), from the engine core
and, after a huge text is tokenized, from the front end.

The engine core's RSS crept under steady mixed load while its live objects stayed flat:
glibc's allocator keeps freed chunks' pages resident (``free`` returns only the top of a
heap), and the step loop's churn (tensors, masks, msgpack buffers, grammar matchers, freed by
other threads than made them) keeps the holes it leaves. ``malloc_trim(0)`` releases the whole
free pages inside every arena. So the core trims once when start-up is done (the model load's
transient buffers), once each time it goes idle (a poll interval with nothing to run), and at
most every ``BUSY_INTERVAL_S`` seconds while it stays busy. Without glibc (musl, macOS) there
is no ``malloc_trim`` and this does nothing. Measurements: docs/benchmarks.md, "Engine-core
RSS under steady load".

The front end tokenizes on a pool of threads, each allocating from its own arena: encoding a
14 MB prompt leaves its arena holding about 1.8 GiB after the prompt is refused as too long,
so a few such requests kept the API server at 10 GB. A text of ``TRIM_AFTER_CHARS`` or more is
followed by a trim (~10 ms, against seconds of encoding).
"""

from __future__ import annotations

import ctypes
import time

# While steps keep running, trim at most this often: at ~10 ms a call, under 0.02% of the time.
BUSY_INTERVAL_S = 60.0


def _load_malloc_trim():
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_malloc_trim = _load_malloc_trim()


def malloc_trim() -> bool:
    """Release the free pages of every malloc arena; whether the C library has ``malloc_trim``."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


TRIM_AFTER_CHARS = 1 << 20


def trim_after_text(num_chars: int) -> None:
    """Trim where a text of ``num_chars`` characters, just tokenized, is ``TRIM_AFTER_CHARS`` or longer."""
    if num_chars >= TRIM_AFTER_CHARS:
        malloc_trim()


class Trimmer:
    """When the engine-core loop trims: after start-up, on going idle, and every
    ``interval_s`` seconds of uninterrupted work.

    Args:
        interval_s: the least time between two trims while busy.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, interval_s: float = BUSY_INTERVAL_S, clock=time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last = clock()
        self._busy_since_trim = False
        self.count = 0  # trims done

    def _trim(self) -> None:
        malloc_trim()
        self.count += 1
        self._last = self._clock()
        self._busy_since_trim = False

    def started(self) -> None:
        """Start-up is done: the model load's transient buffers are free."""
        self._trim()

    def stepped(self) -> None:
        """A step ran: trim if the last trim is ``interval_s`` old."""
        self._busy_since_trim = True
        if self._clock() - self._last >= self.interval_s:
            self._trim()

    def idle(self) -> None:
        """A poll interval passed with nothing to run: trim once per idle period."""
        if self._busy_since_trim:
            self._trim()
