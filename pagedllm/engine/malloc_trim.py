"""Give the C heap's free pages back to the kernel (glibc ``malloc_trim``), from the engine core.

Why: under steady mixed load the engine core's RSS crept ~0.6-0.8 MB a minute with the count
of live Python objects flat. That is glibc's allocator, not a leak in our code: freed chunks
keep their pages (``free`` returns only the top of a heap), and the step loop's churn (tensors,
masks, msgpack buffers, grammar matchers, freed by other threads than made them) keeps touching
pages of the holes it leaves. After ~12 minutes (SmolLM2-135M, ``pagedllm serve``, AMD EPYC, 2
cores, glibc 2.36) ``malloc_info`` counted 189 MB of free chunks in 444 MB of malloc'd memory:
142 MB in the main arena (the model load's transient buffers, under allocations made later) and
32 MB in 23,500 holes of one thread's arena. One ``malloc_trim(0)`` (it also releases the whole
free pages inside every arena) took RSS from 3,014 to 2,842 MB; RSS right after each trim then
stayed flat (2,842-2,845 MB over ten minutes): the live memory does not grow.

So the core trims once when start-up is done, once each time it goes idle (a poll interval with
nothing to run), and at most every ``BUSY_INTERVAL_S`` seconds while it stays busy. Measured
over the same ten-minute load: a trim took 0.5-12 ms (11 ms the first), the core's RSS stayed
at 2,846-2,883 MB with no trend against 3,051 -> 3,057 MB without trims. Figures and commands:
``docs/benchmarks.md``, "Engine-core RSS under steady load". Without glibc (musl, macOS) there
is no ``malloc_trim`` and this does nothing.
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
