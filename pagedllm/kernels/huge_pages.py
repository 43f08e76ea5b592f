"""Memory for packed weights and the K/V caches in 2 MiB pages.

A decode step streams every packed weight from memory once. In 4 KiB pages the CPU's
hardware prefetchers stop at each page's end and each page costs a TLB walk; in 2 MiB pages a
layer's panels are one run. So the packing functions (``kernels.linear``, ``kernels.kquant``)
take their output tensors from anonymous mappings that Linux is asked to back with transparent
huge pages (``madvise(MADV_HUGEPAGE)``, granted where THP is in "madvise" or "always" mode;
"never", or a kernel without THP, leaves plain pages). Tensors share 64 MiB mappings in
allocation order (a model's layers one after another), each 64-byte aligned; a mapping is
unmapped once no tensor in it is left but the one being filled. The K/V caches' mapping
(``worker.kv_cache``) takes the same advice (``advise``): a decode step reads each request's
blocks wherever the pool put them, a few KiB each, and in 4 KiB pages most blocks cost a TLB
walk. Where Python's ``mmap`` has no ``MADV_HUGEPAGE`` (not Linux), and with
``PAGEDLLM_DISABLE_HUGE_PAGES=1``, both are plain pages.
Measured: docs/benchmarks.md, "Intel Xeon with AMX, session 44" (weights) and "AMD EPYC Zen 4,
session 50" (K/V).
"""

from __future__ import annotations

import ctypes
import mmap
import threading

import torch

from pagedllm.kernels import build

_HUGE = 2 << 20  # bytes of a huge page
_SHARED = 64 << 20  # bytes of a mapping that tensors share
_ALIGN = 64  # bytes: a cache line

_lock = threading.Lock()
_current: tuple[mmap.mmap, int, int] | None = None  # the mapping being filled, next free offset, end


def enabled() -> bool:
    """Whether packed weights go to mappings advised as huge pages here.

    Raises:
        ValueError: ``PAGEDLLM_DISABLE_HUGE_PAGES`` is neither 1, 0 nor empty (``build.env_switch``).
    """
    return hasattr(mmap, "MADV_HUGEPAGE") and not build.env_switch("PAGEDLLM_DISABLE_HUGE_PAGES")


def advise(buf: mmap.mmap) -> None:
    """Ask Linux to back the anonymous mapping ``buf`` (not yet touched) with 2 MiB pages where
    ``enabled()``; a kernel without THP leaves plain pages."""
    if not enabled():
        return
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without THP (EINVAL): plain pages
        pass


def _mapping(nbytes: int) -> tuple[mmap.mmap, int, int]:
    """A fresh anonymous mapping with room for nbytes from its first 2 MiB boundary: (mapping,
    that boundary's offset, end offset)."""
    size = -(-nbytes // _HUGE) * _HUGE + _HUGE
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise(buf)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return buf, -address % _HUGE, size


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized 1-D CPU tensor of ``numel`` elements of ``dtype`` (numel >= 0), 64-byte
    aligned, in huge-page mappings where ``enabled()``, else from ``torch.empty``. The tensor
    keeps its mapping alive."""
    nbytes = numel * dtype.itemsize
    if nbytes == 0 or not enabled():
        return torch.empty(numel, dtype=dtype)
    global _current
    with _lock:
        if nbytes > _SHARED // 4:  # a large weight (an lm_head) gets a mapping of its own
            buf, offset, _ = _mapping(nbytes)
        else:
            if _current is None or _current[1] + nbytes > _current[2]:
                _current = _mapping(_SHARED - _HUGE)
            buf, offset, end = _current
            _current = (buf, -(-(offset + nbytes) // _ALIGN) * _ALIGN, end)
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset)
