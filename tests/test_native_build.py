"""Building the kernels per ISA: the cache key, failure markers, the fallback from one ISA to
the next, PAGEDLLM_CPU_ISA and the other switches, one build for many threads or processes, the
build folders, prebuilt and unusable libraries, and the build notice. The ISAs themselves (what
each CPU runs, the flags, dtype auto's table): ``test_native_build_isas.py``.

The tests use a fake compiler (a shell script in tmp_path) that fails where told and otherwise
links a stub library exporting the kernels' names: no real build.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedllm.kernels import abi, build, library
from pagedllm.kernels.isa import ALL_ISAS
from tests.native_isa import ZEN3


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty kernel cache in tmp_path and no library loaded in this process (before and after)."""
    for name in ("PAGEDLLM_CPU_ISA", "PAGEDLLM_DISABLE_NATIVE", "PAGEDLLM_REBUILD_NATIVE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    _forget_libraries()
    yield tmp_path
    _forget_libraries()


def _forget_libraries() -> None:
    library._choose.cache_clear()
    library._load_or_failure.cache_clear()


def fake_compiler(
    tmp_path: Path, fail_on: str, version: str = "fake c++ 1.0", requires: str = "", delay: float = 0
) -> Path:
    """A compiler that logs each compile or link to ``calls``, fails on arguments containing
    ``fail_on`` with one gcc-style error line, and otherwise links a stub of the kernels'
    exports with the real gcc, whose ``pagedllm_requires()`` says ``requires``; each compile
    takes ``delay`` seconds."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc to link the stub library")
    stub = tmp_path / "stub.c"  # every export but the two pagedllm_abi.h needs right
    names = [name for name in abi.FUNCTIONS if not name.startswith("pagedllm_")]
    stub.write_text("".join(f"int {name}(void) {{ return 0; }}\n" for name in names))
    described = tmp_path / "described.c"
    described.write_text(f"""#include "{abi.HEADER}"
static const int dims[] = PAGEDLLM_HEAD_DIMS;
const PagedllmLimits* pagedllm_limits(void) {{
  static PagedllmLimits l = {{PAGEDLLM_MAX_GROUP, sizeof dims / sizeof dims[0], {{0}}, PAGEDLLM_MAX_PREFILL_BLOCK,
                             PAGEDLLM_PANEL, PAGEDLLM_QUANT_GROUP, PAGEDLLM_Q4A8_GROUP_BYTES}};
  for (unsigned i = 0; i < sizeof dims / sizeof dims[0]; ++i) l.head_dims[i] = dims[i];
  return &l;
}}
const char* pagedllm_requires(void) {{ return "{requires}"; }}
""")
    script = tmp_path / f"cxx{len(list(tmp_path.glob('cxx*')))}"
    script.write_text(f"""#!/bin/sh
if [ "$1" = --version ]; then echo "{version}"; exit 0; fi
echo "$*" >> {tmp_path}/calls
sleep {delay}
case "$*" in *"{fail_on}"*) echo "kernel.cpp:3:7: error: '__m512' was not declared in this scope" >&2; exit 1;; esac
case "$*" in *-shared*) while [ "$1" != -o ]; do shift; done; exec gcc -shared -fPIC -o "$2" {stub} {described};; esac
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def _calls(tmp_path: Path) -> int:
    calls = tmp_path / "calls"
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_cache_key_differs_by_isa_and_compiler(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = {isa: build.library_path(isa) for isa in ALL_ISAS}
    assert len(set(paths.values())) == len(ALL_ISAS)
    assert all(p.name.startswith(f"kernels-{isa}-") and p.suffix == ".so" for isa, p in paths.items())
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "never", "fake c++ 1.0")))
    one = build.library_path("avx2")
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "never", "fake c++ 2.0")))
    assert len({one, build.library_path("avx2"), paths["avx2"]}) == 3  # another compiler, another version


def test_a_failed_build_leaves_a_marker_falls_back_and_is_not_retried(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(library, "available_isas", lambda: ["avx512", "avx2", "scalar"])
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "-mavx512f")))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert library.native_library() is not None
    assert library.active_isa() == "avx2"
    assert "kernel.cpp:3:7: error: '__m512' was not declared in this scope" in caplog.text
    assert "native kernels: avx2" in caplog.text
    marker = build.library_path("avx512").with_suffix(".failed")
    assert "error: '__m512' was not declared" in marker.read_text()
    assert library.build_error("avx512") == "kernel.cpp:3:7: error: '__m512' was not declared in this scope"
    assert library.build_error("avx2") is None
    # The next process skips avx512 at once, saying where the marker is.
    calls = _calls(fresh)
    _forget_libraries()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert library.active_isa() == "avx2"
    assert _calls(fresh) == calls
    assert str(marker) in caplog.text and "PAGEDLLM_REBUILD_NATIVE=1" in caplog.text
    # PAGEDLLM_REBUILD_NATIVE=1 tries again.
    monkeypatch.setenv("PAGEDLLM_REBUILD_NATIVE", "1")
    _forget_libraries()
    library.active_isa()
    assert _calls(fresh) > calls


