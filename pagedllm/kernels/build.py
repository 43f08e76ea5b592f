"""Build the native kernels (``pagedllm/csrc``) for one ISA, cache them, remember failures.

One plain shared library per ISA from every ``csrc/*.cpp``, no torch headers; the
translation units compile in parallel (about 35 s on two cores, once). Libraries live in
``$PAGEDLLM_CACHE`` (default ``~/.cache/pagedllm``) as ``kernels-<isa>-<key>.so``, the key
hashing the ISA, its flags, the compiler (path and version) and every csrc source and
header, so a cache shared between machines never hands one a library built for another.

A failed build leaves ``kernels-<isa>-<key>.failed`` beside it, holding the compiler's
error lines: later processes skip that ISA at once instead of compiling again. Delete the
marker, or set ``PAGEDLLM_REBUILD_NATIVE=1``, to try again.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedllm.kernels.isa import cpu_flags, isa_flags

logger = logging.getLogger("pagedllm")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# Sources built more than once, with these defines: the decode attention once per cache dtype.
_VARIANTS = {"paged_attention.cpp": [["-DPAGED_ATTENTION_BF16=1"], ["-DPAGED_ATTENTION_BF16=0"]]}
_COMPILE_TIMEOUT_S = 600
_MAX_ERROR_LINES = 10


class BuildFailed(Exception):
    """An ISA's library could not be built or loaded.

    Attributes:
        errors: the compiler's ``error:`` lines (at most 10), or what else went wrong.
        marker: the ``.failed`` file recording it (None where nothing was recorded: a timeout).
        cached: True where the failure was read from an earlier process's marker.
    """

    def __init__(self, errors: list[str], marker: Path | None, cached: bool = False) -> None:
        super().__init__(errors[0] if errors else "unknown build failure")
        self.errors, self.marker, self.cached = errors, marker, cached


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDLLM_CACHE", Path.home() / ".cache" / "pagedllm"))


def compiler() -> tuple[str, str]:
    """(resolved path, first line of ``--version``) of ``$CXX`` (default g++); the path is the
    bare name where it is not found, the version empty where it says nothing."""
    return _identify(os.environ.get("CXX", "g++"))


@functools.cache  # one --version run per compiler and process
def _identify(cxx: str) -> tuple[str, str]:
    path = shutil.which(cxx) or cxx
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return path, ""
    return path, next(iter(done.stdout.splitlines()), "")


def library_path(isa: str) -> Path:
    """Where ``isa``'s library is (or would be) cached for these sources, flags and compiler."""
    digest = hashlib.sha256(repr((isa, isa_flags(isa, cpu_flags()), _VARIANTS, compiler())).encode())
    for source in sorted([*CSRC.glob("*.cpp"), *CSRC.rglob("*.h")]):
        digest.update(source.name.encode() + source.read_bytes())
    return cache_dir() / f"kernels-{isa}-{digest.hexdigest()[:16]}.so"


def load(isa: str) -> ctypes.CDLL:
    """``isa``'s library, built first if not cached (logged: it takes a while).

    Raises:
        BuildFailed: the compiler failed now (the ``.failed`` marker is written) or did before
            (its marker is there and ``PAGEDLLM_REBUILD_NATIVE`` is not 1), or it timed out.
        ValueError: for an unknown ISA name.
    """
    path = library_path(isa)
    marker = path.with_suffix(".failed")
    if marker.exists() and os.environ.get("PAGEDLLM_REBUILD_NATIVE") != "1":
        raise BuildFailed(marker.read_text().splitlines(), marker, cached=True)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("building the %s native kernels (first use on this machine, about a minute)", isa)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            try:
                _build(isa, Path(tmp), out)
            except subprocess.TimeoutExpired as e:  # a busy machine, not a broken build: no marker
                raise BuildFailed([f"the compiler ran past {e.timeout:.0f} s"], None) from None
            except BuildFailed as e:
                _write_atomically(marker, "\n".join(e.errors) + "\n")
                raise BuildFailed(e.errors, marker) from None
            os.replace(out, path)  # atomic: concurrent processes never load a half-written file
    marker.unlink(missing_ok=True)  # a retry (PAGEDLLM_REBUILD_NATIVE=1) that succeeded
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:  # built but not loadable here (a missing runtime library)
        _write_atomically(marker, f"{e}\n")
        raise BuildFailed([str(e)], marker) from None


def _build(isa: str, tmp: Path, out: Path) -> None:
    """Compile every translation unit at once (one process per core), then link ``out``.

    Raises:
        BuildFailed: the compiler is missing or failed (its error lines; no marker yet);
        subprocess.TimeoutExpired: it ran past the limit.
    """
    cxx, _ = compiler()
    flags = isa_flags(isa, cpu_flags())
    units = [(src, defines) for src in sorted(CSRC.glob("*.cpp")) for defines in _VARIANTS.get(src.name, [[]])]
    objects = [tmp / f"{i}_{src.stem}.o" for i, (src, _) in enumerate(units)]
    commands = [[cxx, *flags, *defines, "-c", str(src), "-o", str(obj)] for (src, defines), obj in zip(units, objects)]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        failures = [e for e in pool.map(_run, commands) if e]
    if failures:  # every unit's errors, not only the first one's: one run shows them all
        raise BuildFailed(list(dict.fromkeys(line for errors in failures for line in errors))[:_MAX_ERROR_LINES], None)
    # Linked without -ffast-math: GCC 12 would add crtfastmath.o, whose constructor sets
    # flush-to-zero for the whole process (torch's float32 subnormals would become 0).
    link_flags = [f for f in flags if f != "-ffast-math"]
    errors = _run([cxx, *link_flags, "-shared", "-o", str(out), *map(str, objects)])
    if errors:
        raise BuildFailed(errors, None)


def _run(command: list[str]) -> list[str]:
    """Run one compiler command; [] on success, else its error lines (or why it did not run)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
    except OSError as e:
        return [f"cannot run the C++ compiler {command[0]!r} ({e.strerror}); install g++ or set CXX"]
    if done.returncode == 0:
        return []
    lines = done.stderr.splitlines()
    errors = list(dict.fromkeys(line for line in lines if "error:" in line)) or lines[-_MAX_ERROR_LINES:]
    return errors[:_MAX_ERROR_LINES] or [f"{command[0]} exited with status {done.returncode} and no message"]


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
