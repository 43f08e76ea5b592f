"""Quantized GGUF files loaded: a tiny llama's 4- and 8-bit blocks kept (q/k rows unpermuted,
projections fused) equal to the float loader's weights and loaded in int4 and int8 modes;
``--dtype auto`` running a file's 4-bit blocks at 4 bits and, on a tiny Qwen2 of K-quant
blocks, every linear layer from the file's own bytes, sharded on whole super-blocks."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.kernels import kquant, library
from pagedllm.layers.quantization.linear import (
    Int4Linear,
    Int8BlockLinear,
    Int8Linear,
    QuantizedLinear,
    W4A8Linear,
    W8A8Linear,
)
from pagedllm.layers.quantization.weights import Int4Weight
from pagedllm.models import gguf_file
from pagedllm.models.gguf_file import GGUFFile
from pagedllm.models.gguf_linears import gguf_linears
from pagedllm.models.gguf_loader import gguf_config
from pagedllm.models.loader import load_model, resolve_model
from pagedllm.models.native_decoder import NativeDecoder
from pagedllm.quantization_config import QuantizationConfig
from tests.models_util import prefill_logits, write_gguf
from tests.utils import assert_holds_blocks, random_gguf_blocks


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