def test_every_build_failing_leaves_pytorch(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(library, "available_isas", lambda: ["avx512", "avx2", "scalar"])
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "-c ")))
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert library.native_library() is None
    assert "run in PyTorch" in caplog.text
    assert caplog.text.count("error: '__m512' was not declared") == 3  # once per ISA tried
    assert len(list((fresh / "cache").glob("kernels-*.failed"))) == 3
    assert not library.available()


def test_a_missing_compiler_says_so(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(fresh / "no-such-c++"))
    with pytest.raises(build.BuildFailed, match="cannot run the C\\+\\+ compiler .*install g\\+\\+ or set CXX"):
        build.load("scalar")


def test_an_unwritable_cache_is_a_named_build_failure(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache that cannot be created (a file in its path) fails the variant, which falls back,
    instead of an OSError traceback from the first command."""
    (fresh / "file").write_text("")
    monkeypatch.setenv("PAGEDLLM_CACHE", str(fresh / "file" / "cache"))
    with pytest.raises(build.BuildFailed, match="cannot write the kernel cache .*set PAGEDLLM_CACHE to a writable"):
        build.load("scalar")


def test_a_silent_failing_compiler_is_reported(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(build.BuildFailed, match="/bin/false exited with status 1 and no message"):
        build.load("scalar")
    assert build.library_path("scalar").with_suffix(".failed").exists()


def test_a_compile_past_the_time_limit_is_ended(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiler driver gets SIGTERM (gcc's then ends its cc1plus), the build says why and
    leaves no failure marker (a busy machine, not a broken build)."""
    slow = fresh / "slow-c++"
    slow.write_text(
        "#!/bin/sh\n"
        'case "$1" in --version) echo "slow c++ 1.0"; exit 0;; esac\n'
        f"trap 'kill $child; echo ended >> {fresh}/ended; exit 1' TERM\n"
        "sleep 60 & child=$!\nwait\n"
    )
    slow.chmod(0o755)
    monkeypatch.setenv("CXX", str(slow))
    monkeypatch.setattr(build, "_COMPILE_TIMEOUT_S", 1)
    with pytest.raises(build.BuildFailed, match="ran past 1 s"):
        build.load("scalar")
    assert "ended" in (fresh / "ended").read_text()  # the compiles still queued were cancelled
    assert not build.library_path("scalar").with_suffix(".failed").exists()


def test_cpu_isa_forces_an_isa_and_rejects_others(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(library, "available_isas", lambda: ["avx512", "avx2", "scalar"])
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "never")))
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "scalar")
    assert library.active_isa() == "scalar"
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "Scalar")  # any case names the variant
    _forget_libraries()
    assert library.active_isa() == "scalar"
    for bad, why in (("neon", "an ISA this CPU cannot run"), ("NEON", "an ISA this CPU cannot run"),
                     ("sse9", "an unknown ISA"), ("SSE9", "an unknown ISA")):
        monkeypatch.setenv("PAGEDLLM_CPU_ISA", bad)
        _forget_libraries()
        with pytest.raises(ValueError, match=f"PAGEDLLM_CPU_ISA='{bad}' is {why}; this CPU runs: avx512, avx2, scalar"):
            library.native_library()
    with pytest.raises(ValueError, match="isa='neon' is an ISA this CPU cannot run"):
        library.native_library("neon")
    with pytest.raises(ValueError, match="unknown ISA"), library.use_isa("sse9"):
        pass


def test_first_calls_from_several_threads_build_and_log_once(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A loader's thread pool asks for the library from every thread at once: one build."""
    monkeypatch.setattr(library, "available_isas", lambda: ["avx512", "avx2", "scalar"])
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "never")))
    with caplog.at_level(logging.INFO, logger="pagedllm"), ThreadPoolExecutor(4) as pool:
        assert set(pool.map(lambda _: library.active_isa(), range(8))) == {"avx512"}
    assert caplog.text.count("native kernels: avx512") == 1
    assert (fresh / "calls").read_text().count("-shared") == 1


