"""LoRA adapters end to end against transformers + peft: adapters made here with ``peft`` on a
tiny random llama (B randomized so that they change the outputs), served by ``LLM`` in float32
and by the server, and compared with peft's merged model; a batch mixing adapters and the base
model equals each request alone; the prefix cache never serves one adapter's blocks to another;
bad adapters (PEFT folders and GGUF files) fail with errors that name the problem. One module:
the peft adapters, the engine and the server on them are built once. The kernels:
``test_lora_kernels.py``; the server's adapter registry alone: ``test_lora_registry.py``."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.entrypoints.chat_template import chat_prompt
from pagedllm.errors import InvalidParamError, LoRAError
from pagedllm.models.loader import load_tokenizer, resolve_model
from tests.models_util import (
    GGUF_NAMES, assert_greedy_matches, finish_gguf, llama_cpp_permute, randomize_vectors, shared_prefix_prompts,
)
from tests.server_util import API_KEY, start_server, stop_server, wait_idle
from tests.utils import assert_pool_whole

MAX_TOKENS = 12
_, PROMPTS = shared_prefix_prompts(11, 20, (6, 7, 13))
# head_dim 64: decode steps without adapters run the one-call native decoder.
LLAMA = dict(
    vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rope_theta=1e4,
)
ADAPTERS = {
    "all": LoraConfig(
        r=8, lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "qv_rslora": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "mlp_o": LoraConfig(
        r=16, lora_alpha=8, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
        rank_pattern={"down_proj": 6}, alpha_pattern={"down_proj": 12},
    ),
}


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[transformers.LlamaForCausalLM, Path]:
    """(HF model, its checkpoint folder with SmolLM2's tokenizer)."""
    path = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    randomize_vectors(hf)
    hf.save_pretrained(path)
    load_tokenizer(resolve_model("smollm2")).save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Name -> (PEFT adapter folder, transformers model with the adapter merged)."""
    hf, _ = base
    out = {}
    for i, (name, config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        model = get_peft_model(copy.deepcopy(hf), copy.deepcopy(config))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:  # peft starts B at zero: the adapter would change nothing
                    p.normal_(0.0, 0.3)
        path = tmp_path_factory.mktemp(f"lora-{name}")
        model.save_pretrained(path)
        out[name] = (path, model.merge_and_unload().eval())
    return out


def _lora(adapters, name: str) -> LoRARequest:
    return LoRARequest(name, list(ADAPTERS).index(name) + 1, str(adapters[name][0]))


@pytest.fixture(scope="module")
def llm(base):
    _, path = base
    engine = LLM(
        model=str(path), dtype="float32", kv_cache_memory="8MiB", max_model_len=128, block_size=8,
        max_num_batched_tokens=16, enable_lora=True, max_loras=4, max_lora_rank=16,
    )
    yield engine
    engine.shutdown()


def test_each_adapter_matches_peft_merged(llm, base, adapters) -> None:
    """Greedy tokens and logprobs of each adapter equal transformers' on peft's merged weights
    (chunked prefill: 16-token steps), and each adapter changes the base model's tokens."""
    hf, _ = base
    base_out = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    for prompt, out in zip(PROMPTS, base_out, strict=True):
        assert_greedy_matches(hf, prompt, out.outputs[0], MAX_TOKENS)
    for name, (_, merged) in adapters.items():
        outs = llm.generate(PROMPTS, _greedy(), use_tqdm=False, lora_request=_lora(adapters, name))
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert_greedy_matches(merged, prompt, out.outputs[0], MAX_TOKENS)
        assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in base_out], name
    assert_pool_whole(llm.engine.core)


