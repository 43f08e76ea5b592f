"""LoRA adapters end to end against transformers + peft: each adapter of ``lora_util`` served by
``LLM`` in float32 gives the greedy tokens and logprobs of peft's merged model however a step
runs it (chunked prefill, the one-call decoder, one adapter loaded at a time, bfloat16 A and B,
``LLM.chat``, two tensor-parallel ranks, speculative decoding, Phi-3's fused projections); a
batch mixing adapters and the base model equals each request alone; the prefix cache never
serves one adapter's blocks to another. Adapter files and names (GGUF files, bad adapters, the
server): ``test_lora_end_to_end_loading.py``; the kernels: ``test_lora_kernels.py``; the
server's adapter registry alone: ``test_lora_registry.py``."""

from __future__ import annotations

import copy
import math

import torch
import transformers
from peft import LoraConfig, get_peft_model

from pagedllm import LLM, LoRARequest
from pagedllm.entrypoints.chat_template import chat_prompt
from pagedllm.models.loader import load_tokenizer, resolve_model
from tests.lora_util import (  # noqa: F401 (adapters, base, llm: the fixtures)
    ADAPTERS, CHAT_TEMPLATE, LLAMA, MAX_TOKENS, PROMPTS, adapter_request, adapters, base, greedy, llm,
)
from tests.models_util import assert_greedy_matches, randomize_vectors
from tests.utils import assert_pool_whole


def test_each_adapter_matches_peft_merged(llm, base, adapters) -> None:
    """Greedy tokens and logprobs of each adapter equal transformers' on peft's merged weights
    (chunked prefill: 16-token steps), and each adapter changes the base model's tokens."""
    hf, _ = base
    base_out = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, out in zip(PROMPTS, base_out, strict=True):
        assert_greedy_matches(hf, prompt, out.outputs[0], MAX_TOKENS)
    for name, (_, merged) in adapters.items():
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=adapter_request(adapters, name))
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert_greedy_matches(merged, prompt, out.outputs[0], MAX_TOKENS)
        assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in base_out], name
    assert_pool_whole(llm.engine.core)


def test_mixed_batch_equals_each_alone(llm, adapters) -> None:
    """Three adapters and the base model in one batch (decodes and prefill chunks of several
    adapters in the same steps): each request's tokens are those it gets alone, its logprobs
    within float32 rounding (its prompt is cut into other chunks in a mixed batch); each output
    names its adapter (``lora_request``, as vLLM's)."""
    loras = [None, *(adapter_request(adapters, name) for name in ADAPTERS)]
    prompts = [p for p in PROMPTS for _ in loras]
    per_prompt = [lr for _ in PROMPTS for lr in loras]
    llm.engine.core.reset_prefix_cache()
    mixed = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=per_prompt)
    for prompt, lora, out in zip(prompts, per_prompt, mixed, strict=True):
        llm.engine.core.reset_prefix_cache()
        alone = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=lora)[0].outputs[0]
        together = out.outputs[0]
        assert together.token_ids == alone.token_ids, lora
        assert out.lora_request == together.lora_request == lora  # vLLM's fields (were missing)
        for tok, a, b in zip(alone.token_ids, together.logprobs, alone.logprobs, strict=True):
            assert math.isclose(a[tok].logprob, b[tok].logprob, abs_tol=1e-4), lora
    assert_pool_whole(llm.engine.core)


def test_one_call_decoder_equals_the_modules(llm, adapters) -> None:
    """Decode steps with adapters in the one-call native decoder give the modules' logprobs
    bit for bit (the same kernels in the same order)."""
    model = llm.engine.core.executor.runner.model
    loras = [None, *(adapter_request(adapters, name) for name in ADAPTERS)]
    runs = []
    for native in (None, False):
        model.native_decoder = native  # None: built on the next decode step
        llm.engine.core.reset_prefix_cache()
        runs.append(llm.generate([PROMPTS[1]] * len(loras), greedy(), use_tqdm=False, lora_request=loras))
    assert model.native_decoder is False
    model.native_decoder = None
    for a, b in zip(*runs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)] == [
            lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)
        ]


