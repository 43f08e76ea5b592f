"""Native CPU kernels (pagedllm/csrc), compiled on first use with the system C++ compiler.

One plain shared library from every ``csrc/*.cpp``, called through ctypes: no torch
headers. The translation units compile in parallel (about 35 s on two cores, once), and the
library is cached under ``$PAGEDLLM_CACHE`` (default ``~/.cache/pagedllm``) by source hash. Where no compiler works (or
``PAGEDLLM_DISABLE_NATIVE=1``), ``native_library()`` is None and callers use PyTorch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger("pagedllm")

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++20"]
# Sources built more than once, with these defines: the decode attention once per cache dtype.
_VARIANTS = {"paged_attention.cpp": [["-DPAGED_ATTENTION_BF16=1"], ["-DPAGED_ATTENTION_BF16=0"]]}
_COMPILE_TIMEOUT_S = 600


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDLLM_CACHE", Path.home() / ".cache" / "pagedllm"))


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built or are disabled."""
    if os.environ.get("PAGEDLLM_DISABLE_NATIVE") == "1":
        return None
    source = b"".join(p.read_bytes() for p in [*_SOURCES, *sorted(_CSRC.glob("*.h"))])
    key = hashlib.sha256(source + f"{_FLAGS}{_VARIANTS}".encode()).hexdigest()[:16]
    path = cache_dir() / f"kernels_{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("building the native kernels (first use on this machine, about a minute)")
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            try:
                _build(Path(tmp), out)
            except (OSError, subprocess.SubprocessError) as e:
                logger.warning("native kernels unavailable (%s); using PyTorch", e)
                return None
            os.replace(out, path)  # atomic: concurrent processes never load a half-written file
    lib = ctypes.CDLL(str(path))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.paged_decode_attention_bf16, lib.paged_decode_attention_f32):
        fn.restype = ctypes.c_int
        # q, k_cache, v_cache, block_tables, max_blocks, seq_lens, out, B, Hq, Hkv, D, BS, scale, window
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, i64]
    fn = lib.paged_prefill_attention
    fn.restype = ctypes.c_int
    # cache_bf16, q, ldq, k_cache, v_cache, block_tables, max_blocks, query_starts, query_lens, seq_lens, out,
    # R, Hq, Hkv, D, BS, scale, window
    fn.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, i64]
    lib.linear_pack_f32.argtypes = [ptr, ptr, i64, i64]
    lib.linear_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64]
    lib.linear_pack_w8a8.argtypes = [ptr, ptr, ptr, ptr, i64, i64]
    lib.linear_w8a8.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64]
    lib.linear_pack_w8a8.restype = lib.linear_w8a8.restype = ctypes.c_int
    lib.add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
    lib.rotary_inplace.argtypes = [ptr, i64, ptr, i64, i64, i64]
    lib.silu_and_mul.argtypes = [ptr, i64, i64, i64]
    lib.write_kv_cache.argtypes = [ctypes.c_int, ptr, ptr, i64, ptr, ptr, ptr, i64, i64]
    lib.argmax_rows.argtypes = [ptr, i64, i64, ptr]
    return lib


def _build(tmp: Path, out: Path) -> None:
    """Compile every translation unit at once (one process per core), then link ``out``.

    Raises:
        OSError, subprocess.SubprocessError: no compiler, a compile error, or a timeout.
    """
    cxx = os.environ.get("CXX", "g++")
    units = [(src, defines) for src in _SOURCES for defines in _VARIANTS.get(src.name, [[]])]
    objects = [tmp / f"{i}_{src.stem}.o" for i, (src, _) in enumerate(units)]

    def compile_unit(i: int) -> None:
        src, defines = units[i]
        cmd = [cxx, *_FLAGS, *defines, "-c", str(src), "-o", str(objects[i])]
        subprocess.run(cmd, check=True, capture_output=True, timeout=_COMPILE_TIMEOUT_S)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(compile_unit, range(len(units))))
    link = [cxx, *_FLAGS, "-shared", "-o", str(out), *map(str, objects)]
    subprocess.run(link, check=True, capture_output=True, timeout=_COMPILE_TIMEOUT_S)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor | None:
    """Decode attention read in place through block tables; None if the kernel cannot run.

    Args:
        q: [B, num_heads, head_dim], float (the kernel computes in float32).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32 or bfloat16.
        block_tables: [B, max_blocks] int64; seq_lens: [B] int64 (keys per request).
        window: > 0: attend only to the last ``window`` keys (positions >= seq_len - window),
            as a sliding-window layer does; 0: all keys.

    Returns:
        [B, num_heads, head_dim] in q's dtype.
    """
    lib = native_library()
    if lib is None or k_cache.dtype not in (torch.bfloat16, torch.float32) or q.shape[-1] not in (64, 128, 256):
        return None
    q32 = q.float().contiguous()
    out = torch.empty_like(q32)
    b, hq, d = q.shape
    kernel = lib.paged_decode_attention_bf16 if k_cache.dtype == torch.bfloat16 else lib.paged_decode_attention_f32
    status = kernel(
        q32.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        seq_lens.data_ptr(),
        out.data_ptr(),
        b,
        hq,
        k_cache.shape[2],
        d,
        k_cache.shape[1],
        scale,
        window,
    )
    return out.to(q.dtype) if status == 0 else None


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta,
    scale: float,
    window: int,
    out: torch.Tensor,
) -> bool:
    """Causal attention of every prefill request's query rows over its paged context, into
    ``out``; False (nothing written) where the kernel cannot run.

    Args:
        q: [T, num_heads, head_dim] float32, heads contiguous (rows at any stride).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32 or
            bfloat16, already holding this step's K/V.
        meta: the step's ``AttentionMetadata`` (its ``prefill_block_tables`` and ``prefill_spans``).
        window: > 0: a query at position p sees keys p - window + 1 .. p; 0: all before it.
        out: [T, num_heads * head_dim] float32; the prefill rows are written.
    """
    lib = native_library()
    t, hq, d = q.shape
    if (
        lib is None or q.dtype != torch.float32 or k_cache.dtype not in (torch.bfloat16, torch.float32)
        or q.stride(2) != 1 or q.stride(1) != d or not out.is_contiguous()
    ):
        return False
    tables, spans = meta.prefill_block_tables, meta.prefill_spans
    status = lib.paged_prefill_attention(
        int(k_cache.dtype == torch.bfloat16), q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        tables.data_ptr(), tables.shape[1], spans[0].data_ptr(), spans[1].data_ptr(), spans[2].data_ptr(),
        out.data_ptr(), tables.shape[0], hq, k_cache.shape[2], d, k_cache.shape[1], scale, window,
    )
    return status == 0
