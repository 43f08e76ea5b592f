"""Mixture-of-experts models (Qwen3-MoE, Mixtral) from checkpoints: greedy tokens equal to transformers' generate."""

from __future__ import annotations

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models.loader import load_config, load_model, resolve_model
from pagedllm.models.moe import MoEForCausalLM
from pagedllm.models.native_decoder import NativeDecoder
from tests.models_util import MOE_PROMPTS as PROMPTS
from tests.models_util import MOE_SHARED as _SHARED
from tests.models_util import MOE_WINDOW as WINDOW
from tests.models_util import assert_greedy_matches, assert_greedy_through_chunks_and_prefix_hits, prefill_logits
from tests.models_util import tiny  # noqa: F401 (the fixture)
from tests.utils import pool_is_whole

MAX_TOKENS = 16


def test_config_from_checkpoint(tiny) -> None:
    arch, hf, path = tiny
    config = load_config(resolve_model(str(path)))
    assert config.architecture == arch and config.qk_norm == (arch == "qwen3_moe")
    if arch == "qwen3_moe":
        assert (config.num_experts, config.moe_intermediate_size, config.norm_topk_prob) == (8, 64, False)
        assert [config.is_moe_layer(i) for i in range(3)] == [True, False, True]
        assert [config.layer_window(i) for i in range(3)] == [0, 0, 0]
    else:
        assert (config.num_experts, config.moe_intermediate_size, config.norm_topk_prob) == (4, 64, True)
        assert all(config.is_moe_layer(i) for i in range(3))
        assert [config.layer_window(i) for i in range(3)] == [WINDOW] * 3
    assert config.num_experts_per_tok == 2


def test_stacked_expert_tensors_load_as_the_per_expert_checkpoint(tiny) -> None:
    """transformers' in-memory names (``mlp.experts.gate_up_proj`` [E, 2I, H], 3-D) give the
    logits the saved per-expert checkpoint does."""
    arch, hf, path = tiny
    saved, config = load_model(resolve_model(str(path)), torch.float32)
    with torch.device("meta"):
        stacked = MoEForCausalLM(config, torch.float32)
    stacked.load_weights(hf.state_dict().items())
    ids = PROMPTS[2]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    # Logits of about 5 in magnitude (weights of std 0.2): float32 sums in another order differ by 1e-4.
    torch.testing.assert_close(prefill_logits(stacked.eval(), config, ids), expected, atol=5e-4, rtol=0)
    torch.testing.assert_close(prefill_logits(saved, config, ids), expected, atol=5e-4, rtol=0)


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)


def test_greedy_matches_transformers_with_chunks_and_prefix_hits(tiny) -> None:
    """16-token chunks; the third prompt hits the second's cached blocks, and all three again
    hit whole prompts: the same tokens each time. Decode steps run in the one-call decoder."""
    arch, hf, path = tiny
    assert_greedy_through_chunks_and_prefix_hits(path, hf, PROMPTS, MAX_TOKENS, NativeDecoder)


def test_preemption_and_ngram_speculation_give_the_same_tokens(tiny) -> None:
    """A pool too small for all requests at once (preempted and recomputed), then n-gram
    drafts on prompts that repeat themselves: the tokens of a plain run, which match transformers."""
    arch, hf, path = tiny
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[0] * 4, _SHARED + _SHARED]
    common = dict(model=str(path), dtype="float32", max_model_len=128, block_size=8)
    plain = LLM(**common, kv_cache_memory="8MiB")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, PARAMS, use_tqdm=False)]
    plain.shutdown()
    # Mixtral's window lets blocks go as requests advance: fewer blocks for it to run short.
    blocks = {"qwen3_moe": 14, "mixtral": 8}[arch]
    tight = LLM(**common, num_gpu_blocks_override=blocks, enable_prefix_caching=False, max_num_batched_tokens=16)
    outputs = tight.generate(prompts, PARAMS, use_tqdm=False)
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert pool_is_whole(tight)
    tight.shutdown()
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    spec = LLM(**common, kv_cache_memory="8MiB", speculative_config=ngram)
    outputs = spec.generate(prompts, PARAMS, use_tqdm=False)
    assert spec.engine.core.scheduler.spec_stats.num_draft_tokens > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert pool_is_whole(spec)
    spec.shutdown()
    for prompt, out in zip(prompts[2:], outputs[2:], strict=True):
        assert_greedy_matches(hf, prompt, out.outputs[0], MAX_TOKENS)