def test_prefix_cache_never_shared_across_adapters(llm, adapters) -> None:
    """The same prompt under another adapter (or none) hits nothing; under the same adapter it
    hits its full blocks."""
    core = llm.engine.core
    core.reset_prefix_cache()
    prompt = PROMPTS[2]
    full_blocks = (len(prompt) - 1) // 8 * 8

    def hits(lora) -> int:
        before = core.kv_cache.prefix_hits
        llm.generate([prompt], greedy(2), use_tqdm=False, lora_request=lora)
        return core.kv_cache.prefix_hits - before

    a, b = adapter_request(adapters, "all"), adapter_request(adapters, "qv_rslora")
    assert hits(a) == 0
    assert hits(b) == 0
    assert hits(None) == 0
    assert hits(LoRARequest("all", 99, a.path)) == 0  # another id: another adapter for the cache
    assert hits(a) == full_blocks
    assert hits(None) == full_blocks
    assert_pool_whole(core)


def test_an_id_reused_for_other_files_gets_no_prefix_hit(llm, adapters) -> None:
    """The same name and id for another adapter's files (as when a retrained adapter is saved
    elsewhere): the worker loads the new files, and the prefix cache serves none of the old
    files' blocks (it served them: the output matched neither adapter)."""
    core = llm.engine.core
    core.reset_prefix_cache()
    prompt = PROMPTS[2]
    old = LoRARequest("reused", 77, str(adapters["all"][0]))
    new = LoRARequest("reused", 77, str(adapters["mlp_o"][0]))
    llm.generate([prompt], greedy(2), use_tqdm=False, lora_request=old)
    before = core.kv_cache.prefix_hits
    out = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=new)[0].outputs[0]
    assert core.kv_cache.prefix_hits == before
    assert_greedy_matches(adapters["mlp_o"][1], prompt, out, MAX_TOKENS)
    assert_pool_whole(core)


def test_max_loras_one_runs_adapters_in_turn_and_reloads(base, adapters) -> None:
    """With one adapter per step and one kept loaded, a mixed batch still equals the merged
    models (requests of other adapters wait; evicted adapters are read again)."""
    _, path = base
    engine = LLM(
        model=str(path), dtype="float32", kv_cache_memory="8MiB", max_model_len=128, block_size=8,
        enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16,
    )
    names = list(ADAPTERS) * 2
    outs = engine.generate([PROMPTS[0]] * len(names), greedy(), use_tqdm=False,
                           lora_request=[adapter_request(adapters, n) for n in names])
    for name, out in zip(names, outs, strict=True):
        assert_greedy_matches(adapters[name][1], PROMPTS[0], out.outputs[0], MAX_TOKENS)
    assert len(engine.engine.core.executor.runner.lora.loaded) == 1
    assert_pool_whole(engine.engine.core)
    engine.shutdown()


def test_bfloat16_adapters_match_peft_with_bfloat16_weights(base, adapters) -> None:
    """lora_dtype bfloat16 keeps A and B rounded to bfloat16 (the test adapters' scales are
    powers of two, so rounding B before or after scaling is the same) and computes in float32:
    greedy tokens and logprobs equal, within float32 rounding, to peft's merged model of the
    same adapters with their lora_A and lora_B rounded to bfloat16."""
    from peft import PeftModel

    hf, path = base
    with LLM(model=str(path), dtype="float32", kv_cache_memory="8MiB", max_model_len=128, block_size=8,
             enable_lora=True, max_loras=3, max_lora_rank=16, lora_dtype="bfloat16") as engine:
        names = list(ADAPTERS)
        outs = engine.generate([PROMPTS[2]] * len(names), greedy(), use_tqdm=False,
                               lora_request=[adapter_request(adapters, n) for n in names])
        for name, out in zip(names, outs, strict=True):
            model = PeftModel.from_pretrained(copy.deepcopy(hf), str(adapters[name][0]))
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if "lora_" in pname:
                        p.copy_(p.bfloat16().float())
            assert_greedy_matches(model.merge_and_unload().eval(), PROMPTS[2], out.outputs[0], MAX_TOKENS)
        assert_pool_whole(engine.engine.core)


