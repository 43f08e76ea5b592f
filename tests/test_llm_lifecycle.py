"""An ``LLM``'s construction and end as vLLM's: ``seed=None`` is vLLM V1's default seed 0, and
an ``LLM`` used after ``shutdown`` (or after its ``with`` block) says so, instead of an
AttributeError from deep in the executor ('NoneType' object has no attribute 'execute'), and
leaves no request behind."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig


def test_seed_none_is_vllms_default_seed() -> None:
    """``LLM(seed=None)`` is valid vLLM (its V1 default, 0); it was refused as not an integer."""
    assert EngineConfig(seed=None).seed == 0 == EngineConfig().seed
    with pytest.raises(ValueError, match="seed must be an integer"):
        EngineConfig(seed="0")


def test_generate_after_shutdown_says_the_engine_is_shut_down() -> None:
    with LLM(dtype="float32", kv_cache_memory="16MiB", max_model_len=128) as llm:
        assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    for _ in range(2):  # refused each time: nothing left queued by the first
        with pytest.raises(RuntimeError, match="the engine is shut down"):
            llm.generate(["Hi", "Yo"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    llm.shutdown()  # still idempotent
