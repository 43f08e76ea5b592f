"""The int8 cache's key scales: scores and RoPE unchanged, each channel pair's size, large key channels' error cut."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedllm.distributed.parallel_state import SINGLE
from pagedllm.layers.key_scales import ALPHA, key_scales, qk_factors
from pagedllm.layers.rotary import ApplyRotary, RotaryEmbedding
from tests.models_util import randomize_vectors
from tests.tensor_parallel_ranks import Case, load, run_steps


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_key_scales_leave_scores_unchanged_and_commute_with_rope(backend: str) -> None:
    """Queries times s, keys divided by s, after RoPE: every score q . k as before (to float32
    rounding); s is equal on the channels RoPE turns together, so scaling before or after
    rotating is the same."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, hidden, tokens = 6, 2, 64, 96, 9
    k_weight = torch.randn(kv_heads * head_dim, hidden, generator=gen)
    k_bias = torch.randn(kv_heads * head_dim, generator=gen) * torch.rand(kv_heads * head_dim, generator=gen) * 40
    scales = key_scales(k_weight, k_bias, torch.rand(hidden, generator=gen) + 0.5, kv_heads)
    assert scales.shape == (kv_heads, head_dim) and torch.equal(scales[:, : head_dim // 2], scales[:, head_dim // 2 :])
    assert scales.max() / scales.min() > 2  # the bias's large channels
    factors = qk_factors(scales, heads)
    cos, sin = RotaryEmbedding(head_dim, 512, 10000.0, torch.float32)(torch.arange(tokens) * 37)
    x = torch.randn(tokens, heads + kv_heads, head_dim, generator=gen)
    rotate = ApplyRotary()
    rotate = rotate.forward_cpu if backend == "native" else rotate.forward_native
    plain = rotate(x.clone(), cos, sin)
    scaled = rotate(x.clone(), cos, sin, factors)
    torch.testing.assert_close(scaled, rotate(x * factors, cos, sin), atol=1e-5, rtol=1e-5)

    def scores(qk: torch.Tensor) -> torch.Tensor:
        keys = qk[:, heads:].repeat_interleave(heads // kv_heads, 1)
        return torch.einsum("thd,shd->hts", qk[:, :heads], keys)

    torch.testing.assert_close(scores(scaled), scores(plain), atol=1e-4, rtol=1e-5)


def test_key_scales_follow_each_channel_pairs_expected_size() -> None:
    """s_c = (the pair of channels RoPE turns together: their expected squares summed, sqrt) **
    ALPHA, over the head's geometric mean; each channel's expected square is its weight row's
    norm after the input norm, plus its bias squared, times its key-norm weight squared."""
    gen = torch.Generator().manual_seed(1)
    kv_heads, head_dim, hidden = 2, 8, 5
    w, b = torch.randn(kv_heads * head_dim, hidden, generator=gen), torch.randn(kv_heads * head_dim, generator=gen)
    g, n = torch.rand(hidden, generator=gen) + 0.5, torch.rand(head_dim, generator=gen) * 3
    got = key_scales(w, b, g, kv_heads, n)
    for h in range(kv_heads):
        sizes = []
        for c in range(head_dim):
            row = h * head_dim + c
            sizes.append(((w[row] * g).square().sum() + b[row] ** 2) * n[c] ** 2)
        half = head_dim // 2
        pair = [float(sizes[c % half] + sizes[c % half + half]) ** 0.5 for c in range(head_dim)]
        s = torch.tensor(pair) ** ALPHA
        torch.testing.assert_close(got[h], s / s.log().mean().exp(), rtol=1e-5, atol=0)


def test_key_scales_cut_the_int8_error_of_large_key_channels(tmp_path) -> None:
    """A Qwen2 whose key bias makes a few channels of each head ~40 times the others' size
    (as Qwen2.5's own keys are): with the key scales the int8 cache's logits move from the
    float32 cache's several times less than without them."""
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    randomize_vectors(hf, config.hidden_size)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.k_proj.bias.view(2, 64)[:, [5, 37]] += 40.0
    hf.save_pretrained(tmp_path)
    model, ours = load(Case("qwen2-outliers", str(tmp_path)), SINGLE)
    steps = [[(0, 0, 96)]]

    def logprobs(kv_dtype: torch.dtype) -> torch.Tensor:
        return torch.log_softmax(run_steps(model, ours, SINGLE, kv_dtype, (96,), steps), -1)

    reference = logprobs(torch.float32)
    scaled = (logprobs(torch.int8) - reference).abs().mean()
    for layer in model.layers:
        layer.self_attn.qk_scale = None
    plain = (logprobs(torch.int8) - reference).abs().mean()
    assert scaled < plain / 3, (float(scaled), float(plain))

