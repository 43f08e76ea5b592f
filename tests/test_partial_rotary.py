"""Partial rotary embeddings (``ModelConfig.rotary_dim``: RoPE on the leading dims of each head,
the rest passed through) against transformers: tiny random Phi-3 checkpoints with
``partial_rotary_factor`` 0.75 and 0.5, plain and with LongRoPE (Phi-4-mini's kind: one factor
per rotated pair), head_dim 64 so that steps run in the one-call decoder; the same as GGUF
files as llama.cpp's converter writes them (``rope.dimension_count``); the kernel and the int8
cache's key scales over a partial rotation; the factors transformers itself does not compute
refused."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import library
from pagedllm.layers.key_scales import key_scales, qk_factors
from pagedllm.layers.rotary import ApplyRotary, RotaryEmbedding
from pagedllm.models.gguf_loader import gguf_config
from pagedllm.models import native_decoder
from pagedllm.models.loader import load_config, load_model, resolve_model
from pagedllm.models.native_decoder import NativeDecoder
from tests.models_util import (
    DENSE_COMMON, assert_greedy_matches, edit_config, prefill_logits, randomize_vectors, save_checkpoint,
    shared_prefix_prompts, write_gguf,
)

MAX_TOKENS = 16
ORIGINAL = 32  # the LongRoPE checkpoint's original context
PROMPT = shared_prefix_prompts(13, 0, (150, 1, 1))[1][0]  # past it
# Two heads of 64 on one KV head (the one-call decoder's smallest head); Phi-4-mini's 0.75
# rotates 48 of them (24 pairs), 0.5 rotates 32.
SIZES = DENSE_COMMON | {"num_attention_heads": 2, "num_key_value_heads": 1}
CASES = {
    "0.75": (0.75, None),
    "0.5": (0.5, None),
    "0.75-longrope": (0.75, {
        "rope_type": "longrope", "short_factor": [1.0 + 0.02 * i for i in range(24)],
        "long_factor": [1.0 + i for i in range(24)],
    }),
}


def _phi3(factor: float, rope: dict | None) -> transformers.Phi3ForCausalLM:
    """A random Phi-3 (seed 0) rotating ``factor`` of each head, with these rope parameters."""
    config = transformers.Phi3Config(
        **SIZES, sliding_window=None, pad_token_id=0, original_max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": factor} | (rope or {}),
    )
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(config).eval()
    randomize_vectors(hf)
    return hf


def _whole_head(hf: transformers.Phi3ForCausalLM) -> transformers.Phi3ForCausalLM:
    """``hf``'s weights with plain RoPE over the whole head: what ignoring the factor computes."""
    whole = _phi3(1.0, None)
    whole.load_state_dict(hf.state_dict())
    return whole



@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """(case name, HF model, checkpoint directory)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = _phi3(*CASES[request.param])
    save_checkpoint(hf, path, tokenizer_dir)
    return request.param, hf, path


def test_config_from_checkpoint(tiny) -> None:
    name, hf, path = tiny
    factor, rope = CASES[name]
    config = load_config(resolve_model(str(path)))
    assert (config.head_dim, config.rotary_dim) == (64, int(64 * factor))
    assert config.rope_scaling.get("long_factor") == (rope or {}).get("long_factor")


def test_logits_match_transformers_in_one_call_and_in_the_modules(tiny, monkeypatch) -> None:
    """A 150-token prompt through the one-call decoder (where native kernels are) and through
    the modules: transformers' logits, far from those of a whole-head rotation."""
    _, hf, path = tiny
    calls = []
    decode_layers = native_decoder.decode_layers
    monkeypatch.setattr(native_decoder, "decode_layers", lambda *a: calls.append(out := decode_layers(*a)) or out)
    model, config = load_model(resolve_model(str(path)), torch.float32)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        expected = hf(ids).logits[0]
        other = _whole_head(hf)(ids).logits[0]
    got = prefill_logits(model, config, PROMPT)
    assert len(calls) == int(library.available()) and all(c is not None for c in calls)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    model.native_decoder = False
    torch.testing.assert_close(prefill_logits(model, config, PROMPT), expected, atol=1e-4, rtol=0)
    assert (other - expected).abs().mean() > 0.1 * expected.abs().mean()


def test_greedy_matches_transformers(tiny) -> None:
    """Served by ``LLM`` in float32 (chunked prefill, decode steps in the one-call decoder):
    transformers' tokens."""
    _, hf, path = tiny
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    if library.available():
        assert isinstance(llm.engine.core.executor.runner.model.native_decoder, NativeDecoder)
    assert_greedy_matches(hf, PROMPT, out.outputs[0], MAX_TOKENS)
    llm.shutdown()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_default_dtype_follows_transformers(tiny, kv_cache_dtype: str) -> None:
    """The default dtype (w8a8 linear layers in the one-call decoder, a bfloat16 cache; or the
    int8 cache with its key scales over the partial rotation): the prompt's logprobs within a
    tenth of their distance to a whole-head rotation's (measured: 0.12 to 0.18 of 2.3 to 2.4)."""
    _, hf, path = tiny
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
        refs = [m(ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0] for m in (hf, _whole_head(hf))]
    llm = LLM(model=str(path), kv_cache_dtype=kv_cache_dtype, kv_cache_memory="8MiB", max_model_len=256)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    if library.available():
        assert isinstance(llm.engine.core.executor.runner.model.native_decoder, NativeDecoder)
    llm.shutdown()
    got = torch.tensor([next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]])
    error, other = ((got - ref).abs().mean().item() for ref in refs)
    assert error < 0.1 * other, (error, other)


