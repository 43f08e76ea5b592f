"""Tensor parallelism inside the models: tiny random llama, qwen2 and gemma3 models sharded over
2 and 3 spawned ranks (gloo) give rank 0 the unsharded model's logits through a paged KV cache;
shards loaded as read, GGUF blocks included; the sizes a model splits into."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
import transformers

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.distributed.sharding import ModelShard, check_tensor_parallel_size
from pagedllm.kernels import library
from pagedllm.quantization_config import QuantizationConfig
from pagedllm.models.gguf_linears import gguf_linears
from pagedllm.models.gguf_file import GGUFFile
from pagedllm.models.gguf_loader import gguf_config
from pagedllm.models.loader import load_model, resolve_model
from tests.models_util import gemma3_config, randomize_vectors, tiny_gemma3, tiny_llama, write_q4_gguf
from tests.tensor_parallel_ranks import Case, reference, run_group

ATOL = 1e-4
# The sharded integer GEMMs see the same weight codes (per-row scales from the whole rows) and
# quantize the same activation groups (row-parallel inputs split on whole groups of 32): only
# the all-reduce's order of additions differs (1e-7 here), unless it moves an activation
# across a rounding boundary. int8 (weight-only) runs PyTorch's int8 GEMM on bfloat16
# activations: the shards' partial sums round at bfloat16's step (1 / 128 at the logits' size).
QUANT_ATOL, INT8_ATOL = 1e-3, 1e-2


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    """Tiny checkpoints: llama (tied, 12 heads / 6 KV: split at 2 and 3), qwen2 (untied, q/k/v
    bias, 6 heads / 2 KV), qwen3 (q/k head norms, replicated; head_dim 64 of hidden 384 / 4
    heads), phi3 (fused q/k/v and gate/up in the checkpoint; a window on every layer), gemma3
    (1 KV head, replicated; sliding windows; soft-capped logits), and a 4-bit GGUF llama.
    Vocabularies that do not divide by the sizes (padded gathers)."""
    root = tmp_path_factory.mktemp("tp")
    torch.manual_seed(0)
    common = {"hidden_size": 384, "intermediate_size": 192, "num_hidden_layers": 2}
    llama = tiny_llama(vocab_size=250, num_attention_heads=12, num_key_value_heads=6, tie_word_embeddings=True, **common)
    llama.save_pretrained(root / "llama")
    qwen2_config = transformers.Qwen2Config(
        vocab_size=253, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False,
        max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-6, eos_token_id=[3, 4], **common,
    )
    qwen2 = transformers.Qwen2ForCausalLM(qwen2_config).eval()
    randomize_vectors(qwen2, qwen2_config.hidden_size)
    qwen2.save_pretrained(root / "qwen2")
    # 6 query heads (still 1 KV head) and soft-capped logits.
    gemma = tiny_gemma3(vocab_size=131, hidden_size=96, intermediate_size=192, num_attention_heads=6,
                        final_logit_softcapping=1.0)
    gemma_config = dataclasses.replace(gemma3_config(gemma.config), final_logit_softcapping=1.0)
    torch.save((gemma_config, gemma.state_dict()), root / "gemma3.pt")
    small = {**common, "hidden_size": 256}
    llama_q4 = tiny_llama(vocab_size=250, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **small)
    write_q4_gguf(root / "llama-q4.gguf", llama_q4)
    # After the others: their random weights stay as they were.
    qwen3_config = transformers.Qwen3Config(
        vocab_size=247, num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
        max_position_embeddings=256, rms_norm_eps=1e-6, **common,
    )
    qwen3 = transformers.Qwen3ForCausalLM(qwen3_config).eval()
    randomize_vectors(qwen3, qwen3_config.hidden_size)
    qwen3.save_pretrained(root / "qwen3")
    phi3_config = transformers.Phi3Config(
        vocab_size=251, num_attention_heads=6, num_key_value_heads=2, sliding_window=5, pad_token_id=0,
        max_position_embeddings=256, rms_norm_eps=1e-6, **common,
    )
    phi3 = transformers.Phi3ForCausalLM(phi3_config).eval()
    randomize_vectors(phi3, phi3_config.hidden_size)
    phi3.save_pretrained(root / "phi3")
    return {
        "llama": Case("llama", str(root / "llama")),
        "qwen2": Case("qwen2", str(root / "qwen2")),
        "qwen3": Case("qwen3", str(root / "qwen3")),
        "phi3": Case("phi3", str(root / "phi3")),
        "gemma3": Case("gemma3", state=str(root / "gemma3.pt")),
        # --dtype auto's settings: 4-bit blocks kept as w4a8, the rest and the lm_head w8a8.
        "llama-q4-w4a8": Case("llama-q4-w4a8", str(root / "llama-q4.gguf"), ("w4a8", 32, True, False)),
        "qwen2-w8a8": Case("qwen2-w8a8", str(root / "qwen2"), ("w8a8", 32, True)),
        "qwen2-int8": Case("qwen2-int8", str(root / "qwen2"), ("int8", 32, True)),
    }


FLOAT_RUNS = [("llama", 2), ("llama", 3), ("qwen2", 2), ("qwen3", 2), ("phi3", 2), ("gemma3", 2), ("gemma3", 3)]
QUANT_RUNS = [("llama-q4-w4a8", 2), ("qwen2-w8a8", 2), ("qwen2-int8", 2)]


@pytest.fixture(scope="module")
def runs(cases: dict[str, Case], tmp_path_factory: pytest.TempPathFactory):
    """(reference logits by case, a function size -> rank 0's logits by case), each group run once."""
    quant = [name for name, _ in QUANT_RUNS] if library.available() else []
    names = [name for name, _ in FLOAT_RUNS] + quant
    ref = reference([cases[n] for n in dict.fromkeys(names)])

    @functools.cache
    def group(size: int) -> dict[str, torch.Tensor | str]:
        run = [cases[n] for n, s in FLOAT_RUNS + QUANT_RUNS if s == size and n in names]
        return run_group(run, size, tmp_path_factory.mktemp(f"tp{size}") / "logits.pt")

    return ref, group


def _sharded_logits(runs, name: str, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    ref, group = runs
    got = group(size).get(name)
    assert isinstance(got, torch.Tensor), got or f"{name} did not run"
    assert got.shape == ref[name].shape and got.dtype == torch.float32
    return got, ref[name]


@pytest.mark.parametrize(("name", "size"), FLOAT_RUNS)
def test_float32_shards_give_rank0_the_unsharded_logits(runs, name: str, size: int) -> None:
    got, expected = _sharded_logits(runs, name, size)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("name", "size"), QUANT_RUNS)
def test_quantized_shards_close_to_the_unsharded_logits(runs, name: str, size: int) -> None:
    if not library.available():
        pytest.skip("the native kernels' integer GEMMs do not run here")
    got, expected = _sharded_logits(runs, name, size)
    torch.testing.assert_close(got, expected, atol=INT8_ATOL if name.endswith("-int8") else QUANT_ATOL, rtol=0)


# --- loading shards --------------------------------------------------------------------------


def test_shards_are_the_checkpoint_slices(cases: dict[str, Case], monkeypatch) -> None:
    """Each rank's fused q/k/v and gate/up rows, o_proj/down_proj columns and vocabulary rows
    are its parts of the whole model's (no process group: loading runs no collective)."""
    monkeypatch.setattr(library, "available", lambda: False)  # keep nn.Linear weights to compare
    resolved = resolve_model(cases["qwen2"].path)
    whole, config = load_model(resolved, torch.float32)
    d, kv = config.head_dim, config.num_kv_heads * config.head_dim
    q_size, inter = config.num_heads * d, config.intermediate_size
    for rank in range(2):
        model, _ = load_model(resolved, torch.float32, tp=TPGroup(rank, 2))
        q, k = slice(rank * q_size // 2, (rank + 1) * q_size // 2), slice(rank * kv // 2, (rank + 1) * kv // 2)
        f = slice(rank * inter // 2, (rank + 1) * inter // 2)
        v = slice(-(-config.vocab_size // 2) * rank, -(-config.vocab_size // 2) * (rank + 1))
        a, b = whole.layers[1].self_attn, model.layers[1].self_attn
        for param in ("weight", "bias"):
            full = getattr(a.qkv_proj, param)
            parts = [full[:q_size][q], full[q_size : q_size + kv][k], full[q_size + kv :][k]]
            assert torch.equal(getattr(b.qkv_proj, param), torch.cat(parts))
        assert torch.equal(b.o_proj.weight, a.o_proj.weight[:, q])
        mlp, whole_mlp = model.layers[0].mlp, whole.layers[0].mlp
        gate_up = whole_mlp.gate_up_proj.weight
        assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate_up[:inter][f], gate_up[inter:][f]]))
        assert torch.equal(mlp.down_proj.weight, whole_mlp.down_proj.weight[:, f])
        assert torch.equal(model.embed_tokens.weight, whole.embed_tokens.weight[v])
        assert torch.equal(model.lm_head.weight, whole.lm_head.weight[v])
        assert torch.equal(model.norm.weight, whole.norm.weight)


def test_kept_gguf_blocks_are_sliced_by_rows_and_whole_blocks(cases: dict[str, Case], monkeypatch) -> None:
    """A rank's kept blocks (q/k rows unpermuted first) hold exactly its float shard's weights."""
    monkeypatch.setattr(library, "available", lambda: False)
    path = cases["llama-q4-w4a8"].path
    f = GGUFFile(path)
    config = gguf_config(f)
    quant = QuantizationConfig("int8", lm_head=True)
    for rank in range(2):
        tp = TPGroup(rank, 2)
        model, _ = load_model(resolve_model(path), torch.float32, tp=tp)
        kept = gguf_linears(f, config, quant, tp).kept
        assert {"layers.0.self_attn.o_proj", "layers.1.mlp.down_proj", "lm_head"} <= set(kept)
        for name, weight in kept.items():
            module = model.embed_tokens if name == "lm_head" else model.get_submodule(name)
            assert torch.equal(weight.dequantize(), module.weight), name


# --- sizes -----------------------------------------------------------------------------------


def _config(heads: int, kv: int, intermediate: int, head_dim: int = 64, name: str = "") -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=1000, hidden_size=heads * head_dim, intermediate_size=intermediate,
        num_layers=1, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rope_theta=1e4, rms_norm_eps=1e-5,
        max_position_embeddings=128, tie_word_embeddings=True, name=name,
    )


def test_sizes_that_do_not_split_the_model_name_those_that_do() -> None:
    smollm2 = _config(9, 3, 1536, name="SmolLM2")
    with pytest.raises(ValueError, match="^tensor_parallel_size 2 does not divide SmolLM2's 9 attention heads; sizes that work: 1, 3$"):
        check_tensor_parallel_size(smollm2, 2, quantized=True)
    check_tensor_parallel_size(smollm2, 3, quantized=True)
    gemma = _config(4, 1, 2048, head_dim=256)
    check_tensor_parallel_size(gemma, 2, quantized=True)  # its one KV head replicated
    with pytest.raises(ValueError, match="neither divides nor is a multiple of the model's 2 KV heads; sizes that work: 1, 2, 4, 6, 12$"):
        check_tensor_parallel_size(_config(12, 2, 1536), 3, quantized=False)
    with pytest.raises(ValueError, match="intermediate size 90"):
        check_tensor_parallel_size(_config(4, 4, 90), 4, quantized=False)
    # 4 ranks give o_proj 48 inputs each: fine for float32, not for 32-wide quantization groups.
    narrow = _config(8, 8, 1024, head_dim=24)
    check_tensor_parallel_size(narrow, 4, quantized=False)
    with pytest.raises(ValueError, match="48 inputs to the model's attention output.*sizes that work: 1, 2$"):
        check_tensor_parallel_size(narrow, 4, quantized=True)


def test_kv_heads_split_or_replicate_as_vllm() -> None:
    config = _config(8, 2, 512)
    assert [(s.heads_start, s.num_heads, s.kv_heads_start, s.num_kv_heads) for s in (
        ModelShard.of(config, TPGroup(r, 4)) for r in range(4)
    )] == [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]
    shards = [ModelShard.of(config, TPGroup(r, 3)) for r in range(3)]
    assert [(s.vocab_start, s.vocab_rows, s.vocab_padded) for s in shards] == [(0, 334, 334), (334, 334, 334), (668, 332, 334)]


@pytest.mark.slow
def test_default_model_at_three_ranks(tmp_path: Path) -> None:
    """The real SmolLM2 GGUF (9 heads, 3 KV heads) in float32 at 3 ranks: the same greedy
    tokens as 1 rank, logits (up to 35) within float32 rounding of 30 layers' sums (1.5e-4 seen)."""
    case = Case("smollm2", str(resolve_model("smollm2").path))
    expected = reference([case])["smollm2"]
    got = run_group([case], 3, tmp_path / "logits.pt")["smollm2"]
    assert isinstance(got, torch.Tensor), got
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
