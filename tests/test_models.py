"""Model definitions against HF transformers, on tiny random-weight llama and qwen2 checkpoints."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedllm.config import ModelConfig
from pagedllm.layers.attention_metadata import AttentionMetadata
from pagedllm.layers.linear import PackedLinear
from pagedllm.layers.rotary import ApplyRotary, RotaryEmbedding
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.loader import load_model, resolve_model
from pagedllm.models.registry import get_model_class
from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.worker.kv_cache import allocate_kv_caches

BLOCK_SIZE = 16
ATOL = 1e-4

# head_dim 64 runs the native decode kernel, 32 its PyTorch fallback.
TINY = {
    "llama": transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=320, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    ),
    "qwen2": transformers.Qwen2Config(
        vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=[3, 4],
    ),
}
HF_CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(HF model, our model, our config) for a random checkpoint saved with save_pretrained."""
    arch = request.param
    torch.manual_seed(0)
    hf = HF_CLASSES[arch](TINY[arch]).eval()
    with torch.no_grad():  # HF zero-inits biases: make them count
        for p in hf.parameters():
            if p.ndim == 1:
                p.normal_(1.0 if p.shape[0] == TINY[arch].hidden_size else 0.0, 0.2)
    path = tmp_path_factory.mktemp(arch)
    hf.save_pretrained(path)
    model, config = load_model(resolve_model(str(path)), torch.float32)
    return hf, model, config


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def test_config_from_checkpoint(tiny) -> None:
    hf, _, config = tiny
    c = hf.config
    assert config.architecture == c.model_type
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (2, 4, 2)
    assert config.head_dim == c.hidden_size // c.num_attention_heads
    assert config.tie_word_embeddings == c.tie_word_embeddings
    assert config.attention_bias == (c.model_type == "qwen2")
    assert config.rope_theta == c.rope_parameters["rope_theta"]
    assert config.eos_token_ids == ([2] if c.model_type == "llama" else [3, 4])


@torch.inference_mode()
def test_prefill_matches_transformers(tiny) -> None:
    hf, model, config = tiny
    ids = torch.randint(0, config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    kv_caches = allocate_kv_caches(KVCacheConfig.for_model(config, 4, BLOCK_SIZE, torch.float32))
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[2, 0, 3]], BLOCK_SIZE)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), kv_caches, [meta] * config.num_layers)
    assert hidden.shape == (len(ids), config.hidden_size)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


@torch.inference_mode()
def test_batched_chunked_prefill_and_decode_match_transformers(tiny) -> None:
    """Two requests through the paged cache: prefills, a later chunk, and decodes in mixed steps."""
    hf, model, config = tiny
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (22, 27)]
    tables = [[5, 2], [0, 7]]  # scattered blocks
    refs = [hf_logits(hf, s) for s in seqs]
    kv_caches = allocate_kv_caches(KVCacheConfig.for_model(config, 8, BLOCK_SIZE, torch.float32))
    # (request, start, end) per step; decodes (one token) first, as the metadata requires.
    steps = [
        [(0, 0, 20), (1, 0, 10)],
        [(0, 20, 21), (1, 10, 26)],
        [(0, 21, 22), (1, 26, 27)],
    ]
    for step in steps:
        ids = [t for r, a, b in step for t in seqs[r][a:b]]
        positions = [p for _, a, b in step for p in range(a, b)]
        meta = AttentionMetadata.build(
            [b - a for _, a, b in step], [b for _, _, b in step], [tables[r] for r, _, _ in step], BLOCK_SIZE
        )
        logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), kv_caches, [meta] * config.num_layers))
        expected = torch.cat([refs[r][a:b] for r, a, b in step])
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_bfloat16_close_to_float32(tiny) -> None:
    hf, model32, config = tiny
    model16 = LlamaForCausalLM(config, torch.bfloat16)
    model16.load_weights((k, v) for k, v in hf.state_dict().items())
    assert all(p.dtype == torch.bfloat16 for p in model16.parameters())
    ids = list(range(1, 30))
    outs = []
    with torch.inference_mode():
        for model, dtype in ((model32, torch.float32), (model16, torch.bfloat16)):
            kv = allocate_kv_caches(KVCacheConfig.for_model(config, 2, BLOCK_SIZE, dtype))
            meta = AttentionMetadata.build([len(ids)], [len(ids)], [[0, 1]], BLOCK_SIZE)
            outs.append(model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), kv, [meta] * config.num_layers)))
    assert (outs[0] - outs[1]).abs().max() < 0.05 * outs[0].abs().max()


def test_tied_lm_head_shares_embedding(tiny) -> None:
    _, model, config = tiny
    params = dict(model.named_parameters())
    if config.tie_word_embeddings:  # no weight of its own; a float32 model packs a copy for the GEMM
        assert model.lm_head is None or isinstance(model.lm_head, PackedLinear)
        assert not any("lm_head" in n for n in params)
    else:
        assert model.lm_head is not None
        assert all(p.data_ptr() != params["embed_tokens.weight"].data_ptr() for n, p in params.items() if "lm_head" in n)


def test_load_weights_rejects_incomplete_checkpoint(tiny) -> None:
    hf, _, config = tiny
    state = {k: v for k, v in hf.state_dict().items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match="qkv_proj"):
        LlamaForCausalLM(config, torch.float32).load_weights(state.items())
    state = {k: v for k, v in hf.state_dict().items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="the checkpoint lacks norm.weight"):  # one line, not load_state_dict's
        LlamaForCausalLM(config, torch.float32).load_weights(state.items())


def test_rotary_matches_transformers() -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = TINY["llama"]
    head_dim = config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    rope = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, torch.float32)
    positions = torch.tensor([0, 7, 3, 500, 1])
    q = torch.randn(5, 4, head_dim)
    k = torch.randn(5, 2, head_dim)
    cos, sin = rope(positions)
    qk = ApplyRotary()(torch.cat([q, k], 1), cos, sin)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(qk[:, :4], hf_q[0].transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(qk[:, 4:], hf_k[0].transpose(0, 1), atol=1e-5, rtol=0)


def test_registry() -> None:
    assert get_model_class("llama") is LlamaForCausalLM
    assert get_model_class("qwen2") is LlamaForCausalLM
    with pytest.raises(ValueError, match="mamba.*llama, qwen2"):
        get_model_class("mamba")


def test_constructor_gives_random_model() -> None:
    config = ModelConfig(
        architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6,
        max_position_embeddings=64, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config, torch.float32)
    assert not any(p.requires_grad for p in model.parameters())
    kv = allocate_kv_caches(KVCacheConfig.for_model(config, 1, BLOCK_SIZE, torch.float32))
    meta = AttentionMetadata.build([5], [5], [[0]], BLOCK_SIZE)
    hidden = model(torch.arange(5), torch.arange(5), kv, [meta] * config.num_layers)
    assert model.compute_logits(hidden).shape == (5, 64)