def test_gguf_as_llama_cpp_writes_it_matches_transformers(tiny, tmp_path: Path) -> None:
    """llama.cpp's converter writes the rotated dims as ``rope.dimension_count`` (and LongRoPE's
    factors, one per rotated pair, as tensors): the same logits."""
    name, hf, _ = tiny
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf)
    model, config = load_model(resolve_model(str(path)), torch.float32)
    assert config.rotary_dim == int(64 * CASES[name][0])
    with torch.inference_mode():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prefill_logits(model, config, PROMPT), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_rotation_is_transformers_on_the_leading_dims(native: bool, scaled: bool) -> None:
    """``ApplyRotary`` (the native kernel and PyTorch) over 48 of 64 dims: transformers' Phi-3
    ``apply_rotary_pos_emb``, then each channel times its scale, the unrotated ones included."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    if native and not library.available():
        pytest.skip("no native kernels here")
    torch.manual_seed(0)
    tokens, heads, head_dim, rotary_dim = 5, 3, 64, 48
    positions = torch.arange(tokens) * 37
    cos, sin = RotaryEmbedding(rotary_dim, 512, 1e4, torch.float32)(positions)
    x = torch.randn(tokens, heads, head_dim)
    scale = torch.rand(heads, head_dim) + 0.5 if scaled else None
    hf_x = x.transpose(0, 1)[None]  # [1, heads, T, head_dim]
    config = transformers.Phi3Config(**SIZES, rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.75})
    expected, _ = apply_rotary_pos_emb(hf_x, hf_x, *Phi3RotaryEmbedding(config)(hf_x, positions[None]))
    expected = expected[0].transpose(0, 1) * (1 if scale is None else scale)
    rotate = ApplyRotary()
    got = rotate.forward_cpu(x.clone(), cos, sin, scale) if native else rotate.forward_native(x, cos, sin, scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_key_scales_commute_with_a_partial_rotation() -> None:
    """The int8 cache's key factors over 48 of 64 dims: each rotated pair shares one, so dividing
    keys before or after RoPE is the same, and q . k is unchanged."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, rotary_dim, hidden = 4, 2, 64, 48, 32
    weight = torch.randn(kv_heads * head_dim, hidden) * torch.rand(kv_heads * head_dim, 1) * 4
    scales = key_scales(weight, None, torch.rand(hidden) + 0.5, kv_heads, None, rotary_dim)
    assert torch.equal(scales[:, :24], scales[:, 24:48]) and not torch.equal(scales[:, :16], scales[:, 48:])
    cos, sin = RotaryEmbedding(rotary_dim, 64, 1e4, torch.float32)(torch.arange(3) * 7)
    rotate = ApplyRotary().forward_native
    k = torch.randn(3, kv_heads, head_dim)
    torch.testing.assert_close(rotate(k / scales, cos, sin), rotate(k, cos, sin) / scales)
    q = torch.randn(3, heads, head_dim)
    factors = qk_factors(scales, heads)
    both = rotate(torch.cat([q, k], 1), cos, sin, factors)
    plain = rotate(torch.cat([q, k], 1), cos, sin)

    def scores(qk: torch.Tensor) -> torch.Tensor:  # each query head's with its KV head's key
        return (qk[:, :heads] * qk[:, heads:].repeat_interleave(heads // kv_heads, 1)).sum(-1)

    torch.testing.assert_close(scores(both), scores(plain))


def test_partial_rotary_transformers_does_not_compute_is_refused(tmp_path: Path, tokenizer_dir: Path) -> None:
    """transformers' Qwen3 (as every architecture but Phi-3 here) rotates the whole head: a
    factor below 1 is refused by name; so is an odd count of rotated dims on Phi-3."""
    qwen3 = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**DENSE_COMMON, head_dim=64)).eval()
    save_checkpoint(qwen3, tmp_path / "qwen3", tokenizer_dir)
    edit_config(tmp_path / "qwen3", partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match=r"partial rotary embeddings \(partial_rotary_factor < 1\) on qwen3 are not"):
        load_config(resolve_model(str(tmp_path / "qwen3")))
    save_checkpoint(_phi3(0.75, None), tmp_path / "phi3", tokenizer_dir)
    edit_config(tmp_path / "phi3", rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.3})  # 19.2 dims
    with pytest.raises(ValueError, match="RoPE over 19 dims of a 64-dim head"):
        load_config(resolve_model(str(tmp_path / "phi3")))


def test_gguf_partial_rotary_of_permuted_q_k_rows_is_refused() -> None:
    """llama.cpp rotates a llama file's permuted q/k rows in pairs of its own: refused."""
    md = {"general.architecture": "llama", "llama.embedding_length": 128, "llama.attention.head_count": 2,
          "llama.rope.dimension_count": 32}
    with pytest.raises(ValueError, match=r"rope.dimension_count < head_dim\) on llama files are not supported"):
        gguf_config(SimpleNamespace(metadata=md, tensors={}))
