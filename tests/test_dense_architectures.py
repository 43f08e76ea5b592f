"""Qwen3, Mistral and Phi-3 against transformers: tiny random checkpoints built from
transformers' own classes, saved with ``save_pretrained`` next to SmolLM2's tokenizer, served
by ``LLM`` in float32 (chunked prefill, prefix caching) and compared with ``generate``; Qwen3
and Phi-3 also as GGUF files written the way llama.cpp's converter does. RoPE scaling (linear,
llama3, yarn) on Llama and Qwen2 checkpoints against transformers too."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.models.loader import load_config, load_model, load_tokenizer, resolve_model
from tests.models_util import (
    assert_greedy_matches, prefill_logits, randomize_vectors, shared_prefix_prompts, write_gguf, write_q4_gguf,
)
from tests.utils import pool_is_whole

MAX_TOKENS = 16
WINDOW = 12  # Mistral's: shorter than every prompt
# Prompts as token ids (the tiny vocabulary is SmolLM2's first 256 ids): a short one, two
# longer than Mistral's window that share their first 24 tokens, prefilled in 16-token chunks.
_, PROMPTS = shared_prefix_prompts(7, 24, (5, 9, 17))
# hidden 128 with 4 heads: Qwen3's head_dim 64 is not hidden / heads (and runs the native
# decode kernel, whose smallest head is 64); Mistral and Phi-3 have 32 (the PyTorch fallback).
COMMON = dict(
    vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)
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


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(resolve_model("smollm2")).save_pretrained(path)
    return path


def _checkpoint(arch: str, path: Path, tokenizer_dir: Path, config=None) -> transformers.PreTrainedModel:
    """A random ``arch`` model saved to ``path`` with the tokenizer files; the HF model."""
    torch.manual_seed(0)
    hf = HF_CLASSES[arch](config or CONFIGS[arch]()).eval()
    randomize_vectors(hf)  # q/k norms too: every vector around 1
    hf.save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
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
    llm = LLM(
        model=str(path), dtype="float32", kv_cache_memory="8MiB", max_model_len=128, block_size=8,
        max_num_batched_tokens=16, enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    first = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    hits = llm.engine.core.kv_cache.prefix_hits
    first += llm.generate(PROMPTS[2:], params, use_tqdm=False)
    assert llm.engine.core.kv_cache.prefix_hits - hits >= 16  # the shared 24 tokens' full blocks
    for prompt, out in zip(PROMPTS, first, strict=True):
        assert_greedy_matches(hf, prompt, out.outputs[0], MAX_TOKENS)
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert pool_is_whole(llm)
    llm.shutdown()


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        config[key] = value
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial rotary"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 16,
                              "long_factor": [2.0] * 16, "original_max_position_embeddings": 128}},
         "'longrope' is not supported"),
    ],
)
def test_phi3_features_it_does_not_compute_are_refused(changes, message, tmp_path, tokenizer_dir) -> None:
    _checkpoint("phi3", tmp_path, tokenizer_dir)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        load_config(resolve_model(str(tmp_path)))


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_activation_other_than_silu_is_refused(act: str, tmp_path: Path, tokenizer_dir: Path) -> None:
    """The model classes compute SiLU: another ``hidden_act`` is refused, not run as SiLU."""
    _checkpoint("qwen3", tmp_path, tokenizer_dir)
    _edit_config(tmp_path, hidden_act=act)
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
    transformers' own defaults are no recommendation, and an invalid value is dropped with a
    warning, not a failure of every request."""
    from pagedllm.models.safetensors_loader import sampling_defaults

    assert sampling_defaults({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                              "do_sample": True}) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                      "repetition_penalty": 1.05}
    assert sampling_defaults({"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None}) == {}
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


# --- RoPE scaling: linear, llama3 and yarn as transformers computes them ----------------------

ROPE_PROMPT = shared_prefix_prompts(11, 0, (150, 1, 1))[1][0]  # far past the original 32 positions
# Each config's rope parameters and max_position_embeddings (the original 32 for linear and
# yarn, which vLLM extends by the factor to 256; llama3's configs give the extended length).
ROPE_SCALING = {
    "linear": ({"rope_type": "linear", "factor": 8.0}, 32),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}, 256),
    "yarn": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}, 32),
}
ROPE_CASES = [("linear", "llama"), ("llama3", "llama"), ("yarn", "llama"), ("yarn", "qwen2")]
_ROPE_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


