"""The one-call decoder (``models/native_decoder.py``, ``csrc/decoder.cpp``): every step of
llama, qwen2, qwen3 and gemma3 models (sliding windows, several KV cache groups), prefills,
decodes beside a prefill chunk at an offset and beside a two-token request, gives the modules'
logits bit for bit, on every ISA this CPU runs, for each linear kind (packed float32, w8a8,
w4a8, GGUF blocks as stored) and K/V cache dtype; models it does not cover run the modules."""

from __future__ import annotations

import ctypes

import gguf
import pytest
import torch
import transformers

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import SINGLE
from pagedllm.kernels import abi, decoder, library
from pagedllm.kernels import linear as kernels
from pagedllm.quantization_config import QuantizationConfig
from pagedllm.layers.quantization.linear import KQuantLinear
from pagedllm.layers.quantization.model import quantize_model
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models import native_decoder
from pagedllm.models.loader import set_key_scales
from pagedllm.models.native_decoder import NativeDecoder
from tests.models_util import (
    GEMMA3_WINDOW, gemma3_config, randomize_vectors, stored_weights, tiny_gemma3, tiny_llama, write_gguf, write_q4_gguf,
)
from tests.native_isa import ISAS, on_isa
from tests.tensor_parallel_ranks import SEQ_LENS, STEPS, Case, load, run_steps

