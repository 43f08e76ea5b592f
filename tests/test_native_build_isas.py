"""The kernels' ISAs: which ones a CPU runs, best first; each one's compiler flags, fixed
whatever the build machine has, with which every x86 variant compiles on any x86 machine;
dtype auto's linear layers per ISA; and the int8 GEMMs, whose outputs are the same bits on
every ISA. Building the variants (the cache, failures, fallbacks): ``test_native_build.py``.
"""

from __future__ import annotations

import os
import platform
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagedllm.kernels import build, library
from pagedllm.kernels.isa import ALL_ISAS, X86_ISAS, isa_flags, required_features, runnable_isas
from pagedllm.platforms import cpu
from tests.native_isa import ZEN3

SAPPHIRE_RAPIDS = frozenset("avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16".split())


def test_runnable_isas() -> None:
    assert runnable_isas(SAPPHIRE_RAPIDS, "x86_64") == ["avx512_bf16", "avx512_vnni", "avx512", "avx2", "scalar"]
    assert runnable_isas(SAPPHIRE_RAPIDS - {"avx512_bf16"}, "x86_64") == ["avx512_vnni", "avx512", "avx2", "scalar"]
    assert runnable_isas(ZEN3, "x86_64") == ["avx2", "scalar"]
    assert runnable_isas(frozenset({"avx2", "fma"}), "x86_64") == ["scalar"]  # no f16c
    assert runnable_isas(frozenset({"asimd", "asimddp"}), "aarch64") == ["neon_dotprod", "neon", "scalar"]
    assert runnable_isas(frozenset({"asimd"}), "aarch64") == ["neon", "scalar"]
    assert runnable_isas(frozenset(), "arm64") == ["scalar"]
    assert runnable_isas(SAPPHIRE_RAPIDS, "riscv64") == ["scalar"]


def test_flags_per_isa_are_fixed() -> None:
    common = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++20"]
    # avx2 is exactly an AMD Zen 3's, whatever the build machine has.
    assert isa_flags("avx2") == [*common, "-mavx2", "-mfma", "-mf16c"]
    assert isa_flags("scalar") == ["-O2", *common[1:], "-DPAGEDLLM_VEC_SCALAR"]
    avx512 = {"-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"}
    assert avx512 <= set(isa_flags("avx512")) and not {"-mavx512vnni", "-mavx512bf16"} & set(isa_flags("avx512"))
    assert avx512 | {"-mavx512vnni"} <= set(isa_flags("avx512_vnni")) and "-mavx512bf16" not in isa_flags("avx512_vnni")
    assert avx512 | {"-mavx512vnni", "-mavx512bf16"} <= set(isa_flags("avx512_bf16"))
    assert isa_flags("neon_dotprod")[-1] == "-march=armv8.2-a+dotprod"
    assert isa_flags("neon")[-1] == "-march=armv8-a"
    assert required_features("avx512_bf16") == SAPPHIRE_RAPIDS
    assert not any("native" in flag for isa in ALL_ISAS for flag in isa_flags(isa))
    with pytest.raises(ValueError, match="unknown ISA 'sse'; valid: avx512_bf16, avx512_vnni, avx512, avx2, neon"):
        isa_flags("sse")


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None, reason="needs g++ on x86")
def test_every_x86_variant_compiles_here() -> None:
    """The wheel builds every x86 variant on whatever x86 machine builds it: each translation
    unit must compile with each variant's flags, not only with the ones this CPU runs (a
    header leaning on an include that only some units make breaks one variant alone)."""
    cxx = build.compiler()[0]
    jobs = [(isa, src, defines) for isa in X86_ISAS for src, defines in build._units()]
    commands = [[cxx, *isa_flags(isa), *defines, "-fsyntax-only", str(src)] for isa, src, defines in jobs]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        errors = list(pool.map(build._run, commands))
    assert {f"{isa} {src.name} {defines}": e for (isa, src, defines), e in zip(jobs, errors) if e} == {}


@pytest.mark.parametrize(
    ("isa", "linears"),
    [("avx512_bf16", "w4a8"), ("avx512", "w4a8"), ("avx2", "w4a8"), ("neon_dotprod", "w8a8"), ("neon", "w8a8"),
     ("scalar", "float32"), (None, "int8")],
)
def test_dtype_auto_by_isa(isa: str | None, linears: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(library, "active_isa", lambda: isa)
    assert cpu.auto_linears() == linears
    expected = "none" if linears == "float32" else linears
    assert cpu.dtype_settings("auto")["quantization"] == expected


def test_int8_gemms_are_bit_identical_on_every_isa() -> None:
    """The int8 dot products are exact (w4a8's int16 partial sums on AVX2 too) and the float32
    steps run in the same order on every ISA, so a w8a8 or w4a8 layer's output (and
    perplexity) does not depend on the CPU kind."""
    from native_isa import ISAS

    from pagedllm.kernels import linear as kernels
    from pagedllm.kernels.library import native_library, use_isa

    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(70, 100, generator=gen), torch.randn(35, 100, generator=gen)  # 35 rows: AVX2's int16 tile
    codes = torch.randint(0, 16, (70, 100), dtype=torch.uint8, generator=gen)
    scales, mins = torch.rand(70, 4, generator=gen), -torch.rand(70, 4, generator=gen)
    outputs = {}
    for isa in ISAS:
        if native_library(isa) is None:
            continue
        with use_isa(isa):
            outputs[isa] = (
                kernels.linear_w8a8(x, kernels.linear_pack_w8a8(w), None, 70),
                kernels.linear_q4a8(x, kernels.linear_pack_q4a8(codes, scales, mins), None, 70),
            )
    if len(outputs) < 2:
        pytest.skip(f"fewer than two ISAs build here: {sorted(outputs)}")
    first = next(iter(outputs.values()))
    for isa, (y8, y4) in outputs.items():
        assert torch.equal(y8, first[0]), isa
        assert torch.equal(y4, first[1]), isa


def test_every_isa_has_a_dtype_auto_choice() -> None:
    assert set(ALL_ISAS) | {None} == set(cpu._AUTO_LINEARS)