def test_mixed_batch_equals_each_alone(llm, adapters) -> None:
    """Three adapters and the base model in one batch (decodes and prefill chunks of several
    adapters in the same steps): each request's tokens are those it gets alone, its logprobs
    within float32 rounding (its prompt is cut into other chunks in a mixed batch); each output
    names its adapter (``lora_request``, as vLLM's)."""
    loras = [None, *(_lora(adapters, name) for name in ADAPTERS)]
    prompts = [p for p in PROMPTS for _ in loras]
    per_prompt = [lr for _ in PROMPTS for lr in loras]
    llm.engine.core.reset_prefix_cache()
    mixed = llm.generate(prompts, _greedy(), use_tqdm=False, lora_request=per_prompt)
    for prompt, lora, out in zip(prompts, per_prompt, mixed, strict=True):
        llm.engine.core.reset_prefix_cache()
        alone = llm.generate([prompt], _greedy(), use_tqdm=False, lora_request=lora)[0].outputs[0]
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
    loras = [None, *(_lora(adapters, name) for name in ADAPTERS)]
    runs = []
    for native in (None, False):
        model.native_decoder = native  # None: built on the next decode step
        llm.engine.core.reset_prefix_cache()
        runs.append(llm.generate([PROMPTS[1]] * len(loras), _greedy(), use_tqdm=False, lora_request=loras))
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
        llm.generate([prompt], _greedy(2), use_tqdm=False, lora_request=lora)
        return core.kv_cache.prefix_hits - before

    a, b = _lora(adapters, "all"), _lora(adapters, "qv_rslora")
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
    llm.generate([prompt], _greedy(2), use_tqdm=False, lora_request=old)
    before = core.kv_cache.prefix_hits
    out = llm.generate([prompt], _greedy(), use_tqdm=False, lora_request=new)[0].outputs[0]
    assert core.kv_cache.prefix_hits == before
    assert_greedy_matches(adapters["mlp_o"][1], prompt, out, MAX_TOKENS)
    assert_pool_whole(core)


def test_one_id_for_two_adapters_in_a_batch_is_refused(llm, adapters) -> None:
    """A batch in which one id names two adapters is refused before anything runs (the second
    adapter's requests ran with the first's weights)."""
    a, b = _lora(adapters, "all"), _lora(adapters, "mlp_o")
    clash = LoRARequest(b.name, a.id, b.path)
    with pytest.raises(InvalidParamError, match=f"has the id {a.id} of another adapter") as e:
        llm.generate([PROMPTS[0], PROMPTS[1]], _greedy(), use_tqdm=False, lora_request=[a, clash])
    assert e.value.param == "lora_request"
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate([PROMPTS[0]] * 2, _greedy(), use_tqdm=False, lora_request=[a, LoRARequest(a.name, a.id, a.path)])
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids  # equal requests of one adapter run


def test_max_loras_one_runs_adapters_in_turn_and_reloads(base, adapters) -> None:
    """With one adapter per step and one kept loaded, a mixed batch still equals the merged
    models (requests of other adapters wait; evicted adapters are read again)."""
    _, path = base
    engine = LLM(
        model=str(path), dtype="float32", kv_cache_memory="8MiB", max_model_len=128, block_size=8,
        enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16,
    )
    names = list(ADAPTERS) * 2
    outs = engine.generate([PROMPTS[0]] * len(names), _greedy(), use_tqdm=False,
                           lora_request=[_lora(adapters, n) for n in names])
    for name, out in zip(names, outs, strict=True):
        assert_greedy_matches(adapters[name][1], PROMPTS[0], out.outputs[0], MAX_TOKENS)
    assert len(engine.engine.core.executor.runner.lora.loaded) == 1
    assert_pool_whole(engine.engine.core)
    engine.shutdown()


