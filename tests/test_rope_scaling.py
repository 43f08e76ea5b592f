"""RoPE scaling against transformers: tiny random Llama, Qwen2 and Phi-3 checkpoints (and GGUF
files as llama.cpp's converter writes them) with linear, llama3, yarn, longrope and dynamic
RoPE, our float32 logits and greedy tokens against transformers'; the types still refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.models.loader import load_config, load_model, resolve_model
from tests.models_util import (
    DENSE_COMMON, assert_greedy_matches, edit_config, prefill_logits, randomize_vectors, save_checkpoint,
    shared_prefix_prompts, write_gguf,
)

MAX_TOKENS = 16



@pytest.fixture
def plain_dir(tmp_path: Path, tokenizer_dir: Path) -> Path:
    """A plain-RoPE tiny Llama checkpoint, its config.json for the test to edit."""
    save_checkpoint(_rope_model("llama", None, 256), tmp_path, tokenizer_dir)
    return tmp_path


# --- linear, llama3 and yarn: computed once, as transformers computes them -------------------

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
    common = DENSE_COMMON | {"max_position_embeddings": max_positions}
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
    save_checkpoint(hf, path, tokenizer_dir)
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


def test_rope_scaling_in_the_old_rope_scaling_field(plain_dir: Path) -> None:
    """Configs written before transformers 5 (Llama 3.1's, Qwen2.5's): ``rope_theta`` and a
    ``rope_scaling`` with ``type`` or ``rope_type``; yarn's original length from
    ``max_position_embeddings`` when left out, as transformers reads it."""
    old = {k: v for k, v in json.loads((plain_dir / "config.json").read_text()).items() if k != "rope_parameters"}
    cases = [
        ({"type": "yarn", "factor": 4.0},
         {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}, None),
    ]
    for rope_scaling, expected in cases:
        (plain_dir / "config.json").write_text(json.dumps(old | {"rope_theta": 1e4, "rope_scaling": rope_scaling}))
        config = load_config(resolve_model(str(plain_dir)))
        assert config.rope_scaling == (expected or rope_scaling) and config.rope_theta == 1e4
    assert config.max_position_embeddings == 256  # llama3: the config's own


def test_rope_parameters_read_as_transformers_reads_them(plain_dir: Path) -> None:
    """A config.json with both fields (a ``rope_scaling`` added to a transformers 5 file, as
    Qwen2.5's long-context instructions say): rope_scaling wins, as transformers'
    ``convert_rope_params_to_dict`` (it was silently ignored: plain RoPE); the parameters' own
    ``rope_theta`` over a top-level one; a top-level ``original_max_position_embeddings`` read
    for Phi-3 alone (transformers ignores it elsewhere)."""
    old = {k: v for k, v in json.loads((plain_dir / "config.json").read_text()).items()
           if k not in ("rope_parameters", "rope_theta")}
    cases = [
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_theta": 1e4},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "original_max_position_embeddings": 16},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": None},
    ]
    for fields in cases:
        (plain_dir / "config.json").write_text(json.dumps(old | fields))
        expected = dict(transformers.AutoConfig.from_pretrained(plain_dir).rope_parameters)
        config = load_config(resolve_model(str(plain_dir)))
        assert config.rope_theta == expected.pop("rope_theta"), fields
        assert config.rope_scaling == ({} if expected["rope_type"] == "default" else expected), fields


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "proportional", "factor": 2.0},
         r"RoPE scaling 'proportional' is not supported \(supported: linear, llama3, yarn, longrope, dynamic\)"),
        ({"rope_type": "longrope", "long_factor": [2.0] * 16}, "RoPE scaling 'longrope' needs short_factor"),
        ({"rope_type": "llama3", "factor": 8.0}, "RoPE scaling 'llama3' needs low_freq_factor, high_freq_factor"),
    ],
)
def test_rope_scaling_it_does_not_compute_is_refused(rope, message, plain_dir: Path) -> None:
    edit_config(plain_dir, rope_parameters={"rope_theta": 1e4} | rope)
    with pytest.raises(ValueError, match=message):
        load_config(resolve_model(str(plain_dir)))


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
        ({"rope.scaling.type": "longrope"},
         r"GGUF RoPE scaling 'longrope' is not supported \(supported: rope.scaling.type none, linear or yarn; factor"),
        ({"rope.scaling.type": "dynamic"}, r"GGUF RoPE scaling 'dynamic' is not supported"),
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


# --- longrope and dynamic: fixed at build, where transformers recomputes them per sequence -----

ORIGINAL = 32  # the longrope and dynamic checkpoints' original context
SHORT_PROMPT = ROPE_PROMPT[:24]  # within it
# Phi-3's LongRoPE (head_dim 32: 16 factors): short factors near 1, long ones up to 16.
LONGROPE = {
    "rope_type": "longrope", "rope_theta": 1e4,
    "short_factor": [1.0 + 0.02 * i for i in range(16)], "long_factor": [1.0 + i for i in range(16)],
}
DYNAMIC = {"rope_type": "dynamic", "factor": 4.0}  # 32 positions extended to 128
DYNAMIC_PROMPT = ROPE_PROMPT[:128]  # the whole scaled context


@pytest.fixture(scope="module")
def longrope_tiny(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """(HF Phi-3 with LongRoPE, 256 positions of an original 32; its checkpoint directory)."""
    path = tmp_path_factory.mktemp("longrope")
    config = transformers.Phi3Config(
        **DENSE_COMMON, original_max_position_embeddings=ORIGINAL, rope_parameters=LONGROPE, sliding_window=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(config).eval()
    randomize_vectors(hf)
    save_checkpoint(hf, path, tokenizer_dir)
    return hf, path


def test_longrope_logits_match_transformers_by_max_model_len(longrope_tiny) -> None:
    """max_model_len within the original 32 positions: the short factors, transformers' logits
    for a prompt within them. Past it (256, the model's context, load_model's default): the
    long factors at every position, transformers' logits for a 150-token prompt, and for a
    short prompt its rows of that long one (transformers alone would rotate the short prompt
    by the short factors)."""
    hf, path = longrope_tiny
    with torch.inference_mode():
        short = hf(torch.tensor([SHORT_PROMPT])).logits[0]
        long = hf(torch.tensor([ROPE_PROMPT])).logits[0]
    model, config = load_model(resolve_model(str(path)), torch.float32, max_model_len=ORIGINAL)
    assert config.rope_scaling["rope_type"] == "longrope" and config.max_position_embeddings == 256
    torch.testing.assert_close(prefill_logits(model, config, SHORT_PROMPT), short, atol=1e-4, rtol=0)
    model, config = load_model(resolve_model(str(path)), torch.float32)
    torch.testing.assert_close(prefill_logits(model, config, ROPE_PROMPT), long, atol=1e-4, rtol=0)
    n = len(SHORT_PROMPT)
    torch.testing.assert_close(prefill_logits(model, config, SHORT_PROMPT), long[:n], atol=1e-4, rtol=0)
    assert (short - long[:n]).abs().mean() > 0.1 * short.abs().mean()  # the two factor sets differ


@pytest.mark.parametrize(("max_model_len", "prompt"), [(ORIGINAL, SHORT_PROMPT[:16]), (256, ROPE_PROMPT)])
def test_longrope_greedy_matches_transformers(longrope_tiny, max_model_len: int, prompt: list[int]) -> None:
    """Served by ``LLM`` (chunked prefill, decode): transformers' tokens, by the short factors
    where max_model_len is the original 32 (the sequence never passes it), by the long ones past it."""
    hf, path = longrope_tiny
    llm = LLM(
        model=str(path), dtype="float32", kv_cache_memory="8MiB", max_model_len=max_model_len,
        max_num_batched_tokens=64,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert_greedy_matches(hf, prompt, out.outputs[0], MAX_TOKENS)
    llm.shutdown()


def test_longrope_gguf_as_llama_cpp_writes_it_matches_transformers(longrope_tiny, tmp_path: Path) -> None:
    """llama.cpp's converter writes Phi-3's LongRoPE as ``rope_factors_long`` / ``_short``
    tensors with the original context and the attention factor: the same logits."""
    hf, _ = longrope_tiny
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf)
    model, config = load_model(resolve_model(str(path)), torch.float32)
    assert config.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    assert config.rope_scaling["long_factor"] == LONGROPE["long_factor"]
    with torch.inference_mode():
        expected = hf(torch.tensor([ROPE_PROMPT])).logits[0]
    torch.testing.assert_close(prefill_logits(model, config, ROPE_PROMPT), expected, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def dynamic_tiny(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """(HF Llama with dynamic NTK RoPE, 32 positions extended by 4; its checkpoint directory)."""
    path = tmp_path_factory.mktemp("dynamic")
    hf = _rope_model("llama", DYNAMIC, ORIGINAL)
    save_checkpoint(hf, path, tokenizer_dir)
    return hf, path


def test_dynamic_logits_match_transformers_at_the_scaled_context(dynamic_tiny) -> None:
    """vLLM's fixed base is transformers' for a sequence of the whole scaled context (32 x 4
    = 128 positions, the context served): its logits for a 128-token prompt (far from plain
    RoPE's)."""
    hf, path = dynamic_tiny
    model, config = load_model(resolve_model(str(path)), torch.float32)
    assert config.rope_scaling == DYNAMIC | {"original_max_position_embeddings": ORIGINAL}
    assert config.max_position_embeddings == 128
    with torch.inference_mode():
        ids = torch.tensor([DYNAMIC_PROMPT])
        expected = hf(ids).logits[0]
        plain = _rope_model("llama", None, 128)(ids).logits[0]
    torch.testing.assert_close(prefill_logits(model, config, DYNAMIC_PROMPT), expected, atol=1e-4, rtol=0)
    assert (plain - expected)[ORIGINAL:].abs().mean() > 0.1 * expected.abs().mean()


def test_dynamic_greedy_matches_transformers_once_it_has_seen_the_scaled_context(dynamic_tiny) -> None:
    """transformers grows its base with the sequence and keeps the largest while sequences stay
    past the original 32 positions: once it has run 128 positions, its tokens for a 100-token
    prompt are ours (our base is fixed: a prefix hit or a recomputed request sees the same)."""
    hf, path = dynamic_tiny
    with torch.inference_mode():
        hf(torch.tensor([DYNAMIC_PROMPT]))
    prompt = DYNAMIC_PROMPT[:100]
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="8MiB", max_model_len=128, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert_greedy_matches(hf, prompt, out.outputs[0], MAX_TOKENS)
    llm.shutdown()


def test_rope_scaling_gguf_longrope_needs_both_factor_sets() -> None:
    from types import SimpleNamespace

    from pagedllm.models.gguf_loader import _rope_scaling

    only_long = SimpleNamespace(tensors={"rope_factors_long.weight": None})
    with pytest.raises(ValueError, match=r"rope_factors_long.weight are not supported \(rope_freqs.weight alone, or"):
        _rope_scaling(only_long, lambda key, default=None: default, 32)


def test_longrope_in_phi3_5s_config_fields_read_as_transformers_reads_them(longrope_tiny, tmp_path: Path) -> None:
    """Phi-3.5's config.json: ``rope_scaling`` with ``type`` longrope, ``rope_theta`` and the
    original length at the top level: the rope parameters transformers reads."""
    _, path = longrope_tiny
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    new = json.loads((path / "config.json").read_text())
    factors = {key: LONGROPE[key] for key in ("short_factor", "long_factor")}
    old = {k: v for k, v in new.items() if k != "rope_parameters"} | {
        "rope_theta": 1e4, "original_max_position_embeddings": ORIGINAL, "rope_scaling": {"type": "longrope"} | factors,
    }
    (tmp_path / "config.json").write_text(json.dumps(old))
    expected = dict(transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters)
    config = load_config(resolve_model(str(tmp_path)))
    assert config.rope_theta == expected.pop("rope_theta")
    # Phi3Config adds its partial_rotary_factor (1.0: checked, not kept) and keeps ``type``.
    assert config.rope_scaling == {k: v for k, v in expected.items() if k not in ("type", "partial_rotary_factor")}
    assert config.rope_scaling["original_max_position_embeddings"] == ORIGINAL


def test_longrope_factors_not_one_per_rotated_pair_are_refused() -> None:
    from pagedllm.layers.rotary import rope_frequencies

    rope = LONGROPE | {"original_max_position_embeddings": ORIGINAL, "short_factor": [1.0] * 8}
    with pytest.raises(ValueError, match=r"longrope needs one short_factor and one long_factor per rotated pair \(16\)"):
        rope_frequencies(32, 1e4, 256, rope)
