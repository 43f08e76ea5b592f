"""Packed weights' and the K/V caches' memory (``kernels.huge_pages``): aligned tensors that
keep their values and their mappings, in mappings advised as huge pages on Linux, plain
tensors when switched off."""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

from pagedllm.kernels import huge_pages
from pagedllm.worker.kv_cache import zeroed_memory


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.float16, torch.float32])
@pytest.mark.parametrize("numel", [0, 1, 63, 4096, 3 * 1024 * 1024 + 5])
def test_empty_is_an_aligned_writable_1d_tensor(numel: int, dtype: torch.dtype) -> None:
    t = huge_pages.empty(numel, dtype)
    assert t.shape == (numel,) and t.dtype == dtype and t.device.type == "cpu"
    if numel:
        assert t.data_ptr() % 64 == 0
        t.fill_(7)
        assert bool((t == 7).all())


def test_tensors_keep_their_values_and_mappings() -> None:
    """Enough tensors to fill several shared mappings, and one large enough for its own; each
    keeps its values after the others are dropped and the mappings rotate."""
    sizes = [5 << 20] * 30 + [40 << 20, 3000]
    kept = []
    for i, n in enumerate(sizes):
        t = huge_pages.empty(n, torch.uint8)
        t.fill_(i % 251)
        if i % 2:
            kept.append((i, t))
    gc.collect()
    for _ in range(20):  # more allocations reuse nothing that a kept tensor holds
        huge_pages.empty(5 << 20, torch.uint8).fill_(255)
    for i, t in kept:
        assert int(t.min()) == int(t.max()) == i % 251


@pytest.mark.skipif(
    not huge_pages.enabled() or not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
    reason="no MADV_HUGEPAGE, or a kernel without transparent huge pages",
)
def test_mappings_are_advised_as_huge_pages() -> None:
    small, large = huge_pages.empty(1000, torch.float32), huge_pages.empty(20 << 20, torch.uint8)
    kv = zeroed_memory(8 << 20)  # the K/V caches' memory
    for t in (small, large, kv):
        assert "hg" in _vm_flags(t.data_ptr())
    assert int(kv.max()) == 0


def test_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_DISABLE_HUGE_PAGES", "1")
    assert not huge_pages.enabled()
    t = huge_pages.empty(1000, torch.int8)
    assert t.shape == (1000,) and t.dtype == torch.int8
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert "hg" not in _vm_flags(t.data_ptr())
        assert "hg" not in _vm_flags(zeroed_memory(4 << 20).data_ptr())