Q = gguf.GGMLQuantizationType
# A Q4_K_M-like llama: every projection a GGUF block format the K-quant GEMM reads as stored,
# fused q/k/v and gate/up of mixed formats.
_KQUANT_TYPES = {
    f"model.layers.{i}.{name}.weight": qtype for i, types in enumerate([
        (Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q4_K, Q.Q5_K, Q.Q6_K),
        (Q.Q5_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q8_0, Q.Q8_0, Q.Q4_K),
    ]) for name, qtype in zip(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj"), types, strict=True,
    )
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    """Head size 64 (the decode kernel's smallest): qwen2 with q/k/v bias and 3 query heads
    per KV head; qwen3 with q/k head norms and head_dim 64 of hidden 128 / 4 heads; a 4-bit GGUF
    llama (its blocks kept by w4a8, as ``--dtype auto`` does: Q4_1's, and in the MLP Q4_0's on
    their symmetric tile) and a K-quant one (its blocks run
    as stored); gemma3 with 6 query heads on 1 KV head, sliding windows shorter than the requests."""
    root = tmp_path_factory.mktemp("native-decoder")
    torch.manual_seed(0)
    qwen2_config = transformers.Qwen2Config(
        vocab_size=253, hidden_size=384, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=256, rope_theta=1e6,
        rms_norm_eps=1e-6,
    )
    qwen2 = transformers.Qwen2ForCausalLM(qwen2_config).eval()
    randomize_vectors(qwen2, qwen2_config.hidden_size)
    qwen2.save_pretrained(root / "qwen2")
    qwen3_config = transformers.Qwen3Config(
        vocab_size=251, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, max_position_embeddings=256,
        rope_theta=1e6, rms_norm_eps=1e-6,
    )
    qwen3 = transformers.Qwen3ForCausalLM(qwen3_config).eval()
    randomize_vectors(qwen3, qwen3_config.hidden_size)
    qwen3.save_pretrained(root / "qwen3")
    llama = tiny_llama(
        vocab_size=250, hidden_size=256, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )
    # The MLP's blocks Q4_0 (w4a8's symmetric tile), attention's Q4_1 (the general one).
    write_q4_gguf(root / "llama-q4.gguf", llama, q4_0=("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"))
    llama_kquant = tiny_llama(
        vocab_size=250, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )
    write_gguf(root / "llama-kquant.gguf", llama_kquant, blocks=stored_weights(llama_kquant, _KQUANT_TYPES))
    gemma = tiny_gemma3(vocab_size=131, hidden_size=96, intermediate_size=192, num_attention_heads=6,
                        final_logit_softcapping=1.0)
    torch.save((_our_config_of(gemma), gemma.state_dict()), root / "gemma3.pt")
    return {
        "qwen2-float32": Case("qwen2-float32", str(root / "qwen2")),
        "qwen2-w8a8": Case("qwen2-w8a8", str(root / "qwen2"), ("w8a8", 32, True)),
        "qwen3-float32": Case("qwen3-float32", str(root / "qwen3")),
        "llama-q4-w4a8": Case("llama-q4-w4a8", str(root / "llama-q4.gguf"), ("w4a8", 32, True, False)),
        "llama-kquant": Case("llama-kquant", str(root / "llama-kquant.gguf"), ("w4a8", 32, True, False)),
        "gemma3-float32": Case("gemma3-float32", state=str(root / "gemma3.pt")),
        "gemma3-w8a8": Case("gemma3-w8a8", state=str(root / "gemma3.pt"), quant=("w8a8", 32, True)),
    }


def _our_config_of(hf: torch.nn.Module) -> ModelConfig:
    config = gemma3_config(hf.config)
    assert 0 < config.sliding_window == GEMMA3_WINDOW < max(SEQ_LENS)
    return config


def _load(case: Case) -> tuple[torch.nn.Module, ModelConfig]:
    """``load``'s model, and a quantized Gemma 3 (``load`` packs its state as float32)."""
    if not (case.state and case.quant):
        return load(case, SINGLE)
    config, state = torch.load(case.state, weights_only=False)
    model = Gemma3ForCausalLM(config, torch.float32)
    model.load_weights(state.items())
    set_key_scales(model)
    quantize_model(model, QuantizationConfig(*case.quant), torch.float32)
    return model.eval(), config


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize(
    "name",
    ["qwen2-float32", "qwen2-w8a8", "qwen3-float32", "llama-q4-w4a8", "llama-kquant", "gemma3-float32", "gemma3-w8a8"],
)
@pytest.mark.parametrize("isa", ISAS)
def test_one_call_equals_the_modules(cases, isa: str, name: str, kv_dtype: torch.dtype, monkeypatch) -> None:
    with on_isa(isa):
        model, config = _load(cases[name])
        assert NativeDecoder.of(model) is not None
        # The int8 cache's key scales, from float rows or (llama-kquant) dequantized blocks.
        scaled = [layer.self_attn.qk_scale_for(kv_dtype) is not None for layer in model.layers]
        assert all(scaled) == (kv_dtype == torch.int8)
        if name == "llama-kquant":  # every projection from the file's blocks
            layers = [layer.self_attn.qkv_proj for layer in model.layers] + [layer.mlp.down_proj for layer in model.layers]
            assert all(isinstance(m, KQuantLinear) for m in layers)
        if name == "llama-q4-w4a8":  # Q4_0's MLP on the symmetric tile, Q4_1's attention on the general one
            assert all(layer.mlp.down_proj.symmetric and not layer.self_attn.qkv_proj.symmetric for layer in model.layers)
        calls = []
        decode_layers = decoder.decode_layers
        monkeypatch.setattr(native_decoder, "decode_layers", lambda *a: calls.append(out := decode_layers(*a)) or out)
        got = run_steps(model, config, SINGLE, kv_dtype)
        assert len(calls) == len(STEPS) and all(c is not None for c in calls)
        model.native_decoder = False
        expected = run_steps(model, config, SINGLE, kv_dtype)
        assert len(calls) == len(STEPS)
    assert torch.equal(got, expected)


# One step of three 180-token prompts (540 rows: the MLP in two passes, csrc/decoder.cpp's
# kMlpRows), then a decode of each.
_LONG_SEQ_LENS = (181, 181, 181)
_LONG_STEPS = [[(r, 0, 180) for r in range(3)], [(r, 180, 181) for r in range(3)]]


@pytest.mark.parametrize("name", ["qwen2-w8a8", "llama-q4-w4a8", "llama-kquant", "gemma3-float32"])
@pytest.mark.parametrize("isa", ISAS)
def test_a_long_step_equals_the_modules(cases, isa: str, name: str, monkeypatch) -> None:
    """A step of more rows than one MLP pass takes gives the modules' logits bit for bit (each
    GEMM's rows computed as in one call over the step)."""
    with on_isa(isa):
        model, config = _load(cases[name])
        calls = []
        decode_layers = decoder.decode_layers
        monkeypatch.setattr(native_decoder, "decode_layers", lambda *a: calls.append(out := decode_layers(*a)) or out)
        got = run_steps(model, config, SINGLE, torch.float32, _LONG_SEQ_LENS, _LONG_STEPS)
        assert len(calls) == 2 and all(c is not None for c in calls)
        model.native_decoder = False
        expected = run_steps(model, config, SINGLE, torch.float32, _LONG_SEQ_LENS, _LONG_STEPS)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("name", ["llama-q4-w4a8", "qwen2-w8a8", "llama-kquant"])
def test_prompt_rows_take_the_prompt_kernel(cases, name: str, native: bool) -> None:
    """Where the int8 layers have a prompt kernel (AMX's bfloat16 tiles), the one-call step and
    the modules run a step's prompt rows on it: switched off, a prefill step's logits change
    (that they agree with each other: ``test_one_call_equals_the_modules``)."""
    if not library.available() or not kernels.amx_tiles():
        pytest.skip("no prompt kernel here (AMX-BF16)")
    model, config = _load(cases[name])
    if not native:
        model.native_decoder = False
    on = run_steps(model, config, SINGLE, steps=STEPS[:1])
    try:
        kernels.amx_tiles(False)
        off = run_steps(model, config, SINGLE, steps=STEPS[:1])
    finally:
        kernels.amx_tiles(True)
    assert not torch.equal(on, off)


def test_models_it_does_not_cover_run_the_modules(cases, monkeypatch) -> None:
    """No native kernels (nn.Linear weights), or a dtype other than float32: no one-call decoder."""
    monkeypatch.setattr(library, "available", lambda: False)
    model, _ = load(cases["qwen2-float32"], SINGLE)
    assert NativeDecoder.of(model) is None
    monkeypatch.undo()
    if not library.available():
        pytest.skip("no native kernels here")
    model, _ = load(cases["qwen2-float32"], SINGLE)
    model.dtype = torch.bfloat16
    assert NativeDecoder.of(model) is None


def test_descriptor_refuses_a_packing_of_another_shape() -> None:
    if not library.available():
        pytest.skip("no native kernels here")
    packed = kernels.linear_pack_f32(torch.randn(40, 64))
    assert kernels.linear_desc(kernels.LINEAR_F32, packed, None, 40, 64).n == 40
    with pytest.raises(ValueError, match="packed weight"):
        kernels.linear_desc(kernels.LINEAR_F32, packed, None, 40, 96)
    w8a8 = kernels.linear_pack_w8a8(torch.randn(40, 64))
    assert kernels.linear_desc(kernels.LINEAR_W8A8, w8a8, None, 40, 64).kind == kernels.LINEAR_W8A8
    with pytest.raises(ValueError, match="w8a8 scales"):
        kernels.linear_desc(kernels.LINEAR_W8A8, (w8a8[0], w8a8[1][:-1]), None, 40, 64)
    with pytest.raises(ValueError, match="unknown linear kind"):
        kernels.linear_desc(7, packed, None, 40, 64)


def test_profile_times_every_part_and_changes_nothing(cases) -> None:
    """``DecoderDesc.profile`` (``bench step``): the same logits, each dense part's time counted;
    the team's job counter and hand-off probe answer."""
    if not library.available():
        pytest.skip("no native kernels here")
    model, config = _load(cases["qwen2-float32"])
    expected = run_steps(model, config, SINGLE)
    profile = (ctypes.c_int64 * abi.CONSTANTS["PAGEDLLM_PROFILE_PARTS"])()
    model.native_decoder.desc.profile = ctypes.addressof(profile)
    lib = library.native_library()
    jobs = lib.team_jobs()
    assert torch.equal(run_steps(model, config, SINGLE), expected)
    assert all(profile[part] > 0 for part in range(9)) and profile[9] == 0  # no MoE block
    assert lib.team_jobs() >= jobs and lib.probe_team_handoff(5) == 5
