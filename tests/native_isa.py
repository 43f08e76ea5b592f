"""Run kernel tests on each ISA's library: every ISA this CPU executes, best first. ``ZEN3``: an
AMD Zen 3's CPU features (AVX2, no AVX-512), a CPU the ISA and build tests pretend to be."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from pagedllm.kernels.library import available_isas, build_error, native_library, use_isa

ISAS = available_isas()
ZEN3 = frozenset("avx2 fma f16c bmi2".split())  # as /proc/cpuinfo names them


@contextmanager
def on_isa(isa: str) -> Iterator[None]:
    """Every native call inside the block runs on ``isa``'s library; the test is skipped,
    quoting the compiler's first error line, where that ISA's build fails."""
    if os.environ.get("PAGEDLLM_DISABLE_NATIVE") == "1":
        pytest.skip("PAGEDLLM_DISABLE_NATIVE=1")
    if native_library(isa) is None:
        pytest.skip(f"the {isa} kernels do not build here: {build_error(isa)}")
    with use_isa(isa):
        yield
