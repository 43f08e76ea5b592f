"""Qwen3, Mistral and Phi-3 against transformers: tiny random checkpoints built from
transformers' own classes, saved with ``save_pretrained`` next to SmolLM2's tokenizer, served
by ``LLM`` in float32 (chunked prefill, prefix caching) and compared with ``generate``; Qwen3
and Phi-3 also as GGUF files written the way llama.cpp's converter does (RoPE scaling:
test_rope_scaling.py)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.models.loader import load_config, load_model, resolve_model
from tests.models_util import (
    DENSE_COMMON, assert_greedy_through_chunks_and_prefix_hits, edit_config, prefill_logits, randomize_vectors,
    save_checkpoint, shared_prefix_prompts, write_gguf, write_q4_gguf,
)

MAX_TOKENS = 16
WINDOW = 12  # Mistral's: shorter than every prompt
# Prompts as token ids (the tiny vocabulary is SmolLM2's first 256 ids): a short one, two
# longer than Mistral's window that share their first 24 tokens, prefilled in 16-token chunks.
_, PROMPTS = shared_prefix_prompts(7, 24, (5, 9, 17))
# hidden 128 with 4 heads: Qwen3's head_dim 64 is not hidden / heads (and runs the native
# decode kernel, whose smallest head is 64); Mistral and Phi-3 have 32 (the PyTorch fallback).
COMMON = DENSE_COMMON
CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=64, rope_theta=1e6),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=WINDOW, rope_theta=1e4),
    "phi3": lambda: transformers.Phi3Config(**COMMON, sliding_window=None, pad_token_id=0),
}
HF_CLASSES = {
    "qwen3": transformers.Qwen3ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "phi3": transformers.Phi3ForCausalLM,
}



def _checkpoint(arch: str, path: Path, tokenizer_dir: Path, config=None) -> transformers.PreTrainedModel:
    """A random ``arch`` model saved to ``path`` with the tokenizer files; the HF model."""
    torch.manual_seed(0)
    hf = HF_CLASSES[arch](config or CONFIGS[arch]()).eval()
    randomize_vectors(hf)  # q/k norms too: every vector around 1
    save_checkpoint(hf, path, tokenizer_dir)
    return hf


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """(architecture, HF model, checkpoint directory)."""
    path = tmp_path_factory.mktemp(request.param)
    return request.param, _checkpoint(request.param, path, tokenizer_dir), path


def test_config_from_checkpoint(tiny) -> None:
    arch, hf, path = tiny
    config = load_config(resolve_model(str(path)))
    assert config.architecture == arch
    assert config.head_dim == (64 if arch == "qwen3" else 32)
    assert config.qk_norm == (arch == "qwen3") and not config.attention_bias
    assert config.tie_word_embeddings is False
    windows = [config.layer_window(i) for i in range(config.num_layers)]
    assert windows == ([WINDOW, WINDOW] if arch == "mistral" else [0, 0])



def test_greedy_matches_transformers_with_chunks_and_prefix_hits(tiny) -> None:
    """16-token chunks; the third prompt hits the second's cached blocks, and all three again
    hit whole prompts: the same tokens each time."""
    arch, hf, path = tiny
    assert_greedy_through_chunks_and_prefix_hits(path, hf, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_activation_other_than_silu_is_refused(act: str, tmp_path: Path, tokenizer_dir: Path) -> None:
    """The model classes compute SiLU: another ``hidden_act`` is refused, not run as SiLU."""
    _checkpoint("qwen3", tmp_path, tokenizer_dir)
    edit_config(tmp_path, hidden_act=act)
    with pytest.raises(ValueError, match=f"hidden_act='{act}': only silu is supported for qwen3"):
        load_config(resolve_model(str(tmp_path)))


def test_attention_bias_with_an_o_proj_bias_is_refused(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Qwen3's (and Llama's) attention_bias puts a bias on o_proj too, which the model lacks:
    refused by name, not a state-dict error."""
    _checkpoint("qwen3", tmp_path, tokenizer_dir, transformers.Qwen3Config(**COMMON, head_dim=64, attention_bias=True))
    with pytest.raises(ValueError, match=r"attention_bias on qwen3 \(a bias on o_proj as well as q/k/v\)"):
        load_config(resolve_model(str(tmp_path)))


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_gguf_as_llama_cpp_writes_it_matches_transformers(arch: str, tmp_path: Path, tokenizer_dir: Path) -> None:
    """Qwen3's q/k norms under llama.cpp's names; Phi-3's ``attn_qkv`` and ``ffn_up`` (gate and
    up) fused as stored, with its sliding window in the metadata."""
    config = CONFIGS[arch]()
    if arch == "phi3":
        config.sliding_window = WINDOW
    hf = _checkpoint(arch, tmp_path / "hf", tokenizer_dir, config)
    tokens = [f"t{i}" for i in range(250)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|end|>", "x", "y"]
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, tokens)
    model, ours = load_model(resolve_model(str(path)), torch.float32)
    assert (ours.architecture, ours.head_dim, ours.qk_norm) == (arch, 64 if arch == "qwen3" else 32, arch == "qwen3")
    assert [ours.layer_window(i) for i in range(2)] == ([WINDOW] * 2 if arch == "phi3" else [0, 0])
    # Qwen3 also stops on <|im_end|> and <|endoftext|>, Phi-3 on <|end|>.
    assert ours.eos_token_ids == ([2, 252, 250] if arch == "qwen3" else [2, 253, 250])
    ids = PROMPTS[2]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(model, ours, ids), expected, atol=1e-4, rtol=0)


