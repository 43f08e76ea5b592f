"""The kernel variants: what each one needs from the CPU, the compiler flags that build it, and
which of them this CPU runs.

A variant is named by the instruction sets it needs and built with fixed flags, whatever the
build machine has (never ``-march=native``), so one name is one machine code everywhere: a
wheel built on one machine serves every CPU its variants' requirements fit. The kernels pick
their vector code from the compiler's predefined macros (``csrc/vec.h``), and each library
reports the features those macros stand for (``pagedllm_requires()``, ``csrc/abi.cpp``).

Features are read from ``/proc/cpuinfo``. Linux lists AVX, AVX-512 and their extensions
there only when the kernel enables their register state (XCR0), so a CPU whose OS does not
save the AVX-512 registers is offered the AVX2 variant. (PyTorch's detector,
``torch.backends.cpu.get_cpu_capability()``, tells only AVX2 from AVX-512 in 2.13, not
VNNI or BF16, and importing torch here would slow the wheel's build.)
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# Best first, per architecture: a variant that fails to build or load falls back to the next.
X86_ISAS = ("avx512_bf16", "avx512_vnni", "avx512", "avx2", "scalar")
ARM_ISAS = ("neon_dotprod", "neon", "scalar")
ALL_ISAS = ("avx512_bf16", "avx512_vnni", "avx512", "avx2", "neon_dotprod", "neon", "scalar")

# Per x86 variant, the compiler's -m options; each one's /proc/cpuinfo flag is its name, but
# for the two below, which Linux spells with an underscore.
_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512dq")
_X86_OPTIONS = {
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_vnni": (*_AVX512, "avx512vnni"),
    "avx512_bf16": (*_AVX512, "avx512vnni", "avx512bf16"),
}
_CPUINFO_NAME = {"avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16"}
_ARM_MARCH = {"neon_dotprod": ("armv8.2-a+dotprod", {"asimd", "asimddp"}), "neon": ("armv8-a", {"asimd"})}
COMMON_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++20")


def required_features(isa: str) -> frozenset[str]:
    """The /proc/cpuinfo flags a CPU needs, every one, to run ``isa``'s library (what that
    library's ``pagedllm_requires()`` reports).

    Raises:
        ValueError: for a name not in ``ALL_ISAS``.
    """
    if isa in _X86_OPTIONS:
        return frozenset(_CPUINFO_NAME.get(option, option) for option in _X86_OPTIONS[isa])
    if isa in _ARM_MARCH:
        return frozenset(_ARM_MARCH[isa][1])
    if isa == "scalar":
        return frozenset()
    raise ValueError(f"unknown ISA {isa!r}; valid: {', '.join(ALL_ISAS)}")


def isa_flags(isa: str) -> list[str]:
    """The compiler flags that build ``isa``'s library: the common ones, then the variant's.

    Raises:
        ValueError: for a name not in ``ALL_ISAS``.
    """
    if isa in _X86_OPTIONS:
        return [*COMMON_FLAGS, *(f"-m{option}" for option in _X86_OPTIONS[isa])]
    if isa in _ARM_MARCH:
        return [*COMMON_FLAGS, f"-march={_ARM_MARCH[isa][0]}"]
    if isa == "scalar":  # NEON is aarch64's baseline: vec.h would pick it without the define
        # -O2: at -O3 GCC also unrolls, with growth, the plain 16-lane loops of each of the decode
        # attention's instantiations: a build over twice as long, for kernels no faster
        # (docs/benchmarks.md, kernel builds).
        return ["-O2", *COMMON_FLAGS[1:], "-DPAGEDLLM_VEC_SCALAR"]
    raise ValueError(f"unknown ISA {isa!r}; valid: {', '.join(ALL_ISAS)}")


def architecture_isas(machine: str) -> tuple[str, ...]:
    """The variants built for architecture ``machine`` (``platform.machine()``), best first."""
    if is_arm(machine):
        return ARM_ISAS
    return X86_ISAS if machine.lower() in ("x86_64", "amd64") else ("scalar",)


@functools.cache
def _cpuinfo() -> dict[str, str] | None:
    """``/proc/cpuinfo``'s fields, each key's first value (the first processor's); None without
    the file (macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (x86 ``flags``, aarch64 ``Features``).

    Without ``/proc/cpuinfo`` (macOS): every Apple arm64 CPU has NEON with dot products;
    anything else is taken to run the baseline only.
    """
    fields = _cpuinfo()
    if fields is None:
        return frozenset({"asimd", "asimddp"} if is_arm(platform.machine()) else ())
    return frozenset(fields.get("flags", fields.get("Features", "")).split())


def cpu_vendor_family() -> tuple[str, int]:
    """x86 ``/proc/cpuinfo``'s ``vendor_id`` and ``cpu family`` (``GenuineIntel``, 6;
    ``AuthenticAMD``, 25); ("", 0) where it names none (Arm, macOS)."""
    fields = _cpuinfo() or {}
    return fields.get("vendor_id", ""), int(fields.get("cpu family", 0))


def is_arm(machine: str) -> bool:
    """Whether ``platform.machine()``'s answer names a 64-bit Arm CPU (Linux or macOS spelling)."""
    return machine.lower() in ("arm64", "aarch64")


def runnable_isas(flags: frozenset[str], machine: str) -> list[str]:
    """The variants a CPU of architecture ``machine`` (``platform.machine()``) with these
    cpuinfo ``flags`` executes, best first (``scalar`` always)."""
    return [isa for isa in architecture_isas(machine) if required_features(isa) <= flags]