@pytest.mark.parametrize("name", ["PAGEDLLM_DISABLE_NATIVE", "PAGEDLLM_REBUILD_NATIVE"])
def test_a_switch_that_is_neither_0_nor_1_is_refused(name: str, fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``yes`` or ``true`` used to read as off, unnoticed."""
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "never")))
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=f"{name}='yes' must be 1 \\(on\\) or 0 \\(off\\)"):
        library.active_isa()
    monkeypatch.setenv(name, "0")
    assert library.active_isa() is not None


def test_disable_native_builds_nothing(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "never")))
    monkeypatch.setenv("PAGEDLLM_DISABLE_NATIVE", "1")
    assert library.native_library() is None and library.native_library("scalar") is None
    assert library.active_isa() is None
    assert _calls(fresh) == 0


def test_processes_building_at_once_build_once(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each caller holds its own lock file description, as separate processes do: the first
    builds, the others wait on the lock and load its library; no build folder is left."""
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "never", delay=0.5)))
    with ThreadPoolExecutor(3) as pool:
        libraries = list(pool.map(lambda _: build.load("scalar"), range(3)))
    assert len(libraries) == 3 and (fresh / "calls").read_text().count("-shared") == 1
    assert not list((fresh / "cache").glob("build-*"))


def test_a_build_removes_the_folders_of_dead_builders(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    cache = fresh / "cache"
    orphan, alive = cache / f"build-{dead.stdout.strip()}-x1", cache / f"build-{os.getpid()}-x2"
    for folder in (orphan, alive):
        folder.mkdir(parents=True)
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "never")))
    build.load("scalar")
    assert not orphan.exists() and alive.exists()


def test_a_failed_build_leaves_no_build_folder(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "-c ")))
    with pytest.raises(build.BuildFailed):
        build.load("scalar")
    assert not list((fresh / "cache").glob("build-*"))


def test_the_build_notice_comes_before_the_build(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "-c ")))
    with caplog.at_level(logging.INFO, logger="pagedllm"), pytest.raises(build.BuildFailed):
        build.load("scalar")
    assert caplog.records[0].getMessage().startswith("building the scalar native kernels: first use")
    assert " s (longer on a busy machine)" in caplog.records[0].getMessage()


def test_a_shipped_library_is_loaded_without_compiling(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prebuilt = fresh / "prebuilt"
    prebuilt.mkdir()
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "never")))
    build.load("scalar")
    shutil.copy(build.library_path("scalar"), prebuilt / "kernels-avx2.so")
    calls = _calls(fresh)
    monkeypatch.setattr(build, "PREBUILT", prebuilt)
    monkeypatch.setattr(library, "available_isas", lambda: ["avx2", "scalar"])
    assert library.active_isa() == "avx2" and build.library_path("avx2") == prebuilt / "kernels-avx2.so"
    assert _calls(fresh) == calls


def test_a_library_needing_what_the_cpu_lacks_is_skipped(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "never", requires="avx2 amx_tile")))
    monkeypatch.setattr(library, "available_isas", lambda: ["avx2", "scalar"])
    monkeypatch.setattr(library, "cpu_flags", lambda: ZEN3)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert library.active_isa() is None
    assert "needs amx_tile, which this CPU lacks" in caplog.text


def test_a_library_from_another_header_is_skipped(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "never")))
    monkeypatch.setattr(abi, "FUNCTIONS", {**abi.FUNCTIONS, "kernel_of_the_future": (None, [])})
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert library.native_library("scalar") is None
    assert "lacks kernel_of_the_future" in caplog.text


def test_the_first_line_of_a_first_run_is_the_build_notice(tmp_path: Path) -> None:
    """``pagedllm generate`` with an empty kernel cache: logging is on before the flags are
    checked (which picks the kernels), so the command's own first line is followed at once by
    the build notice, not minutes of silence. The fake compiler fails, then the model file
    (empty: a path that does not exist is refused before the kernels are picked) does:
    nothing slow runs."""
    import subprocess
    import sys

    env = {**os.environ, "PAGEDLLM_CACHE": str(tmp_path / "cache"), "CXX": str(fake_compiler(tmp_path, "-c "))}
    for name in ("PAGEDLLM_CPU_ISA", "PAGEDLLM_DISABLE_NATIVE", "PAGEDLLM_REBUILD_NATIVE"):
        env.pop(name, None)
    (tmp_path / "empty.gguf").touch()
    command = ["generate", "--prompt", "hi", "--model", str(tmp_path / "empty.gguf")]
    done = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", *command], capture_output=True, text=True, env=env, timeout=300
    )
    first, second = (done.stdout + done.stderr).splitlines()[:2]
    assert "generate: model" in first, first
    assert "building the" in second and "native kernels: first use" in second, second