def _tokens(llm, prompt: list[int], lora: LoRARequest | None) -> list[int]:
    return llm.generate([prompt], greedy(), use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids


def test_chat_runs_with_the_adapter(llm, adapters) -> None:
    """``LLM.chat`` takes ``lora_request`` as ``generate`` does (it used to be a TypeError)."""
    messages = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    loras = [adapter_request(adapters, "all"), None]
    chats = llm.chat(messages, greedy(), use_tqdm=False, chat_template=CHAT_TEMPLATE, lora_request=loras)
    for conversation, lora, out in zip(messages, loras, chats, strict=True):
        _, ids = chat_prompt(llm.get_tokenizer(), conversation, chat_template=CHAT_TEMPLATE)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == _tokens(llm, ids, lora)
    assert chats[0].outputs[0].token_ids != _tokens(llm, chats[0].prompt_token_ids, None)  # the adapter counts
    assert_pool_whole(llm.engine.core)


def test_two_ranks_match_peft_merged(base, adapters) -> None:
    """Tensor parallelism at 2: column-parallel B rows and row-parallel A columns per rank; a
    batch mixing the adapters and the base still equals the merged models."""
    hf, path = base
    names = [None, *ADAPTERS]
    with LLM(model=str(path), dtype="float32", kv_cache_memory="8MiB", max_model_len=128, block_size=8,
             tensor_parallel_size=2, enable_lora=True, max_loras=3, max_lora_rank=16) as engine:
        outs = engine.generate([PROMPTS[1]] * len(names), greedy(), use_tqdm=False,
                               lora_request=[None if n is None else adapter_request(adapters, n) for n in names])
        for name, out in zip(names, outs, strict=True):
            assert_greedy_matches(hf if name is None else adapters[name][1], PROMPTS[1], out.outputs[0], MAX_TOKENS)
        assert_pool_whole(engine.engine.core)


def test_speculative_decoding_verifies_with_the_adapter(base, adapters) -> None:
    """n-gram drafts (which know nothing of adapters) verified by the adapter's model: greedy
    outputs still equal the merged models'."""
    hf, path = base
    names = [None, "all", "mlp_o"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with LLM(model=str(path), dtype="float32", kv_cache_memory="8MiB", max_model_len=128, block_size=8,
             speculative_config=spec, enable_lora=True, max_loras=2, max_lora_rank=16) as engine:
        outs = engine.generate([PROMPTS[0]] * len(names), greedy(), use_tqdm=False,
                               lora_request=[None if n is None else adapter_request(adapters, n) for n in names])
        assert engine.engine.core.scheduler.spec_stats.num_draft_tokens > 0
        for name, out in zip(names, outs, strict=True):
            assert_greedy_matches(hf if name is None else adapters[name][1], PROMPTS[0], out.outputs[0], MAX_TOKENS)
        assert_pool_whole(engine.engine.core)


def test_phi3_fused_projections(tmp_path) -> None:
    """An adapter on Phi-3's fused qkv_proj and gate_up_proj (one A, B split like the fused
    weight) equals transformers + peft merged."""
    sizes = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    config = transformers.Phi3Config(**sizes, pad_token_id=0, sliding_window=None)
    torch.manual_seed(3)
    hf = transformers.Phi3ForCausalLM(config).eval()
    randomize_vectors(hf)
    hf.save_pretrained(tmp_path / "base")
    load_tokenizer(resolve_model("smollm2")).save_pretrained(tmp_path / "base")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"])
    model = get_peft_model(copy.deepcopy(hf), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path / "lora")
    merged = model.merge_and_unload().eval()
    with LLM(model=str(tmp_path / "base"), dtype="float32", kv_cache_memory="4MiB", max_model_len=64, block_size=8,
             enable_lora=True, max_lora_rank=4) as engine:
        out = engine.generate([PROMPTS[1]], greedy(), use_tqdm=False,
                              lora_request=LoRARequest("phi", 1, str(tmp_path / "lora")))[0]
    assert_greedy_matches(merged, PROMPTS[1], out.outputs[0], MAX_TOKENS)