def _write_adapter(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def _q_tensors(r: int, hidden: int = 128, out: int = 128) -> dict[str, torch.Tensor]:
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    return {f"{prefix}.lora_A.weight": torch.randn(r, hidden), f"{prefix}.lora_B.weight": torch.randn(out, r)}


@pytest.mark.parametrize(
    "config, tensors, message",
    [
        ({"r": 32, "lora_alpha": 32}, _q_tensors(32), "rank 32 exceeds max_lora_rank 16"),
        ({"r": 4, "lora_alpha": 8}, _q_tensors(4, hidden=96, out=96), "another base model"),
        ({"r": 4, "lora_alpha": 8, "modules_to_save": ["lm_head"]}, _q_tensors(4), "modules_to_save"),
        ({"r": 4, "lora_alpha": 8, "use_dora": True}, _q_tensors(4), "DoRA"),
        ({"r": 8, "lora_alpha": 8}, _q_tensors(4), "do not have rank r=8"),
        # Served as garbage with finite logprobs before (the NaNs did not reach the logits).
        ({"r": 4, "lora_alpha": 8}, {k: v.fill_(math.nan) if "lora_A" in k else v for k, v in _q_tensors(4).items()},
         "layer 0 q_proj: lora_A or lora_B holds a NaN or an infinity"),
        ({"r": 4, "lora_alpha": 8}, {k: v.fill_(math.inf) if "lora_B" in k else v for k, v in _q_tensors(4).items()},
         "holds a NaN or an infinity"),
        ({"r": 4}, {"base_model.model.lm_head.lora_A.weight": torch.randn(4, 128),
                    "base_model.model.lm_head.lora_B.weight": torch.randn(256, 4)}, "not a LoRA update"),
    ],
)
def test_bad_adapters_fail_their_request_with_the_reason(llm, tmp_path, config, tensors, message) -> None:
    path = _write_adapter(tmp_path / "bad", config, tensors)
    with pytest.raises(LoRAError, match=message):
        llm.generate([PROMPTS[0]], _greedy(), use_tqdm=False, lora_request=LoRARequest("bad", 50, str(path)))
    assert llm.generate([PROMPTS[0]], _greedy(2), use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_corrupt_and_missing_files(llm, adapters, tmp_path) -> None:
    good = adapters["all"][0]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_bytes((good / "adapter_config.json").read_bytes())
    (corrupt / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes()[:200])
    with pytest.raises(LoRAError, match="cannot read .*adapter_model.safetensors"):
        llm.generate([PROMPTS[0]], _greedy(), use_tqdm=False, lora_request=LoRARequest("c", 60, str(corrupt)))
    (corrupt / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="cannot read .*adapter_config.json"):
        llm.generate([PROMPTS[0]], _greedy(), use_tqdm=False, lora_request=LoRARequest("c", 61, str(corrupt)))
    with pytest.raises(LoRAError, match="is neither a PEFT adapter folder nor a GGUF file"):
        llm.generate([PROMPTS[0]], _greedy(), use_tqdm=False, lora_request=LoRARequest("m", 62, str(tmp_path / "no")))
    assert_pool_whole(llm.engine.core)


def _write_gguf_adapter(path: Path, folder: Path, alpha: float, kind: str = "adapter", drop_rows: int = 0) -> Path:
    """A GGUF LoRA file as llama.cpp's convert_lora_to_gguf.py writes one for a llama base, from
    the PEFT folder's tensors (q/k B rows in llama.cpp's permuted order); ``kind``: its
    general.type; ``drop_rows``: B rows cut off (an adapter for another base)."""
    import re

    import gguf
    from safetensors.torch import load_file

    heads = {"self_attn.q_proj": LLAMA["num_attention_heads"], "self_attn.k_proj": LLAMA["num_key_value_heads"]}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(kind)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for key, t in sorted(load_file(folder / "adapter_model.safetensors").items()):
        layer, module, which = re.search(r"layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])", key).groups()
        w = t.numpy()
        if which == "B" and module in heads:
            w = llama_cpp_permute(w, heads[module])
        writer.add_tensor(f"blk.{layer}.{GGUF_NAMES[module]}.weight.lora_{which.lower()}",
                          w[drop_rows:] if which == "B" else w)
    finish_gguf(writer)
    return path


def test_gguf_adapter_equals_its_peft_folder(llm, adapters, tmp_path) -> None:
    """A llama.cpp GGUF LoRA file of the "all" adapter (r 8, alpha 16: llama.cpp's alpha / r
    is PEFT's scale) gives the PEFT folder's tokens and logprobs exactly, beside the folder in
    one batch; a GGUF model file, another base's shapes and a truncated file fail naming why."""
    folder = adapters["all"][0]
    path = _write_gguf_adapter(tmp_path / "all.gguf", folder, 16.0)
    outs = llm.generate([PROMPTS[1]] * 2, _greedy(), use_tqdm=False,
                        lora_request=[_lora(adapters, "all"), LoRARequest("all-gguf", 70, str(path))])
    a, b = (o.outputs[0] for o in outs)
    assert a.token_ids == b.token_ids
    logprobs = [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)] for o in (a, b)]
    assert logprobs[0] == logprobs[1]
    model_file = _write_gguf_adapter(tmp_path / "model.gguf", folder, 16.0, kind="model")
    other = _write_gguf_adapter(tmp_path / "other.gguf", folder, 16.0, drop_rows=16)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:-4000])
    for i, (bad, message) in enumerate(((model_file, "not a GGUF LoRA adapter"), (other, "another base model"),
                                        (truncated, "cannot read"))):
        with pytest.raises(LoRAError, match=message):
            llm.generate([PROMPTS[0]], _greedy(), use_tqdm=False, lora_request=LoRARequest("bad", 71 + i, str(bad)))
    assert_pool_whole(llm.engine.core)


