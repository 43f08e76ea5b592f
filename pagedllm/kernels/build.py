"""Build the native kernels (``pagedllm/csrc``) for one ISA variant, cache them, remember failures.

One plain shared library per variant from every ``csrc/*.cpp``, no torch headers; the
translation units compile in parallel. ``cached_build`` is the one recipe: the wheel's build
(``setup.py``) ships its output as ``pagedllm/kernels/prebuilt/kernels-<isa>.so``, which
``load`` takes first; otherwise (an editable install, a CPU no shipped variant serves)
``load`` compiles just in time into ``$PAGEDLLM_CACHE`` (default ``~/.cache/pagedllm``) as
``kernels-<isa>-<key>.so``, the key hashing the variant, its flags, the compiler (path and
version) and every csrc source and header, so a cache shared between machines never hands
one a library built for another.

One process builds a given library: the others wait on a file lock beside it
(``kernels-<isa>-<key>.lock``) and load what it built. The objects go to a folder
``build-<pid>-*`` in the cache, removed when the build ends; one left by a process that died
is removed by the next build.

A failed build leaves ``kernels-<isa>-<key>.failed`` beside it, holding the compiler's
error lines: later processes skip that ISA at once instead of compiling again. Delete the
marker, or set ``PAGEDLLM_REBUILD_NATIVE=1``, to try again.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from pagedllm.kernels.isa import isa_flags

logger = logging.getLogger("pagedllm")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
PREBUILT = Path(__file__).resolve().parent / "prebuilt"
# Sources built more than once, with these defines: the decode attention once per cache kind
# (pagedllm_abi.h's PAGEDLLM_CACHE_*: float32, bfloat16, int8, fp8).
_VARIANTS = {"paged_attention.cpp": [[f"-DPAGED_ATTENTION_CACHE={kind}"] for kind in range(4)]}
_COMPILE_TIMEOUT_S = 600
_MAX_ERROR_LINES = 10
# About the compiler's CPU time for one variant, all translation units together (see
# docs/benchmarks.md, "Kernel builds, the wheel, the binding"); the build notice divides it by
# the cores the build can use.
_BUILD_CPU_SECONDS = 120


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


def env_switch(name: str) -> bool:
    """An on/off environment variable (``PAGEDLLM_DISABLE_NATIVE``, ``PAGEDLLM_REBUILD_NATIVE``):
    on at 1, off unset, empty or 0.

    Raises:
        ValueError: any other value (``yes``, ``true``), which would otherwise read as off unnoticed.
    """
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r} must be 1 (on) or 0 (off)")
    return value == "1"


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


def prebuilt_path(isa: str) -> Path:
    """Where an installed wheel holds ``isa``'s library (present only there)."""
    return PREBUILT / f"kernels-{isa}.so"


def library_path(isa: str) -> Path:
    """The library ``load`` takes for ``isa``: the wheel's, else where it is (or would be)
    cached for these sources, flags and compiler."""
    return prebuilt_path(isa) if prebuilt_path(isa).exists() else _cache_path(isa)


def _cache_path(isa: str) -> Path:
    digest = hashlib.sha256(repr((isa, isa_flags(isa), _VARIANTS, compiler())).encode())
    for source in sorted([*CSRC.glob("*.cpp"), *CSRC.rglob("*.h")]):
        digest.update(source.name.encode() + source.read_bytes())
    return cache_dir() / f"kernels-{isa}-{digest.hexdigest()[:16]}.so"


def load(isa: str) -> ctypes.CDLL:
    """``isa``'s library: the wheel's, else the cached one, built first if missing (logged
    before it starts: it takes minutes). Concurrent processes build it once.

    Raises:
        BuildFailed: the compiler failed now (the ``.failed`` marker is written) or did before
            (its marker is there and ``PAGEDLLM_REBUILD_NATIVE`` is not 1), it timed out, or
            the library does not load.
        ValueError: for an unknown ISA name.
    """
    if prebuilt_path(isa).exists():
        return _open(prebuilt_path(isa), None)
    path = cached_build(isa)
    return _open(path, path.with_suffix(".failed"))


