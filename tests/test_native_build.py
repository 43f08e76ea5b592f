"""Building the kernels per ISA: what each CPU runs, the flags, the cache key, failure
markers, the fallback from one ISA to the next, PAGEDLLM_CPU_ISA, and dtype auto's table.

The build tests use a fake compiler (a shell script in tmp_path) that fails where told and
otherwise links a stub library exporting the kernels' names: no real build.
"""

from __future__ import annotations

import logging
import shutil
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pagedllm import config
from pagedllm.kernels import build, library, ops
from pagedllm.kernels.isa import ALL_ISAS, isa_flags, runnable_isas

SAPPHIRE_RAPIDS = frozenset("avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16".split())
ZEN3 = frozenset("avx2 fma f16c bmi2".split())
EXPORTS = [
    "paged_decode_attention_bf16", "paged_decode_attention_f32", "paged_prefill_attention", "linear_w8a8_available",
    "linear_pack_f32", "linear_f32", "linear_pack_w8a8", "linear_w8a8",
    "linear_pack_q4a8", "linear_q4a8", "add_rms_norm", "rotary_inplace",
    "silu_and_mul", "gelu_tanh_and_mul", "write_kv_cache", "argmax_rows", "decode_layers",
]


def test_runnable_isas() -> None:
    assert runnable_isas(SAPPHIRE_RAPIDS, "x86_64") == ["avx512", "avx2", "scalar"]
    assert runnable_isas(ZEN3, "x86_64") == ["avx2", "scalar"]
    assert runnable_isas(frozenset({"avx2", "fma"}), "x86_64") == ["scalar"]  # no f16c
    assert runnable_isas(frozenset({"asimd", "asimddp"}), "aarch64") == ["neon", "scalar"]
    assert runnable_isas(frozenset(), "arm64") == ["scalar"]


def test_flags_per_isa() -> None:
    common = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++20"]
    # avx2 is exactly an AMD Zen 3's, whatever the build machine has.
    assert isa_flags("avx2", SAPPHIRE_RAPIDS) == [*common, "-mavx2", "-mfma", "-mf16c"]
    assert isa_flags("scalar", SAPPHIRE_RAPIDS) == ["-O2", *common[1:], "-DPAGEDLLM_VEC_SCALAR"]
    avx512 = isa_flags("avx512", SAPPHIRE_RAPIDS)
    assert {"-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16"} <= set(avx512)
    assert "-mavx512vnni" not in isa_flags("avx512", SAPPHIRE_RAPIDS - {"avx512_vnni"})
    assert isa_flags("neon", frozenset({"asimd", "asimddp"}))[-1] == "-march=armv8.2-a+dotprod"
    assert isa_flags("neon", frozenset({"asimd"}))[-1] == "-march=armv8-a"
    assert not any("native" in flag for isa in ALL_ISAS for flag in isa_flags(isa, SAPPHIRE_RAPIDS))
    with pytest.raises(ValueError, match="unknown ISA 'sse'; valid: avx512, avx2, neon, scalar"):
        isa_flags("sse", SAPPHIRE_RAPIDS)


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


def fake_compiler(tmp_path: Path, fail_on: str, version: str = "fake c++ 1.0") -> Path:
    """A compiler that logs each compile or link to ``calls``, fails on arguments containing
    ``fail_on`` with one gcc-style error line, and otherwise links a stub of the kernels'
    exports with the real gcc."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc to link the stub library")
    stub = tmp_path / "stub.c"
    stub.write_text("".join(f"int {name}(void) {{ return 0; }}\n" for name in EXPORTS))
    script = tmp_path / f"cxx{len(list(tmp_path.glob('cxx*')))}"
    script.write_text(f"""#!/bin/sh
