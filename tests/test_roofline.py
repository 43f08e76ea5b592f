"""The compute probes behind ``bench roofline`` and its peak model (no timing asserted)."""

from __future__ import annotations

import math

import pytest

from pagedllm.bench.roofline import _macs_per_cycle, physical_cores
from pagedllm.kernels.library import native_library
from tests.native_isa import ISAS, on_isa


@pytest.mark.parametrize("isa", ISAS)
def test_probes_run_their_loops(isa):
    with on_isa(isa):
        lib = native_library()
        assert lib.probe_add_chain(1003) == 1000  # whole groups of 8 dependent adds
        assert math.isfinite(lib.probe_fma_f32(1000))
        assert lib.probe_dot_i8(1000) == 0  # zero weights: every dot product is 0
        assert math.isfinite(lib.probe_dot_fma_i8(1000, 3)) and lib.probe_dot_fma_i8(1000, 5) == -1


def test_peak_model():
    f32_avx2, i8_avx2 = _macs_per_cycle("avx2")
    assert i8_avx2 == 2 * f32_avx2  # vpmaddubsw + vpmaddwd: twice a float32 FMA's multiply-adds per issue pair
    f32_vnni, i8_vnni = _macs_per_cycle("avx512_vnni")
    assert i8_vnni == 4 * f32_vnni
    assert _macs_per_cycle("scalar") is None
    assert 1 <= physical_cores(2) <= 2
