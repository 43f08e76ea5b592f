"""Which instruction sets this CPU runs, and the compiler flags that build the kernels for each.

The kernels (``pagedllm/csrc``) pick their vector code from the compiler's predefined
macros (``csrc/vec.h``), so an ISA is only a set of flags: never ``-march=native``, which
would build for whatever the build machine has and load on no other.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# Best first, per architecture: a build that fails falls back to the next.
X86_ISAS = ("avx512", "avx2", "scalar")
ARM_ISAS = ("neon", "scalar")
ALL_ISAS = ("avx512", "avx2", "neon", "scalar")

# The cpuinfo flags an ISA's build needs, every one of them, to run here.
_REQUIRED = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "avx2"},
    "avx2": {"avx2", "fma", "f16c"},
    "neon": {"asimd"},
    "scalar": set(),
}
COMMON_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++20")
# scalar at -O2: at -O3 GCC also unrolls with growth the plain 16-lane loops of each of the
# decode attention's 24 instantiations, which made paged_attention.cpp (built once per cache
# dtype) the longest wait of a first test run, for kernels no faster.
_SCALAR = ("-O2", *COMMON_FLAGS[1:], "-DPAGEDLLM_VEC_SCALAR")
# avx2 is exactly what an AMD Zen 3 runs, so an AVX-512 host can build and test it too.
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (x86 ``flags``, aarch64 ``Features``).

    Without ``/proc/cpuinfo`` (macOS): every Apple arm64 CPU has NEON with dot products;
    anything else is taken to run the baseline only.
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset({"asimd", "asimddp"} if is_arm(platform.machine()) else ())
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def is_arm(machine: str) -> bool:
    """Whether ``platform.machine()``'s answer names a 64-bit Arm CPU (Linux or macOS spelling)."""
    return machine.lower() in ("arm64", "aarch64")


def runnable_isas(flags: frozenset[str], machine: str) -> list[str]:
    """The ISAs a CPU of architecture ``machine`` (``platform.machine()``) with these cpuinfo
    ``flags`` executes, best first (``scalar`` always)."""
    return [isa for isa in (ARM_ISAS if is_arm(machine) else X86_ISAS) if _REQUIRED[isa] <= flags]


def isa_flags(isa: str, flags: frozenset[str]) -> list[str]:
    """Compiler flags for ``isa`` on a CPU with cpuinfo ``flags``: the common ones, then the
    ISA's (optional extensions the CPU has, e.g. AVX512-VNNI, are enabled too).

    Raises:
        ValueError: for a name not in ``ALL_ISAS``.
    """
    if isa == "avx512":
        extra = [f"-m{ext}" for ext in ("avx512vnni", "avx512bf16") if ext.replace("avx512", "avx512_") in flags]
        return [*COMMON_FLAGS, *_AVX512, *extra]
    if isa == "avx2":
        return [*COMMON_FLAGS, *_AVX2]
    if isa == "neon":
        return [*COMMON_FLAGS, "-march=armv8.2-a+dotprod" if "asimddp" in flags else "-march=armv8-a"]
    if isa == "scalar":  # NEON is aarch64's baseline: vec.h would pick it without the define
        return list(_SCALAR)
    raise ValueError(f"unknown ISA {isa!r}; valid: {', '.join(ALL_ISAS)}")