def _rope_model(arch: str, rope: dict | None, max_positions: int) -> transformers.PreTrainedModel:
    """A random ``arch`` model (seed 0) with these rope parameters (None: plain RoPE)."""
    config_cls, model_cls = _ROPE_CLASSES[arch]
    common = COMMON | {"max_position_embeddings": max_positions}
    torch.manual_seed(0)
    hf = model_cls(config_cls(**common, rope_parameters={"rope_theta": 1e4} | (rope or {}))).eval()
    randomize_vectors(hf)
    return hf


@pytest.fixture(scope="module", params=ROPE_CASES, ids=[f"{r}-{a}" for r, a in ROPE_CASES])
def rope_tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """(rope type, HF model, checkpoint directory) of a scaled-RoPE checkpoint."""
    rope_type, arch = request.param
    path = tmp_path_factory.mktemp(f"{rope_type}-{arch}")
    hf = _rope_model(arch, *ROPE_SCALING[rope_type])
    hf.save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    return rope_type, arch, hf, path


def test_rope_scaling_logits_match_transformers(rope_tiny) -> None:
    """150 positions, of an original 32: the scaled RoPE's logits are transformers' (and far
    from plain RoPE's, so the scaling is what is compared)."""
    rope_type, arch, hf, path = rope_tiny
    model, config = load_model(resolve_model(str(path)), torch.float32)
    assert config.rope_scaling["rope_type"] == rope_type
    assert config.max_position_embeddings == 256  # linear and yarn: 32 * 8, as vLLM derives it
    with torch.inference_mode():
        ids = torch.tensor([ROPE_PROMPT])
        expected = hf(ids).logits[0]
        plain = _rope_model(arch, None, 256)(ids).logits[0]
    got = prefill_logits(model, config, ROPE_PROMPT)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert (plain - expected)[32:].abs().mean() > 0.1 * expected.abs().mean()


def test_rope_scaling_greedy_matches_transformers(rope_tiny) -> None:
    """Served by ``LLM`` (chunked prefill, decode past the 150-token prompt): transformers' tokens."""
    _, _, hf, path = rope_tiny
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    out = llm.generate([ROPE_PROMPT], params, use_tqdm=False)[0]
    assert_greedy_matches(hf, ROPE_PROMPT, out.outputs[0], MAX_TOKENS)
    llm.shutdown()


