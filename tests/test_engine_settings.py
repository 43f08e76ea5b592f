"""The engine's settings: dtype auto per platform, EngineConfig's refusals, limits and warnings at start-up."""

import logging
import os

import pytest
import torch

from pagedllm import LLM
from pagedllm.kernels.attention import MAX_PREFILL_BLOCK


def test_max_model_len_beyond_the_kv_cache_is_lowered_with_a_warning(caplog):
    """The pool's capacity caps an explicit max_model_len: a warning names both lengths and
    the flags, and a prompt over the cap is refused naming the KV cache, not the model."""
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        llm = LLM(dtype="float32", kv_cache_memory="8MiB", max_model_len=2048)
    try:
        n = llm.engine.max_model_len
        assert 0 < n < 2048
        assert f"max_model_len 2048 does not fit in the KV cache" in caplog.text
        assert f"limited to {n} tokens; raise kv_cache_memory (--kv-cache-memory) or lower max_model_len" in caplog.text
        with pytest.raises(ValueError, match=rf"longer than the maximum context length the KV cache holds "
                                             rf"\(kv_cache_memory, --kv-cache-memory\) of {n} tokens"):
            llm.generate([{"prompt_token_ids": [5] * (n + 1)}], use_tqdm=False)
    finally:
        llm.shutdown()


def test_a_kv_cache_beyond_the_machines_memory_is_refused():
    """A budget larger than the machine (a typo: TiB for GiB) is an error naming the flag,
    raised before anything is allocated, instead of a pool of trillions of blocks."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(ValueError, match=r"x 1 rank\(s\) .* exceeds its memory, .* lower --kv-cache-memory"):
        LLM(dtype="float32", kv_cache_memory=2 * physical)
    # Each local tensor-parallel rank holds a budget: three of 0.4x the memory do not fit (refused
    # before any rank starts).
    with pytest.raises(ValueError, match=r"x 3 rank\(s\) and engine core\(s\) on this machine exceeds its memory"):
        LLM(dtype="float32", kv_cache_memory=int(0.4 * physical), tensor_parallel_size=3)


def test_block_size_above_the_prefill_kernel_warns(caplog):
    """Blocks larger than the native prefill kernel takes run prefill attention in PyTorch: said once at start-up."""
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        llm = LLM(dtype="float32", kv_cache_memory="32MiB", max_model_len=256, block_size=2 * MAX_PREFILL_BLOCK)
    llm.shutdown()
    warned = [r.getMessage() for r in caplog.records if "prefill attention runs in PyTorch" in r.getMessage()]
    assert warned == [
        f"block_size {2 * MAX_PREFILL_BLOCK}: prefill attention runs in PyTorch, not the native kernel, above block "
        f"size {MAX_PREFILL_BLOCK} (slower prompts; lower --block-size)"
    ]


def test_unknown_model_alias():
    with pytest.raises(ValueError, match="SmolLM2-135M-Instruct"):
        LLM(model="no-such-model")


def test_dtype_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto on AVX-512 kernels: float32 activations around w4a8 layers (the file's 4-bit blocks
    only; the rest and the lm_head w8a8), a bfloat16 K/V cache; an explicit quantization mode
    or dtype wins."""
    from pagedllm.platforms.cpu import dtype_settings
    from pagedllm.kernels import library

    monkeypatch.setattr(library, "active_isa", lambda: "avx512")
    assert dtype_settings("auto") == {
        "dtype": torch.float32, "kv_cache_dtype": torch.bfloat16, "quantization": "w4a8", "quantize_lm_head": True,
        "requantize_4bit": False,
    }
    assert dtype_settings("auto", quantization="none")["quantization"] == "none"
    assert dtype_settings("auto", quantization="int4")["quantization"] == "int4"
    assert dtype_settings("float32") == {"dtype": torch.float32, "kv_cache_dtype": None, "quantization": "none"}
    assert dtype_settings("auto", "float32")["kv_cache_dtype"] == torch.float32
    assert dtype_settings("auto", "int8")["kv_cache_dtype"] == torch.int8
    assert dtype_settings("auto", "fp8_e4m3")["kv_cache_dtype"] == torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be auto, float32, bfloat16, float16, int8 or fp8 \(fp8_e4m3\), got 'int4'"):
        dtype_settings("auto", "int4")
    with pytest.raises(ValueError, match="dtype must be one of"):
        dtype_settings("float8")
    with pytest.raises(ValueError, match="dtype must be one of"):  # not an AttributeError on .lower()
        dtype_settings(5)
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        dtype_settings("auto", 8)


@pytest.mark.parametrize(("field", "value"), [("max_model_len", "256"), ("seed", "x"), ("block_size", 16.0),
                                              ("max_num_seqs", True), ("kv_cache_memory", None)])
def test_engine_config_refuses_non_integer_settings(field: str, value: object) -> None:
    """Named before a comparison or torch.manual_seed fails on the value (a TypeError naming nothing)."""
    from pagedllm.config import EngineConfig

    with pytest.raises(ValueError, match=f"{field} must be an integer, got {value!r}"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize(("field", "value", "match"), [
    ("enable_prefix_caching", None, "enable_prefix_caching must be True or False, got None"),
    ("enable_lora", "no", "enable_lora must be True or False, got 'no'"),  # truthy: it turned LoRA on
    ("quantize_lm_head", 1, "quantize_lm_head must be True or False, got 1"),
    ("num_threads", 0, r"num_threads must be at least 1 \(None: all cores\), got 0"),
    ("num_threads", -2, "num_threads must be at least 1"),
])
def test_engine_config_refuses_non_bool_flags_and_no_threads(field: str, value: object, match: str) -> None:
    """A flag given as a str or None was taken for its truthiness (``enable_lora="no"`` enabled
    LoRA, ``enable_prefix_caching=None`` disabled caching), and num_threads 0 or below was taken
    for "all cores" or failed in torch: each is refused naming the setting."""
    from pagedllm.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(**{field: value})
    assert EngineConfig(enable_lora=False, num_threads=None).enable_prefix_caching is True


def test_dtype_settings_without_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto on the PyTorch fallback: float32 activations and K/V cache (never cast), weight-only
    int8 linear layers and lm_head; explicit choices still win."""
    from pagedllm.kernels import library
    from pagedllm.platforms import cpu

    monkeypatch.setattr(library, "active_isa", lambda: None)
    assert cpu.dtype_settings("auto") == {
        "dtype": torch.float32, "kv_cache_dtype": None, "quantization": "int8", "quantize_lm_head": True
    }
    assert cpu.dtype_settings("auto", "float32")["kv_cache_dtype"] == torch.float32
    assert cpu.dtype_settings("auto", quantization="none") == {
        "dtype": torch.float32, "kv_cache_dtype": None, "quantization": "none"
    }
    assert cpu.dtype_settings("float32")["dtype"] == torch.float32