def test_gguf_adapter_scale_is_alpha_over_rank_without_rslora(llm, adapters, tmp_path) -> None:
    """A GGUF LoRA file has no rsLoRA flag: its adapter.lora.alpha is taken as llama.cpp takes
    it, scale alpha / r. The rsLoRA adapter "qv_rslora" (r 4, alpha 8: PEFT's scale 8 / sqrt(4)
    = 4) written with its alpha as llama.cpp's converter keeps it gets 8 / 4 = 2 and other
    logprobs than its folder; written with alpha 8 sqrt(4) = 16 it gives the folder's exactly."""
    folder = adapters["qv_rslora"][0]
    kept = _write_gguf_adapter(tmp_path / "kept.gguf", folder, 8.0)
    rescaled = _write_gguf_adapter(tmp_path / "rescaled.gguf", folder, 8.0 * math.sqrt(4))
    outs = llm.generate([PROMPTS[1]] * 3, _greedy(), use_tqdm=False, lora_request=[
        _lora(adapters, "qv_rslora"), LoRARequest("kept", 80, str(kept)), LoRARequest("rescaled", 81, str(rescaled)),
    ])
    folder_out, kept_out, rescaled_out = (o.outputs[0] for o in outs)

    def logprobs(o) -> list[float]:
        return [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)]

    assert rescaled_out.token_ids == folder_out.token_ids
    assert logprobs(rescaled_out) == logprobs(folder_out)
    assert logprobs(kept_out) != logprobs(folder_out)
    assert_pool_whole(llm.engine.core)


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
        outs = engine.generate([PROMPTS[2]] * len(names), _greedy(), use_tqdm=False,
                               lora_request=[_lora(adapters, n) for n in names])
        for name, out in zip(names, outs, strict=True):
            model = PeftModel.from_pretrained(copy.deepcopy(hf), str(adapters[name][0]))
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if "lora_" in pname:
                        p.copy_(p.bfloat16().float())
            assert_greedy_matches(model.merge_and_unload().eval(), PROMPTS[2], out.outputs[0], MAX_TOKENS)
        assert_pool_whole(engine.engine.core)


def _tokens(llm, prompt: list[int], lora: LoRARequest | None) -> list[int]:
    return llm.generate([prompt], _greedy(), use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids


def test_chat_runs_with_the_adapter(llm, adapters) -> None:
    """``LLM.chat`` takes ``lora_request`` as ``generate`` does (it used to be a TypeError)."""
    messages = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    loras = [_lora(adapters, "all"), None]
    chats = llm.chat(messages, _greedy(), use_tqdm=False, chat_template=CHAT_TEMPLATE, lora_request=loras)
    for conversation, lora, out in zip(messages, loras, chats, strict=True):
        _, ids = chat_prompt(llm.get_tokenizer(), conversation, chat_template=CHAT_TEMPLATE)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == _tokens(llm, ids, lora)
    assert chats[0].outputs[0].token_ids != _tokens(llm, chats[0].prompt_token_ids, None)  # the adapter counts
    assert_pool_whole(llm.engine.core)


def test_lora_request_without_enable_lora_is_refused(base, adapters) -> None:
    _, path = base
    engine = LLM(model=str(path), dtype="float32", kv_cache_memory="4MiB", max_model_len=64, block_size=8)
    with pytest.raises(InvalidParamError, match="enable-lora"):
        engine.generate([PROMPTS[0]], _greedy(), use_tqdm=False, lora_request=_lora(adapters, "all"))
    engine.shutdown()


# -- the server -------------------------------------------------------------------------------

# Special tokens and one-letter contents only: SmolLM2's own template's words lie outside the
# test model's 256-token vocabulary.
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}<|im_start|>"


@pytest.fixture(scope="module")
def server(base, adapters, tmp_path_factory):
    _, path = base
    srv = start_server(
        tmp_path_factory.mktemp("server"), "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", "8MiB",
        "--api-key", API_KEY, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"all={adapters['all'][0]}",
        json.dumps({"name": "qv", "path": str(adapters["qv_rslora"][0]), "base_model_name": "qv-base"}),
        "--chat-template", CHAT_TEMPLATE, model=str(path),
    )
    yield srv
    stop_server(srv)


def _text(llm, prompt: list[int], lora: LoRARequest | None) -> str:
    """The offline engine's greedy text (tested above against peft's merged model)."""
    return llm.generate([prompt], _greedy(), use_tqdm=False, lora_request=lora)[0].outputs[0].text


def test_server_selects_adapters_by_model(server, llm, base, adapters) -> None:
    _, path = base
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {str(path), "all", "qv"}
    assert models["all"].parent == str(path) and models["all"].root == str(adapters["all"][0])
    assert models["qv"].parent == "qv-base"  # the JSON form's base_model_name
    assert getattr(models[str(path)], "parent", None) is None
    for model, lora in ((str(path), None), ("all", _lora(adapters, "all")), ("qv", _lora(adapters, "qv_rslora"))):
        out = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0)
        assert out.choices[0].text == _text(llm, PROMPTS[1], lora), model
        assert out.model == model  # the name asked for, as vLLM answers
        chunks = list(client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=2, stream=True))
        assert {c.model for c in chunks} == {model}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt=PROMPTS[0], max_tokens=2)


