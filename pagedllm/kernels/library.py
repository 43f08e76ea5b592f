"""Which ISA variant's kernel library this process runs, chosen once at run time.

The best variant the CPU executes (``available_isas()``), or ``PAGEDLLM_CPU_ISA`` (any case) to
force one; if it fails to build or load, the next one down (avx512_bf16 -> avx512_vnni -> avx512
-> avx2 -> scalar, neon_dotprod -> neon -> scalar), so one file that does not compile never
costs every kernel. A library is used only once it matches ``pagedllm_abi.h`` (``abi.bind``)
and every CPU feature it reports needing (``pagedllm_requires()``) is this CPU's.
``PAGEDLLM_DISABLE_NATIVE=1``: no library, PyTorch everywhere; ``PAGEDLLM_DISABLE_AMX=1``: on a
CPU with AMX-BF16, the int8 formats' prompt rows keep the int8 tiles instead of bfloat16 tile
products (``amx.h``). Only the wrappers (``kernels.attention``, ``elementwise``, ``linear``,
``decoder``) call into the library.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from pagedllm.kernels import abi, build
from pagedllm.kernels.isa import ALL_ISAS, cpu_flags, runnable_isas

logger = logging.getLogger("pagedllm")

_RETRY = "delete the marker or set PAGEDLLM_REBUILD_NATIVE=1 to retry"
_LOST = "decode/prefill attention, GEMM and fused elementwise ops run in PyTorch: several times slower"
_forced_isa: str | None = None  # set by use_isa()
_T = TypeVar("_T")


def _once_per_argument(fn: Callable[..., _T]) -> Callable[..., _T]:
    """``functools.cache`` whose first call per argument runs once even when several threads
    make it together (a loader's thread pool packing layers): one build, one log line. Hits
    take no lock."""
    results: dict[tuple, _T] = {}
    lock = threading.Lock()

    @functools.wraps(fn)
    def cached(*args: object) -> _T:
        try:
            return results[args]
        except KeyError:
            with lock:
                if args not in results:
                    results[args] = fn(*args)
                return results[args]

    cached.cache_clear = results.clear  # type: ignore[attr-defined]
    return cached


def available_isas() -> list[str]:
    """The ISAs this CPU executes, best first: e.g. ["avx512", "avx2", "scalar"]."""
    return runnable_isas(cpu_flags(), platform.machine())


def available() -> bool:
    """Whether the native kernels run in this process (a library loaded for its ISA)."""
    return native_library() is not None


def native_library(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernel library built for ``isa`` (None: the one this process runs), or None where
    it does not build or ``PAGEDLLM_DISABLE_NATIVE=1``. Built on first use, then cached.

    Raises:
        ValueError: ``isa`` (or ``PAGEDLLM_CPU_ISA``) is unknown or this CPU cannot run it.
    """
    if isa is None:  # every native call asks: cached lookups only
        isa = _forced_isa or _choose()
        return None if isa is None else _load(isa)
    if _disabled():
        return None
    check_runnable(isa, "isa")
    return _load(isa)


def active_isa() -> str | None:
    """The ISA of the library this process runs (``use_isa``'s inside that block), None
    where no library builds or ``PAGEDLLM_DISABLE_NATIVE=1``.

    Raises:
        ValueError: ``PAGEDLLM_CPU_ISA`` is unknown or this CPU cannot run it.
    """
    if _forced_isa:
        return _forced_isa if _load(_forced_isa) is not None else None
    return _choose()


def build_error(isa: str) -> str | None:
    """The compiler's first error line where ``isa``'s build failed, else None (built or not tried)."""
    result = _load_or_failure(isa)
    return result.errors[0] if isinstance(result, build.BuildFailed) else None


@contextmanager
def use_isa(isa: str) -> Iterator[None]:
    """Run every native call inside the block on ``isa``'s library (tests compare ISAs);
    none under ``PAGEDLLM_DISABLE_NATIVE=1``.

    Raises:
        ValueError: this CPU cannot run ``isa``.
    """
    global _forced_isa
    check_runnable(isa, "isa")
    previous, _forced_isa = _forced_isa, None if _disabled() else isa
    try:
        yield
    finally:
        _forced_isa = previous


def _disabled() -> bool:
    return build.env_switch("PAGEDLLM_DISABLE_NATIVE")


def check_runnable(isa: str, source: str, given: str | None = None) -> None:
    """Raises ValueError unless this CPU runs ``isa``, naming ``source`` set to ``given`` (the
    value as the user wrote it; default ``isa``) and what this CPU runs."""
    runnable = available_isas()
    if isa not in runnable:
        what = "an unknown ISA" if isa not in ALL_ISAS else "an ISA this CPU cannot run"
        raise ValueError(f"{source}={given or isa!r} is {what}; this CPU runs: {', '.join(runnable)}")


def forced_isa() -> str | None:
    """The ISA ``PAGEDLLM_CPU_ISA`` forces, None where it is unset or empty. Its case does not
    matter (``AVX2`` is ``avx2``): the variants' names are lower case.

    Raises:
        ValueError: it names an unknown ISA or one this CPU cannot run (as it was written).
    """
    value = os.environ.get("PAGEDLLM_CPU_ISA")
    if not value:
        return None
    check_runnable(value.lower(), "PAGEDLLM_CPU_ISA", value)
    return value.lower()


@_once_per_argument
def _choose() -> str | None:
    """The first ISA, from the best (or ``PAGEDLLM_CPU_ISA``) down, whose library loads."""
    if _disabled():
        logger.info("no native kernels: PAGEDLLM_DISABLE_NATIVE=1; %s", _LOST)
        return None
    candidates = available_isas()
    forced = forced_isa()
    if forced:
        candidates = candidates[candidates.index(forced) :]
    for isa in candidates:
        if _load(isa) is not None:
            path = build.library_path(isa)
            how = "shipped in the wheel" if path.parent == build.PREBUILT else "built on this machine"
            logger.info("native kernels: %s, %s (%s)", isa, how, path)
            return isa
    logger.warning("no native kernels: %s", _LOST)
    return None


def _load(isa: str) -> ctypes.CDLL | None:
    result = _load_or_failure(isa)
    return None if isinstance(result, build.BuildFailed) else result


@_once_per_argument
def _load_or_failure(isa: str) -> ctypes.CDLL | build.BuildFailed:
    """Load (building if needed) once per process; a failure is logged once."""
    try:
        lib = abi.bind(build.load(isa))
        missing = set(lib.pagedllm_requires().decode().split()) - cpu_flags()
        if missing:
            raise abi.ABIMismatch(f"{build.library_path(isa)} needs {', '.join(sorted(missing))}, which this CPU lacks")
        lib.gemm_amx(0 if build.env_switch("PAGEDLLM_DISABLE_AMX") else 1)
        return lib
    except abi.ABIMismatch as e:  # a stale or foreign file: never call into it
        logger.warning("%s native kernels skipped: %s", isa, e)
        return build.BuildFailed([str(e)], None)
    except build.BuildFailed as e:
        if e.cached:
            logger.warning("%s native kernels skipped: their build failed before (%s; %s)", isa, e.marker, _RETRY)
        else:
            where = f"recorded in {e.marker}; {_RETRY}" if e.marker else "rerun to retry"
            logger.warning("%s native kernels failed to build:\n  %s\n(%s)", isa, "\n  ".join(e.errors), where)
        return e