def test_phi3_gguf_4bit_fused_tensors_are_kept_as_stored(tmp_path: Path, tokenizer_dir: Path) -> None:
    """w4a8 keeps Phi-3's fused Q4_1 ``attn_qkv`` / ``ffn_up`` as one layer each at one rank;
    split over ranks (rows not one span), they are left to requantize, the others kept."""
    from pagedllm.distributed.parallel_state import TPGroup
    from pagedllm.quantization_config import QuantizationConfig
    from pagedllm.models.gguf_linears import gguf_linears
    from pagedllm.models.gguf_file import GGUFFile
    from pagedllm.models.gguf_loader import gguf_config

    hf = _checkpoint("phi3", tmp_path / "hf", tokenizer_dir)
    path = tmp_path / "q4.gguf"
    write_q4_gguf(path, hf)
    f = GGUFFile(path)
    linears = gguf_linears(f, gguf_config(f), QuantizationConfig("w4a8", 32, True, False))
    assert linears.sources["layers.0.self_attn.qkv_proj"] == [gguf.GGMLQuantizationType.Q4_1]
    assert {"layers.0.self_attn.qkv_proj", "layers.1.mlp.gate_up_proj"} <= set(linears.kept)
    rank1 = gguf_linears(f, gguf_config(f), QuantizationConfig("w4a8", 32, True, False), TPGroup(1, 2))
    assert not any(name.endswith(("qkv_proj", "gate_up_proj")) for name in rank1.kept)
    assert rank1.kept["layers.0.self_attn.o_proj"].q.shape == (128, 64)  # the rank's 64 of 128 columns
    # Against the same blocks dequantized to float32: only w4a8's int8 activations differ
    # (about 4% of the mean logit on this model, as on a llama of its shape; rows out of
    # place would be of the logits' own size).
    exact, config = load_model(resolve_model(str(path)), torch.float32)
    model, _ = load_model(resolve_model(str(path)), torch.float32, QuantizationConfig("w4a8", 32, True, False))
    expected = prefill_logits(exact, config, PROMPTS[1])
    got = prefill_logits(model, config, PROMPTS[1])
    assert (got - expected).abs().mean() < 0.08 * expected.abs().mean()


def test_generation_config_sampling_defaults(tmp_path: Path, tokenizer_dir: Path, caplog) -> None:
    """The model creator's sampling defaults in generation_config.json (Qwen's temperature 0.7,
    top_p 0.8, ...) are what ``generate`` samples with when given no params, as vLLM's
    ``--generation-config auto`` (they were ignored: SamplingParams()'s temperature 1.0 ran);
    a stated value equal to transformers' old default (temperature 1.0, top_p 1.0) is read as
    vLLM reads it (it was dropped, so a --generation-config folder stating temperature 1.0 over
    a checkpoint's 0.7 changed nothing); an invalid value is dropped with a warning, not a
    failure of every request."""
    from pagedllm.models.safetensors_loader import sampling_defaults

    assert sampling_defaults({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                              "do_sample": True}) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                      "repetition_penalty": 1.05}
    assert sampling_defaults({"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None}) == {
        "temperature": 1.0, "top_p": 1.0, "top_k": 50}
    assert sampling_defaults({"max_new_tokens": 64, "max_length": 20}) == {"max_tokens": 64}  # vLLM's cap
    with caplog.at_level("WARNING", logger="pagedllm"):
        assert sampling_defaults({"temperature": 5.0, "top_k": "x", "min_p": 0.1, "max_new_tokens": 0}) == {"min_p": 0.1}
    assert "temperature=5.0 is not a valid default" in caplog.text and "top_k='x'" in caplog.text
    assert "max_new_tokens=0" in caplog.text
    _checkpoint("qwen3", tmp_path, tokenizer_dir)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps(generation | {"temperature": 0.0, "top_k": 5}))
    assert load_config(resolve_model(str(tmp_path))).sampling_defaults == {"temperature": 0.0, "top_k": 5}
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="8MiB", max_model_len=128)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.top_p, default.max_tokens) == (0.0, 5, 1.0, 16)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    for _ in range(2):  # temperature 0: the same greedy tokens every time
        unset = llm.generate(PROMPTS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in unset] == [o.outputs[0].token_ids for o in greedy]
    llm.shutdown()
    # vLLM's --generation-config vllm: SamplingParams' own defaults.
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="8MiB", max_model_len=128, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    llm.shutdown()
    # A folder: its generation_config.json's recommendations, whatever the checkpoint's.
    folder = tmp_path / "sampling"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_p": 0.9, "max_new_tokens": 9}))
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="8MiB", max_model_len=128,
              generation_config=str(folder))
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.top_p, default.max_tokens) == (0.3, 0, 0.9, 9)
    llm.shutdown()
    for bad in ("hf", str(tmp_path / "nowhere")):
        with pytest.raises(ValueError, match="generation_config must be auto, vllm or a folder holding a generation_config.json"):
            LLM(model=str(tmp_path), generation_config=bad)
