"""glibc's free heap pages given back: when the engine core trims, that a trim releases them, and
the front end's trim after tokenizing a huge text."""

from __future__ import annotations

import ctypes
import platform

import pytest

from pagedllm.engine import malloc_trim as mt


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_trim_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []
    clock = _Clock()
    monkeypatch.setattr(mt, "malloc_trim", lambda: calls.append(clock.now) or True)
    t = mt.Trimmer(interval_s=60.0, clock=clock)

    t.started()
    assert calls == [0.0]
    t.idle()  # idle with no step since: nothing freed worth a trim
    assert calls == [0.0]

    for s in range(1, 150):  # two and a half minutes of steps, one a second
        clock.now = float(s)
        t.stepped()
    assert calls == [0.0, 60.0, 120.0]  # busy: at most once a minute

    clock.now = 150.0
    t.idle()
    t.idle()  # one trim per idle period
    assert calls == [0.0, 60.0, 120.0, 150.0]

    clock.now = 151.0
    t.stepped()  # 1 s after the idle trim: not yet
    assert calls[-1] == 150.0
    t.idle()
    assert calls == [0.0, 60.0, 120.0, 150.0, 151.0] and t.count == 5


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_malloc_trim_releases_free_pages_under_a_live_block() -> None:
    """Freed chunks below a live one stay resident (glibc returns only the top of a heap on
    free); malloc_trim gives their pages back."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    size = 64 * 1024  # under the mmap threshold: from the heap
    blocks = [libc.malloc(size) for _ in range(1024)]  # 64 MiB
    for b in blocks:
        libc.memset(b, 1, size)
    pin = libc.malloc(size)  # live, above them: the heap's top cannot shrink
    try:
        for b in blocks:
            libc.free(b)
        before = _rss_kb()
        assert mt.malloc_trim()
        assert before - _rss_kb() > 32 * 1024  # most of the 64 MiB
    finally:
        libc.free(pin)


def test_tokenizing_a_huge_text_is_followed_by_a_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of TRIM_AFTER_CHARS or more (as text, or as a chat's rendered text) leaves its
    tokenizing thread's arena holding gigabytes: the front end trims after it, not after
    ordinary prompts."""
    from pagedllm.engine.processor import Processor
    from pagedllm.entrypoints.chat_template import chat_prompt
    from pagedllm.models.loader import load_tokenizer, resolve_model

    calls: list[int] = []
    monkeypatch.setattr(mt, "malloc_trim", lambda: calls.append(1) or True)
    tokenizer = load_tokenizer(resolve_model("smollm2"))
    processor = Processor(tokenizer, 1024, len(tokenizer), [tokenizer.eos_token_id])
    huge = "a " * (mt.TRIM_AFTER_CHARS // 2)
    processor.tokenize("a short prompt")
    chat_prompt(tokenizer, [{"role": "user", "content": "a short message"}], True)
    assert calls == []
    processor.tokenize(huge)
    assert calls == [1]
    chat_prompt(tokenizer, [{"role": "user", "content": huge}], True)
    assert calls == [1, 1]