if [ "$1" = --version ]; then echo "{version}"; exit 0; fi
echo "$*" >> {tmp_path}/calls
case "$*" in *"{fail_on}"*) echo "kernel.cpp:3:7: error: '__m512' was not declared in this scope" >&2; exit 1;; esac
case "$*" in *-shared*) while [ "$1" != -o ]; do shift; done; exec gcc -shared -fPIC -o "$2" {stub};; esac
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def _calls(tmp_path: Path) -> int:
    calls = tmp_path / "calls"
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_cache_key_differs_by_isa_flags_and_compiler(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    paths = {isa: build.library_path(isa) for isa in ("avx512", "avx2", "scalar")}
    assert len(set(paths.values())) == 3
    assert all(p.name.startswith(f"kernels-{isa}-") and p.suffix == ".so" for isa, p in paths.items())
    monkeypatch.setattr(build, "cpu_flags", lambda: SAPPHIRE_RAPIDS - {"avx512_bf16"})
    assert build.library_path("avx512") != paths["avx512"]  # other flags
    assert build.library_path("avx2") == paths["avx2"]  # the same flags
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "never", "fake c++ 1.0")))
    one = build.library_path("avx2")
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "never", "fake c++ 2.0")))
    assert len({one, build.library_path("avx2"), paths["avx2"]}) == 3  # another compiler, another version


def test_a_failed_build_leaves_a_marker_falls_back_and_is_not_retried(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(library, "available_isas", lambda: ["avx512", "avx2", "scalar"])
    monkeypatch.setattr(build, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
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
    assert not ops.available()


def test_a_missing_compiler_says_so(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(fresh / "no-such-c++"))
    with pytest.raises(build.BuildFailed, match="cannot run the C\\+\\+ compiler .*install g\\+\\+ or set CXX"):
        build.load("scalar")


def test_a_silent_failing_compiler_is_reported(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(build.BuildFailed, match="/bin/false exited with status 1 and no message"):
        build.load("scalar")
    assert build.library_path("scalar").with_suffix(".failed").exists()


def test_cpu_isa_forces_an_isa_and_rejects_others(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(library, "available_isas", lambda: ["avx512", "avx2", "scalar"])
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "never")))
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "scalar")
    assert library.active_isa() == "scalar"
    for bad, why in (("neon", "an ISA this CPU cannot run"), ("sse9", "an unknown ISA")):
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


def test_disable_native_builds_nothing(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(fake_compiler(fresh, "never")))
    monkeypatch.setenv("PAGEDLLM_DISABLE_NATIVE", "1")
    assert library.native_library() is None and library.native_library("scalar") is None
    assert library.active_isa() is None
    assert _calls(fresh) == 0


@pytest.mark.parametrize(
    ("isa", "w8a8", "linears"),
    [("avx512", True, "w4a8"), ("avx2", True, "w4a8"), ("neon", True, "w8a8"), ("scalar", True, "float32"),
     (None, False, "int8"), ("avx2", False, "float32")],  # the table, and a library without the integer GEMMs
)
def test_dtype_auto_by_isa(isa: str | None, w8a8: bool, linears: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(library, "active_isa", lambda: isa)
    monkeypatch.setattr(ops, "linear_w8a8_available", lambda: w8a8)
    assert config.auto_linears() == linears
    expected = "none" if linears == "float32" else linears
    assert config.dtype_settings("auto")["quantization"] == expected


def test_w8a8_is_bit_identical_on_every_isa() -> None:
    """The int8 dot products are exact and the float32 steps run in the same order on every
    ISA, so a w8a8 layer's output (and perplexity) does not depend on the CPU kind."""
    from native_isa import ISAS

    from pagedllm.kernels import ops
    from pagedllm.kernels.library import native_library, use_isa

    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(70, 100, generator=gen), torch.randn(5, 100, generator=gen)
    outputs = {}
    for isa in ISAS:
        if native_library(isa) is None:
            continue
        with use_isa(isa):
            outputs[isa] = ops.linear_w8a8(x, ops.linear_pack_w8a8(w), None, 70)
    if len(outputs) < 2:
        pytest.skip(f"fewer than two ISAs build here: {sorted(outputs)}")
    first = next(iter(outputs.values()))
    for isa, y in outputs.items():
        assert torch.equal(y, first), isa