def test_rope_scaling_in_the_old_rope_scaling_field(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Configs written before transformers 5 (Llama 3.1's, Qwen2.5's): ``rope_theta`` and a
    ``rope_scaling`` with ``type`` or ``rope_type``; yarn's original length from
    ``max_position_embeddings`` when left out, as transformers reads it."""
    _checkpoint("qwen3", tmp_path, tokenizer_dir)
    old = {k: v for k, v in json.loads((tmp_path / "config.json").read_text()).items() if k != "rope_parameters"}
    cases = [
        ({"type": "yarn", "factor": 4.0},
         {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}, None),
    ]
    for rope_scaling, expected in cases:
        (tmp_path / "config.json").write_text(json.dumps(old | {"rope_theta": 1e4, "rope_scaling": rope_scaling}))
        config = load_config(resolve_model(str(tmp_path)))
        assert config.rope_scaling == (expected or rope_scaling) and config.rope_theta == 1e4
    assert config.max_position_embeddings == 256  # llama3: the config's own


def test_rope_parameters_read_as_transformers_reads_them(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A config.json with both fields (a ``rope_scaling`` added to a transformers 5 file, as
    Qwen2.5's long-context instructions say): rope_scaling wins, as transformers'
    ``convert_rope_params_to_dict`` (it was silently ignored: plain RoPE); the parameters' own
    ``rope_theta`` over a top-level one; a top-level ``original_max_position_embeddings`` read
    for Phi-3 alone (transformers ignores it elsewhere)."""
    _checkpoint("qwen3", tmp_path, tokenizer_dir)
    old = {k: v for k, v in json.loads((tmp_path / "config.json").read_text()).items()
           if k not in ("rope_parameters", "rope_theta")}
    cases = [
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_theta": 1e4},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "original_max_position_embeddings": 16},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": None},
    ]
    for fields in cases:
        (tmp_path / "config.json").write_text(json.dumps(old | fields))
        expected = dict(transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters)
        config = load_config(resolve_model(str(tmp_path)))
        assert config.rope_theta == expected.pop("rope_theta"), fields
        assert config.rope_scaling == ({} if expected["rope_type"] == "default" else expected), fields


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "dynamic", "factor": 2.0},
         r"RoPE scaling 'dynamic' is not supported \(supported: linear, llama3, yarn\)"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
          "original_max_position_embeddings": 128}, "RoPE scaling 'longrope' is not supported"),
        ({"rope_type": "llama3", "factor": 8.0}, "RoPE scaling 'llama3' needs low_freq_factor, high_freq_factor"),
    ],
)
def test_rope_scaling_it_does_not_compute_is_refused(rope, message, tmp_path: Path, tokenizer_dir: Path) -> None:
    _checkpoint("qwen3", tmp_path, tokenizer_dir)
    _edit_config(tmp_path, rope_parameters={"rope_theta": 1e4} | rope)
    with pytest.raises(ValueError, match=message):
        load_config(resolve_model(str(tmp_path)))


def test_rope_scaling_gguf_as_llama_cpp_writes_it_matches_transformers(rope_tiny, tmp_path: Path) -> None:
    """llama.cpp's converter writes linear and yarn as ``rope.scaling.*`` metadata and Llama
    3.1's llama3 as a ``rope_freqs.weight`` tensor of frequency factors: the same logits."""
    rope_type, _, hf, _ = rope_tiny
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf)
    model, config = load_model(resolve_model(str(path)), torch.float32)
    assert config.rope_scaling["rope_type"] == ("freq_factors" if rope_type == "llama3" else rope_type)
    assert config.max_position_embeddings == 256
    with torch.inference_mode():
        expected = hf(torch.tensor([ROPE_PROMPT])).logits[0]
    torch.testing.assert_close(prefill_logits(model, config, ROPE_PROMPT), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"rope.scaling.type": "longrope"}, r"RoPE scaling 'longrope' is not supported \(supported: linear, llama3"),
        ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.attn_factor": 0.5},
         r"yarn with rope.scaling.attn_factor=0.5 is not supported"),
    ],
)
def test_rope_scaling_gguf_it_does_not_compute_is_refused(metadata, message) -> None:
    from types import SimpleNamespace

    from pagedllm.models.gguf_loader import _rope_scaling

    with pytest.raises(ValueError, match=message):
        _rope_scaling(SimpleNamespace(tensors={}), lambda key, default=None: metadata.get(key, default), 32)


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}, {}),
        ({"rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
        ({"rope.scaling.type": "linear", "rope.scale_linear": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    ],
)
def test_rope_scaling_gguf_type_none_never_scales(metadata, expected) -> None:
    """llama.cpp's rope.scaling.type none leaves RoPE unscaled whatever factor the file gives
    (it was read as linear by that factor); a factor without a type is linear, its default."""
    from types import SimpleNamespace

    from pagedllm.models.gguf_loader import _rope_scaling

    assert _rope_scaling(SimpleNamespace(tensors={}), lambda key, default=None: metadata.get(key, default), 32) == expected
