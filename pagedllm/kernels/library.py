"""Which ISA's kernel library this process runs, chosen once at run time.

The best ISA the CPU executes (``available_isas()``), or ``PAGEDLLM_CPU_ISA`` to force
one; if its build fails, the next one down (avx512 -> avx2 -> scalar, neon -> scalar), so
one file that does not compile never costs every kernel. ``PAGEDLLM_DISABLE_NATIVE=1``:
no library, PyTorch everywhere. Only ``kernels.ops`` calls into the library.
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

from pagedllm.kernels import build
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
    _check_runnable(isa, "isa")
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
    _check_runnable(isa, "isa")
    previous, _forced_isa = _forced_isa, None if _disabled() else isa
    try:
        yield
    finally:
        _forced_isa = previous


def _disabled() -> bool:
    return os.environ.get("PAGEDLLM_DISABLE_NATIVE") == "1"


def _check_runnable(isa: str, source: str) -> None:
    runnable = available_isas()
    if isa not in runnable:
        what = "an unknown ISA" if isa not in ALL_ISAS else "an ISA this CPU cannot run"
        raise ValueError(f"{source}={isa!r} is {what}; this CPU runs: {', '.join(runnable)}")


@_once_per_argument
def _choose() -> str | None:
    """The first ISA, from the best (or ``PAGEDLLM_CPU_ISA``) down, whose library loads."""
    if _disabled():
        return None
    candidates = available_isas()
    forced = os.environ.get("PAGEDLLM_CPU_ISA")
    if forced:
        _check_runnable(forced, "PAGEDLLM_CPU_ISA")
        candidates = candidates[candidates.index(forced) :]
    for isa in candidates:
        if _load(isa) is not None:
            logger.info("native kernels: %s (%s)", isa, build.library_path(isa))
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
        return _declare(build.load(isa))
    except build.BuildFailed as e:
        if e.cached:
            logger.warning("%s native kernels skipped: their build failed before (%s; %s)", isa, e.marker, _RETRY)
        else:
            where = f"recorded in {e.marker}; {_RETRY}" if e.marker else "rerun to retry"
            logger.warning("%s native kernels failed to build:\n  %s\n(%s)", isa, "\n  ".join(e.errors), where)
        return e


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give every exported function its C signature (the ABI of pagedllm/csrc)."""
    ptr, i64, f32, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    for fn in (lib.paged_decode_attention_bf16, lib.paged_decode_attention_f32):
        fn.restype = c_int
        # q, k_cache, v_cache, block_tables, max_blocks, seq_lens, out, B, Hq, Hkv, D, BS, scale, window
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, f32, i64]
    lib.paged_prefill_attention.restype = c_int
    # cache_bf16, q, ldq, k_cache, v_cache, block_tables, max_blocks, query_starts, query_lens, seq_lens, out,
    # R, Hq, Hkv, D, BS, scale, window
    lib.paged_prefill_attention.argtypes = [
        c_int, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, i64
    ]
    lib.linear_w8a8_available.restype = c_int
    lib.linear_pack_f32.argtypes = [ptr, ptr, i64, i64]
    lib.linear_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64]
    lib.linear_pack_w8a8.argtypes = [ptr, ptr, ptr, ptr, i64, i64]
    lib.linear_w8a8.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64]
    lib.linear_pack_w8a8.restype = lib.linear_w8a8.restype = c_int
    lib.linear_pack_q4a8.argtypes = [ptr, ptr, ptr, ptr, i64, i64]
    lib.linear_q4a8.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64]
    lib.linear_pack_q4a8.restype = lib.linear_q4a8.restype = c_int
    lib.add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32]
    lib.rotary_inplace.argtypes = [ptr, i64, ptr, i64, i64, i64]
    lib.silu_and_mul.argtypes = lib.gelu_tanh_and_mul.argtypes = [ptr, i64, i64, i64]
    lib.write_kv_cache.argtypes = [c_int, ptr, ptr, i64, ptr, ptr, ptr, i64, i64]
    lib.argmax_rows.argtypes = [ptr, i64, i64, ptr]
    lib.decode_layers.restype = c_int
    # decoder, stream, cos_sin[2], groups, seq_lens, B, out
    lib.decode_layers.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, ptr]
    return lib
