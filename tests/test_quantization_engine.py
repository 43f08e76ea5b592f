"""The engine end to end in each quantization mode on the default model, bad flags and group
sizes refused, and the command line's and the benchmarks' ``--quantize-lm-head`` left out
where the dtype decides it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.kernels import library
from pagedllm.layers.linear import PackedLinear
from pagedllm.layers.quantization.linear import (
    Int4Linear,
    Int8BlockLinear,
    Q8A8Linear,
    QuantizedLinear,
    W4A8Linear,
    W8A8Linear,
)
from pagedllm.platforms.cpu import auto_linears


# --- the engine -------------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.mark.parametrize(
    ("kwargs", "layer"),
    [
        ({"quantization": "none"}, PackedLinear if library.available() else torch.nn.Linear),
        ({"quantization": "int8"}, Int4Linear),  # SmolLM2's Q4_1 blocks are kept in int8 mode too
        ({"quantization": "int4"}, Int4Linear),
        ({"quantization": "int8", "quantize_lm_head": True}, Int4Linear),
        ({"quantization": "int4", "quantization_group_size": 64, "quantize_lm_head": True}, Int4Linear),
        ({"quantization": "w8a8"}, W8A8Linear),
        ({"quantization": "w4a8", "quantize_lm_head": True}, W4A8Linear),  # Q4_1 kept; the lm_head w8a8
        # dtype auto: w4a8 (SmolLM2's linears are Q4_1 blocks) or w8a8 by ISA, the lm_head w8a8;
        # float32 linear layers without the integer GEMMs
        ({}, {"w4a8": W4A8Linear, "w8a8": W8A8Linear}.get(auto_linears(), PackedLinear if library.available() else torch.nn.Linear)),
        ({"quantization": "int4", "dtype": "bfloat16"}, Int4Linear),  # bfloat16 activations reach the kernel as views
    ],
)
def test_engine_end_to_end(kwargs: dict, layer: type) -> None:
    llm = LLM(kv_cache_memory="64MiB", max_model_len=256, **kwargs)
    model = llm.engine.core.executor.runner.model
    assert type(model.layers[0].mlp.gate_up_proj) is layer
    if kwargs.get("quantization") == "w4a8":
        assert type(model.lm_head) is W8A8Linear
    if not kwargs and auto_linears() != "float32":  # SmolLM2's tied Q8_0 embedding, as stored, on w8a8's panels
        assert type(model.lm_head) is Q8A8Linear
    if kwargs.get("quantize_lm_head") and kwargs["quantization"] != "w4a8":  # SmolLM2's tied Q8_0 embedding: kept in int8, requantized in int4
        assert type(model.lm_head) is (Int8BlockLinear if kwargs["quantization"] == "int8" else Int4Linear)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, logprobs=1), use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 8 and completion.text.strip()
        assert all(np.isfinite(lp[t].logprob) for lp, t in zip(completion.logprobs, completion.token_ids))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quantization": "int3"}, "quantization must be one of none, int8, int4, w8a8, w4a8, got 'int3'"),
        ({"quantization": "int4", "quantization_group_size": 48}, "quantization_group_size must be one of 32, 64, 128"),
        ({"quantization_group_size": 16}, "quantization_group_size must be one of"),
        ({"quantization": "none", "quantize_lm_head": True}, "quantize_lm_head needs quantization int8, int4, w8a8 or w4a8"),
    ],
)
def test_bad_flags_raise(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_group_size_not_dividing_the_model_raises() -> None:
    """SmolLM2's hidden size 576 is not a multiple of 128."""
    with pytest.raises(ValueError, match="128 does not divide the input dimension 576 .* fit this model: 32, 64"):
        LLM(quantization="int4", quantization_group_size=128, kv_cache_memory="64MiB")


def test_cli_flags_reach_the_engine_config() -> None:
    import argparse

    from pagedllm.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--quantization", "int4", "--quantization-group-size", "64", "--quantize-lm-head"])
    kwargs = EngineArgs.from_cli_args(args).kwargs()
    assert (kwargs["quantization"], kwargs["quantization_group_size"], kwargs["quantize_lm_head"]) == ("int4", 64, True)


def test_commands_without_the_flag_keep_autos_quantized_lm_head() -> None:
    """``pagedllm generate`` / ``chat`` / ``bench`` build ``LLM(**EngineArgs(...).kwargs())``,
    and a keyword given to LLM wins over what the dtype implies: an absent
    ``--quantize-lm-head`` once reached it as False and ran auto's lm_head in float32 (Gemma 3
    270M's 262,144 x 640: 20 ms of a 26 ms batch-1 step instead of 6). Absent, it is left out."""
    import argparse

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.platforms.cpu import dtype_settings

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    kwargs = EngineArgs.from_cli_args(parser.parse_args([])).kwargs()
    assert "quantize_lm_head" not in kwargs
    if library.available():
        assert (dtype_settings("auto") | kwargs)["quantize_lm_head"] is True  # as LLM merges them
        llm = LLM(**kwargs | {"kv_cache_memory": "64MiB"})
        try:
            assert isinstance(llm.engine.core.executor.runner.model.lm_head, QuantizedLinear)
        finally:
            llm.shutdown()


def test_bench_quant_and_perplexity_auto_runs_keep_autos_quantized_lm_head() -> None:
    """``pagedllm bench quant``'s ``auto`` mode passed ``quantize_lm_head=False`` and ``bench
    perplexity`` without ``--quantize-lm-head`` passed False too: both ran auto's lm_head in
    float32, not as ``LLM(model)`` runs it. Where the dtype decides, the keyword is left out;
    given, it is passed (never with mode none)."""
    from pagedllm.bench import perplexity as perplexity_bench
    from pagedllm.bench import quant as quant_bench
    from pagedllm.platforms.cpu import dtype_settings

    auto = quant_bench.mode_kwargs("auto")
    assert "quantize_lm_head" not in auto and "quantize_lm_head" not in perplexity_bench.mode_kwargs(None, None)
    assert quant_bench.mode_kwargs("w8a8+lm_head")["quantize_lm_head"] is True
    assert quant_bench.mode_kwargs("w8a8")["quantize_lm_head"] is False
    assert perplexity_bench.mode_kwargs("int8", True)["quantize_lm_head"] is True
    assert perplexity_bench.mode_kwargs("none", True)["quantize_lm_head"] is False
    if library.available():
        settings = dtype_settings("auto", "auto", None)
        assert (settings | auto)["quantize_lm_head"] is True  # as LLM merges them
        assert (settings | perplexity_bench.mode_kwargs(None, None))["quantize_lm_head"] is True