def test_server_chat_echoes_the_adapter_name(server, base) -> None:
    """A chat completion's ``model`` (and each streamed chunk's) is the name asked for: the
    base model's or an adapter's, as completions' is; adapters change the reply."""
    _, path = base
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    messages = [{"role": "user", "content": "a"}]
    replies = {}
    for model in (str(path), "all", "qv"):
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0)
        assert out.model == model
        replies[model] = out.choices[0].message.content
        chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=2, stream=True))
        assert chunks and {c.model for c in chunks} == {model}
    assert replies["all"] != replies[str(path)]


def test_server_load_and_unload_while_streams_run(server, llm, base, adapters) -> None:
    """An adapter loaded while two streams run serves at once; unloading the adapter of a
    running stream leaves that stream whole; afterwards new requests for it get 404."""
    _, path = base
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    streams = [
        client.completions.create(model=m, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
        for m in ("all", str(path))
    ]
    texts = [next(iter(s)).choices[0].text for s in streams]  # both running
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(adapters["mlp_o"][0])})
    assert r.status_code == 200, r.text
    out = client.completions.create(model="mlp", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0)
    assert out.choices[0].text == _text(llm, PROMPTS[0], _lora(adapters, "mlp_o"))
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "all"}).status_code == 200
    for i, s in enumerate(streams):
        texts[i] += "".join(chunk.choices[0].text for chunk in s)
    assert texts == [_text(llm, PROMPTS[2], _lora(adapters, "all")), _text(llm, PROMPTS[2], None)]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="all", prompt=PROMPTS[0], max_tokens=2)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "all"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    # Loaded again under its name: served again, with its own id.
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": str(adapters["all"][0])}).status_code == 200
    out = client.completions.create(model="all", prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0.0)
    assert out.choices[0].text == texts[0]
    wait_idle(http)


def test_server_bad_adapters_get_400_naming_the_problem(server, adapters, tmp_path) -> None:
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    big = _write_adapter(tmp_path / "big", {"r": 32, "lora_alpha": 32}, _q_tensors(32))
    other = _write_adapter(tmp_path / "other", {"r": 4, "lora_alpha": 8}, _q_tensors(4, hidden=96, out=96))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text("{}")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    for name, path, message in (
        ("big", big, "rank 32 exceeds max_lora_rank 16"),
        ("other", other, "another base model"),
        ("corrupt", corrupt, "cannot read"),
        ("missing", tmp_path / "missing", "is neither a PEFT adapter folder nor a GGUF file"),
        ("qv", adapters["qv_rslora"][0], "already in use"),
    ):
        r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 400, (name, r.text)
        assert message in r.json()["error"]["message"], name
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"}).status_code == 401
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "never"}).status_code == 404
    r = http.post("/v1/completions", json={"model": "big", "prompt": PROMPTS[0], "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_two_ranks_match_peft_merged(base, adapters) -> None:
    """Tensor parallelism at 2: column-parallel B rows and row-parallel A columns per rank; a
    batch mixing the adapters and the base still equals the merged models."""
    hf, path = base
    names = [None, *ADAPTERS]
    with LLM(model=str(path), dtype="float32", kv_cache_memory="8MiB", max_model_len=128, block_size=8,
             tensor_parallel_size=2, enable_lora=True, max_loras=3, max_lora_rank=16) as engine:
        outs = engine.generate([PROMPTS[1]] * len(names), _greedy(), use_tqdm=False,
                               lora_request=[None if n is None else _lora(adapters, n) for n in names])
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
        outs = engine.generate([PROMPTS[0]] * len(names), _greedy(), use_tqdm=False,
                               lora_request=[None if n is None else _lora(adapters, n) for n in names])
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
    model = get_peft_model(copy.deepcopy(hf), LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path / "lora")
    merged = model.merge_and_unload().eval()
    with LLM(model=str(tmp_path / "base"), dtype="float32", kv_cache_memory="4MiB", max_model_len=64, block_size=8,
             enable_lora=True, max_lora_rank=4) as engine:
        out = engine.generate([PROMPTS[1]], _greedy(), use_tqdm=False,
                              lora_request=LoRARequest("phi", 1, str(tmp_path / "lora")))[0]
    assert_greedy_matches(merged, PROMPTS[1], out.outputs[0], MAX_TOKENS)