def cached_build(isa: str) -> Path:
    """The path of ``isa``'s library in the cache, compiled first where it is not there yet
    (by this process, or by another one this one waits for). Nothing is loaded.

    Raises:
        BuildFailed, ValueError: as ``load``; BuildFailed also where the cache cannot be
            written (``PAGEDLLM_CACHE`` or the home directory not writable), naming it.
    """
    path = _cache_path(isa)
    marker = path.with_suffix(".failed")
    if not env_switch("PAGEDLLM_REBUILD_NATIVE") and marker.exists():
        raise BuildFailed(marker.read_text().splitlines(), marker, cached=True)
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _exclusive(path.with_suffix(".lock"), isa):
                if not env_switch("PAGEDLLM_REBUILD_NATIVE") and marker.exists():  # the lock holder's failure
                    raise BuildFailed(marker.read_text().splitlines(), marker, cached=True)
                if not path.exists():  # else another process built it while this one waited
                    _build_into_cache(isa, path, marker)
        except OSError as e:
            raise BuildFailed(
                [f"cannot write the kernel cache {path.parent} ({e}); set PAGEDLLM_CACHE to a writable directory"],
                None,
            ) from None
    marker.unlink(missing_ok=True)  # a retry (PAGEDLLM_REBUILD_NATIVE=1) that succeeded
    return path


def _compile_library(isa: str, out: Path, work: Path) -> None:
    """Compile every translation unit with ``isa``'s flags (one process per core) in the
    folder ``work``, then link ``out``.

    Raises:
        BuildFailed: the compiler is missing or failed (its error lines; no marker);
        subprocess.TimeoutExpired: it ran past the limit.
        ValueError: for an unknown ISA name.
    """
    cxx, _ = compiler()
    flags = isa_flags(isa)
    units = _units()
    objects = [work / f"{i}_{src.stem}.o" for i, (src, _) in enumerate(units)]
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


def expected_build_seconds() -> float:
    """About how long one variant's build takes on this machine when it has the cores to itself."""
    return _BUILD_CPU_SECONDS / min(os.cpu_count() or 1, len(_units()))


def _units() -> list[tuple[Path, list[str]]]:
    """Every translation unit to compile: (source, its extra defines)."""
    return [(src, defines) for src in sorted(CSRC.glob("*.cpp")) for defines in _VARIANTS.get(src.name, [[]])]


def _build_into_cache(isa: str, path: Path, marker: Path) -> None:
    """Build ``path`` in a fresh ``build-<pid>-*`` folder of the cache, removed in any case;
    a failure writes ``marker``. The caller holds the library's lock."""
    _remove_orphans(path.parent)
    logger.info(
        "building the %s native kernels: first use of this version on this machine, about %.0f s "
        "(longer on a busy machine); they are cached in %s", isa, expected_build_seconds(), path.parent,
    )
    work = Path(tempfile.mkdtemp(prefix=f"build-{os.getpid()}-", dir=path.parent))
    started = time.monotonic()
    try:
        out = work / path.name
        _compile_library(isa, out, work)
        os.replace(out, path)  # atomic: a process that does not take the lock never loads a half-written file
    except subprocess.TimeoutExpired as e:  # a busy machine, not a broken build: no marker
        raise BuildFailed([f"the compiler ran past {e.timeout:.0f} s"], None) from None
    except BuildFailed as e:
        _write_atomically(marker, "\n".join(e.errors) + "\n")
        raise BuildFailed(e.errors, marker) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    logger.info("built the %s native kernels in %.0f s", isa, time.monotonic() - started)


@contextmanager
def _exclusive(lock: Path, isa: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock`` (created if missing) for the block; waiting,
    if another process holds it, is logged. The kernel drops it when its holder dies."""
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building the %s native kernels (%s)", isa, lock)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_orphans(cache: Path) -> None:
    """Remove the build folders of processes that are gone (killed mid-build)."""
    for folder in cache.glob("build-*-*"):
        pid = folder.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _open(path: Path, marker: Path | None) -> ctypes.CDLL:
    """Load a built library; one that does not load (a missing runtime library) is recorded
    in ``marker`` where there is one.

    Raises:
        BuildFailed: it does not load.
    """
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        if marker is not None:
            _write_atomically(marker, f"{e}\n")
        raise BuildFailed([str(e)], marker) from None


def _run(command: list[str]) -> list[str]:
    """Run one compiler command; [] on success, else its error lines (or why it did not run)."""
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        return [f"cannot run the C++ compiler {command[0]!r} ({e.strerror}); install g++ or set CXX"]
    with proc:
        try:
            _, stderr = proc.communicate(timeout=_COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # SIGTERM: the driver ends its cc1plus and assembler (a SIGKILL would leave them running).
            proc.terminate()
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    if proc.returncode == 0:
        return []
    lines = stderr.splitlines()
    errors = list(dict.fromkeys(line for line in lines if "error:" in line)) or lines[-_MAX_ERROR_LINES:]
    return errors[:_MAX_ERROR_LINES] or [f"{command[0]} exited with status {proc.returncode} and no message"]


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
