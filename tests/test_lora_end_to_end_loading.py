"""LoRA adapters as files and names, end to end: a llama.cpp GGUF LoRA file gives its PEFT
folder's outputs (its alpha taken as llama.cpp takes it); bad adapters (PEFT folders and GGUF
files), one id for two adapters and adapters without ``enable_lora`` fail with errors that name
the problem; the server serves adapters by model name, loads and unloads them while streams
run, and answers bad ones with 400. The adapters and the engine: ``lora_util``; their outputs
against peft's merged model: ``test_lora_end_to_end.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import openai
import pytest
import torch

from pagedllm import LLM, LoRARequest
from pagedllm.errors import InvalidParamError, LoRAError
from tests.lora_util import (  # noqa: F401 (adapters, base, llm: the fixtures)
    CHAT_TEMPLATE, LLAMA, MAX_TOKENS, PROMPTS, adapter_request, adapters, base, greedy, llm,
)
from tests.models_util import GGUF_NAMES, finish_gguf, llama_cpp_permute
from tests.server_util import API_KEY, start_server, stop_server, wait_idle
from tests.utils import assert_pool_whole


def test_one_id_for_two_adapters_in_a_batch_is_refused(llm, adapters) -> None:
    """A batch in which one id names two adapters is refused before anything runs (the second
    adapter's requests ran with the first's weights)."""
    a, b = adapter_request(adapters, "all"), adapter_request(adapters, "mlp_o")
    clash = LoRARequest(b.name, a.id, b.path)
    with pytest.raises(InvalidParamError, match=f"has the id {a.id} of another adapter") as e:
        llm.generate([PROMPTS[0], PROMPTS[1]], greedy(), use_tqdm=False, lora_request=[a, clash])
    assert e.value.param == "lora_request"
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate([PROMPTS[0]] * 2, greedy(), use_tqdm=False, lora_request=[a, LoRARequest(a.name, a.id, a.path)])
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids  # equal requests of one adapter run


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
        llm.generate([PROMPTS[0]], greedy(), use_tqdm=False, lora_request=LoRARequest("bad", 50, str(path)))
    assert llm.generate([PROMPTS[0]], greedy(2), use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_corrupt_and_missing_files(llm, adapters, tmp_path) -> None:
    good = adapters["all"][0]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_bytes((good / "adapter_config.json").read_bytes())
    (corrupt / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes()[:200])
    with pytest.raises(LoRAError, match="cannot read .*adapter_model.safetensors"):
        llm.generate([PROMPTS[0]], greedy(), use_tqdm=False, lora_request=LoRARequest("c", 60, str(corrupt)))
    (corrupt / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="cannot read .*adapter_config.json"):
        llm.generate([PROMPTS[0]], greedy(), use_tqdm=False, lora_request=LoRARequest("c", 61, str(corrupt)))
    with pytest.raises(LoRAError, match="is neither a PEFT adapter folder nor a GGUF file"):
        llm.generate([PROMPTS[0]], greedy(), use_tqdm=False, lora_request=LoRARequest("m", 62, str(tmp_path / "no")))
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
    outs = llm.generate([PROMPTS[1]] * 2, greedy(), use_tqdm=False,
                        lora_request=[adapter_request(adapters, "all"), LoRARequest("all-gguf", 70, str(path))])
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
            llm.generate([PROMPTS[0]], greedy(), use_tqdm=False, lora_request=LoRARequest("bad", 71 + i, str(bad)))
    assert_pool_whole(llm.engine.core)


def test_gguf_adapter_scale_is_alpha_over_rank_without_rslora(llm, adapters, tmp_path) -> None:
    """A GGUF LoRA file has no rsLoRA flag: its adapter.lora.alpha is taken as llama.cpp takes
    it, scale alpha / r. The rsLoRA adapter "qv_rslora" (r 4, alpha 8: PEFT's scale 8 / sqrt(4)
    = 4) written with its alpha as llama.cpp's converter keeps it gets 8 / 4 = 2 and other
    logprobs than its folder; written with alpha 8 sqrt(4) = 16 it gives the folder's exactly."""
    folder = adapters["qv_rslora"][0]
    kept = _write_gguf_adapter(tmp_path / "kept.gguf", folder, 8.0)
    rescaled = _write_gguf_adapter(tmp_path / "rescaled.gguf", folder, 8.0 * math.sqrt(4))
    outs = llm.generate([PROMPTS[1]] * 3, greedy(), use_tqdm=False, lora_request=[
        adapter_request(adapters, "qv_rslora"), LoRARequest("kept", 80, str(kept)),
        LoRARequest("rescaled", 81, str(rescaled)),
    ])
    folder_out, kept_out, rescaled_out = (o.outputs[0] for o in outs)

    def logprobs(o) -> list[float]:
        return [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)]

    assert rescaled_out.token_ids == folder_out.token_ids
    assert logprobs(rescaled_out) == logprobs(folder_out)
    assert logprobs(kept_out) != logprobs(folder_out)
    assert_pool_whole(llm.engine.core)


def test_lora_request_without_enable_lora_is_refused(base, adapters) -> None:
    _, path = base
    engine = LLM(model=str(path), dtype="float32", kv_cache_memory="4MiB", max_model_len=64, block_size=8)
    with pytest.raises(InvalidParamError, match="enable-lora"):
        engine.generate([PROMPTS[0]], greedy(), use_tqdm=False, lora_request=adapter_request(adapters, "all"))
    engine.shutdown()


# -- the server -------------------------------------------------------------------------------

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
    """The offline engine's greedy text (``test_lora_end_to_end.py`` tests it against peft's merged model)."""
    return llm.generate([prompt], greedy(), use_tqdm=False, lora_request=lora)[0].outputs[0].text


def test_server_selects_adapters_by_model(server, llm, base, adapters) -> None:
    _, path = base
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {str(path), "all", "qv"}
    assert models["all"].parent == str(path) and models["all"].root == str(adapters["all"][0])
    assert models["qv"].parent == "qv-base"  # the JSON form's base_model_name
    assert getattr(models[str(path)], "parent", None) is None
    for model, lora in ((str(path), None), ("all", adapter_request(adapters, "all")),
                        ("qv", adapter_request(adapters, "qv_rslora"))):
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
    assert out.choices[0].text == _text(llm, PROMPTS[0], adapter_request(adapters, "mlp_o"))
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "all"}).status_code == 200
    for i, s in enumerate(streams):
        texts[i] += "".join(chunk.choices[0].text for chunk in s)
    assert texts == [_text(llm, PROMPTS[2], adapter_request(adapters, "all")), _text(llm, PROMPTS[2], None)]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="all", prompt=PROMPTS[0], max_tokens=2)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "all"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    # Loaded again under its name: served again, with its own id.
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": str(adapters["all"][0])})
    assert r.status_code == 200
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
    unauthorized = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"})
    assert unauthorized.status_code == 401
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "never"}).status_code == 404
    r = http.post("/v1/completions", json={"model": "big", "prompt": PROMPTS[0], "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
