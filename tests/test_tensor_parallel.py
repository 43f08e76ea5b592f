"""Tensor parallelism through the real engine: N ranks (the mp executor, gloo) equal one rank.

Tiny random-weight llama (6 heads, 3 KV heads: 3 ranks of one KV head each), qwen2 (q/k/v
bias, untied lm_head: 2 ranks) and gemma3 (one KV head, replicated on 2 ranks; sliding
windows) checkpoints run greedily in float32 with chunked prefill and preemption; tokens
must be equal and logprobs within 1e-4 of the single rank's, and the block pool whole after.
"""

from __future__ import annotations

import time

import pytest
import torch
import transformers

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams
from tests.models_util import randomize_vectors, tiny_gemma3
from tests.utils import assert_pool_whole


TINY = {
    "llama": (
        transformers.LlamaConfig(
            vocab_size=256, hidden_size=384, intermediate_size=384, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=3, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
            eos_token_id=2,
        ),
        3,
    ),
    "qwen2": (
        transformers.Qwen2Config(
            vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=3,
        ),
        2,
    ),
    "gemma3": (None, 2),
}


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """(checkpoint directory of a random model, tensor-parallel size to test it at)."""
    arch = request.param
    config, size = TINY[arch]
    torch.manual_seed(0)
    if arch == "gemma3":
        hf = tiny_gemma3()
    else:
        hf = transformers.AutoModelForCausalLM.from_config(config)
        randomize_vectors(hf, config.hidden_size)
    path = tmp_path_factory.mktemp(arch)
    hf.save_pretrained(path)
    return str(path), size


def _greedy(path: str, tp: int, prompts: list[list[int]], num_blocks: int) -> tuple[list, list, int]:
    """Tokens and top-2 logprobs of each prompt, and the preemptions, through an EngineCore."""
    core = EngineCore(
        EngineConfig(
            model=path, dtype=torch.float32, tensor_parallel_size=tp, num_gpu_blocks_override=num_blocks,
            max_num_batched_tokens=24, max_num_seqs=4, block_size=8, max_model_len=128,
        )
    )
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
        for i, p in enumerate(prompts):
            core.add_request(EngineCoreRequest(str(i), p, params, [], time.monotonic()))
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        logprobs: dict[str, list[list[float]]] = {str(i): [] for i in range(len(prompts))}
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                assert out.error is None, out.error
                tokens[out.request_id] += out.new_token_ids
                if out.logprobs is not None:
                    logprobs[out.request_id] += out.logprobs.logprobs
        assert_pool_whole(core)
        return list(tokens.values()), list(logprobs.values()), core.scheduler.num_preemptions
    finally:
        core.shutdown()


def test_ranks_equal_one_rank(tiny: tuple[str, int]) -> None:
    path, size = tiny
    gen = torch.Generator().manual_seed(3)
    # The long prompts wait until the pool holds all of each; the short last two, admitted
    # beside running ones, grow until someone is preempted.
    prompts = [torch.randint(4, 128, (n,), generator=gen).tolist() for n in (27, 21, 40, 9, 30, 6, 4)]
    num_blocks = 36 if "gemma3" in path else 12  # Gemma's 6 single-layer groups each hold blocks
    ref_tokens, ref_logprobs, ref_preempted = _greedy(path, 1, prompts, num_blocks)
    tokens, logprobs, preempted = _greedy(path, size, prompts, num_blocks)
    assert ref_preempted > 0 and preempted == ref_preempted  # the cache is tight: recompute happens
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=0)


def test_default_model_at_three_ranks_equals_one() -> None:
    """SmolLM2-135M (9 heads, 3 KV heads, 49152-token vocabulary) split over 3 ranks, real weights."""
    prompts = [
        "The capital of France is", "def fibonacci(n):", "Once upon a time", "The three laws of robotics",
        "Water boils at", "SELECT name FROM", "My favourite colour is", "In 1969, the first",
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = {}
    for size in (1, 3):
        with LLM(dtype="float32", kv_cache_memory="64MiB", tensor_parallel_size=size) as llm:
            outs[size] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[3] == outs[1]


def test_a_size_that_does_not_divide_names_the_sizes_that_do() -> None:
    with pytest.raises(ValueError, match=r"sizes that work: 1, 3\b"):
        EngineCore(EngineConfig(model="smollm2", dtype=torch.float32, tensor_parallel_size=2))


@pytest.mark.slow
def test_qwen_coder_at_two_ranks_equals_one() -> None:
    """Qwen2.5-Coder-0.5B (14 heads, 2 KV heads, q/k/v bias, 151936-token vocabulary) at 2 ranks."""
    prompts = ["def quicksort(xs):", "SELECT * FROM users WHERE", "// A function that reverses a string", "import numpy as np"]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = {}
    for size in (1, 2):
        with LLM(model="qwen2.5-coder-0.5b-instruct", dtype="float32", kv_cache_memory="64MiB", tensor_parallel_size=size) as llm:
            outs[size] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[2] == outs[1]
