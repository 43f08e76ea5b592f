"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers, and the fused MoE
kernel (``csrc/moe.cpp``) against PyTorch on every ISA this CPU runs.

Tiny random checkpoints built from transformers' own classes, saved with ``save_pretrained``
next to SmolLM2's tokenizer and as GGUF files written the way llama.cpp's converter does
(experts stacked 3-D): greedy tokens equal to ``generate``'s in float32 until the first
near-tie through chunked prefill, prefix caching, preemption and n-gram speculation; shards
over 2 ranks give the unsharded logits."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import SINGLE, TPGroup
from pagedllm.distributed.sharding import ModelShard, check_tensor_parallel_size
from pagedllm.kernels import kquant, library
from pagedllm.kernels.moe import fused_moe
from pagedllm.layers.fused_moe import FusedMoE, route
from pagedllm.layers.linear import PackedLinear
from pagedllm.layers.quantization.linear import KQuantLinear, Q8A8Linear, W4A8Linear, W8A8Linear
from pagedllm.layers.quantization.weights import quantize_q4a8
from pagedllm.models.loader import load_config, load_model, resolve_model
from pagedllm.models import gguf_file, gguf_loader, native_decoder
from pagedllm.models.gguf_linears import gguf_linears
from pagedllm.models.moe import MoEForCausalLM
from pagedllm.models.native_decoder import NativeDecoder
from pagedllm.platforms.cpu import auto_linears
from pagedllm.quantization_config import QuantizationConfig
from tests.models_util import (
    GGUF_NAMES, assert_greedy_matches, finish_gguf, gguf_writer, llama_cpp_permute, prefill_logits,
    random_weight_blocks, randomize_vectors, shared_prefix_prompts,
)
from tests.tensor_parallel_ranks import Case, load, reference, run_group, run_steps
from tests.utils import assert_holds_blocks, pool_is_whole

MAX_TOKENS = 16
WINDOW = 12  # Mixtral's: shorter than the longer prompts
_SHARED, PROMPTS = shared_prefix_prompts(7, 24, (5, 9, 17))
COMMON = dict(
    vocab_size=256, hidden_size=128, num_hidden_layers=3, max_position_embeddings=256, rms_norm_eps=1e-6,
    initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2,
)
# Head size 64 (the native decode attention's smallest): the one-call decoder runs the decode
# steps. Qwen3-MoE: 8 experts, the top-2 weights left unnormalized, layer 1 dense (its
# ``mlp_only_layers``). Mixtral: 4 experts, a sliding window on every layer.
CONFIG_ARGS = {
    "qwen3_moe": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=192, moe_intermediate_size=64,
        num_experts=8, norm_topk_prob=False, mlp_only_layers=[1], rope_theta=1e6,
    ),
    "mixtral": dict(
        num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, num_local_experts=4,
        sliding_window=WINDOW, rope_theta=1e4,
    ),
}
CONFIG_CLASSES = {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig}
CONFIGS = {arch: lambda arch=arch, **changes: CONFIG_CLASSES[arch](**(COMMON | CONFIG_ARGS[arch] | changes)) for arch in CONFIG_ARGS}
HF_CLASSES = {"qwen3_moe": transformers.Qwen3MoeForCausalLM, "mixtral": transformers.MixtralForCausalLM}



@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """(architecture, HF model, checkpoint directory)."""
    arch, path = request.param, tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf = HF_CLASSES[arch](CONFIGS[arch]()).eval()
    randomize_vectors(hf)  # transformers unit-inits the norms (q/k norms included)
    hf.save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    return arch, hf, path


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
    llm = LLM(
        model=str(path), dtype="float32", kv_cache_memory="8MiB", max_model_len=128, block_size=8,
        max_num_batched_tokens=16, enable_prefix_caching=True,
    )
    first = llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False)
    hits = llm.engine.core.kv_cache.prefix_hits
    first += llm.generate(PROMPTS[2:], PARAMS, use_tqdm=False)
    assert llm.engine.core.kv_cache.prefix_hits - hits >= 16  # the shared 24 tokens' full blocks
    if library.available():
        assert isinstance(llm.engine.core.executor.runner.model.native_decoder, NativeDecoder)
    for prompt, out in zip(PROMPTS, first, strict=True):
        assert_greedy_matches(hf, prompt, out.outputs[0], MAX_TOKENS)
    again = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert pool_is_whole(llm)
    llm.shutdown()


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


# --- GGUF, written as llama.cpp's converter writes these models --------------------------


def _write_gguf(path: Path, hf: torch.nn.Module) -> None:
    """An F32 GGUF of a Qwen3-MoE ("qwen3moe") or Mixtral ("llama" with experts) model: the
    experts stacked as ``ffn_{gate,up,down}_exps`` [E, rows, columns], the router
    ``ffn_gate_inp``; Mixtral's q/k rows permuted as for llama, its window in the metadata."""
    c = hf.config
    qwen = c.model_type == "qwen3_moe"
    writer = gguf_writer(path, "qwen3moe" if qwen else "llama", c)
    writer.add_expert_count(c.num_experts if qwen else c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    if c.sliding_window:  # Mixtral's, on every layer
        writer.add_sliding_window(c.sliding_window)
    if qwen:
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_weights_norm(c.norm_topk_prob)
    for name, tensor in hf.state_dict().items():
        w = tensor.numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            top = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm"}
            writer.add_tensor(f"{top.get(name, 'output')}.weight", w)
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            gate, up = np.split(w, 2, axis=1)
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
            continue
        if rest == "mlp.experts.down_proj":
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", w)
            continue
        module, _, suffix = rest.rpartition(".")
        if not qwen and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = c.num_attention_heads if "q_proj" in module else c.num_key_value_heads
            w = llama_cpp_permute(w, heads)
        writer.add_tensor(f"blk.{layer}.{GGUF_NAMES[module]}.{suffix}", np.ascontiguousarray(w))
    finish_gguf(writer)


def test_gguf_as_llama_cpp_writes_it_matches_transformers(tiny, tmp_path: Path) -> None:
    arch, hf, _ = tiny
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(path, hf)
    model, config = load_model(resolve_model(str(path)), torch.float32)
    assert (config.architecture, config.num_experts_per_tok) == (arch, 2)
    assert config.dense_mlp_layers == ([1] if arch == "qwen3_moe" else [])
    assert config.norm_topk_prob == (arch == "mixtral")
    ids = PROMPTS[2]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(model, config, ids), expected, atol=5e-4, rtol=0)


def _q8_0(w: np.ndarray) -> np.ndarray:
    """Q8_0 blocks of w (any leading dims; the last a multiple of 32)."""
    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)


def _assert_layers_match_on_our_inputs(
    hf: torch.nn.Module, model: torch.nn.Module, config, ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of our layers that runs GGUF blocks (``KQuantLinear``, ``Q8A8Linear``, ``W4A8Linear``) and each MoE
    block, on the inputs our prefill of ``ids`` gave it, equals transformers' (the file's
    weights: gguf.quants' dequantization) on the same inputs within int8 activations' rounding;
    an MoE block on the same experts as ours.

    Layer by layer, not on the logits: a random tiny model amplifies the activations' rounding
    through its layers unevenly (Mixtral's, without q/k norms, attends almost one-hot, so a
    rounding can move a token's attention to another key), and a router near a tie may pick
    another expert for the rounded input: discrete changes no tolerance on the logits bounds.
    Transformers' router keeps its own weights for our experts (``route`` recomputes our choice
    from the block's input in float32, as the kernel's router: sums in another order could
    flip only a tie within float32 rounding)."""
    records: list[tuple[str, torch.nn.Module, torch.Tensor, torch.Tensor]] = []

    def record(name: str):
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor], out: torch.Tensor) -> None:
            records.append((name, module, args[0].float().clone(), out.float().clone()))
        return hook

    hooks = [
        module.register_forward_hook(record(name)) for name, module in model.named_modules()
        if isinstance(module, FusedMoE)
        or (isinstance(module, KQuantLinear | Q8A8Linear | W4A8Linear) and ".experts." not in name)
    ]
    try:
        prefill_logits(model, config, ids)
    finally:
        for hook in hooks:
            hook.remove()
    assert any(isinstance(m, FusedMoE) for _, m, _, _ in records)

    def forced(gate: torch.nn.Module, experts: torch.Tensor, renormalize: bool):
        def forward(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.weight.shape[1]), gate.weight)
            weights = logits.float().softmax(-1).gather(-1, experts)
            if renormalize:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights, experts
        return forward

    with torch.inference_mode():
        for name, module, x, y in records:
            if isinstance(module, FusedMoE):
                logits = torch.nn.functional.linear(x, module.gate.weight.float())
                experts = route(logits, module.top_k, module.renormalize)[1]
                block = hf.model.layers[int(name.split(".")[1])].mlp
                with monkeypatch.context() as mp:
                    mp.setattr(block.gate, "forward", forced(block.gate, experts, module.renormalize))
                    expected = block(x[None])[0]
            else:
                prefix, _, last = name.rpartition(".")
                parts = model.packed_modules_mapping.get(last, [last])
                weight = torch.cat([hf.get_parameter(".".join(filter(None, ["model" * bool(prefix), prefix, p, "weight"]))) for p in parts])
                expected = x @ weight.T
            error = ((y - expected).norm() / expected.norm()).item()
            # int8 activations (1% typical); an expert or a part's rows out of place: ~100%.
            assert error < 0.02, (name, error)


def test_q8_0_gguf_runs_every_matrix_as_stored(tiny, tmp_path: Path, monkeypatch) -> None:
    """``--dtype auto`` on a Q8_0 file (llama.cpp's router left F32) at the tiny widths (experts
    of 64): attention, the dense MLP, the lm_head and each expert run from the file's blocks
    (the K-quant GEMM; the experts inside ``csrc/moe.cpp``); the one-call decoder gives the
    modules' logits bit for bit; each layer stays within int8 activations' rounding of
    transformers' on the file's own weights (``_assert_layers_match_on_our_inputs``)."""
    if not library.available() or auto_linears() == "float32":
        pytest.skip("GGUF blocks as stored need the native kernels (not scalar)")
    arch, hf, _ = tiny
    hf = copy.deepcopy(hf)
    with torch.no_grad():  # the file's weights exactly: each matrix through Q8_0 and back
        for name, p in hf.named_parameters():
            if p.ndim >= 2 and not name.endswith("mlp.gate.weight"):
                q8 = gguf.quants.dequantize(_q8_0(p.numpy()), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(q8).view(p.shape))
    add_tensor = gguf.GGUFWriter.add_tensor

    def add_q8_0(self, name: str, tensor: np.ndarray, **kwargs) -> None:
        if tensor.ndim < 2 or "ffn_gate_inp" in name:
            return add_tensor(self, name, tensor, **kwargs)
        return add_tensor(self, name, _q8_0(tensor), raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    path = tmp_path / f"{arch}-q8_0.gguf"
    with monkeypatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", add_q8_0)
        _write_gguf(path, hf)
    model, config = load(Case(arch, str(path), ("w4a8", 32, True, False)), SINGLE)  # what --dtype auto sets
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    stored = [model.lm_head] + [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)]
    stored += [m for i in dense for m in (model.layers[i].mlp.gate_up_proj, model.layers[i].mlp.down_proj)]
    as_stored = KQuantLinear | Q8A8Linear  # the file's codes and scales, on the K-quant GEMM or w8a8's panels
    assert all(isinstance(m, as_stored) for m in stored)
    moe = model.layers[0].mlp
    assert isinstance(moe, FusedMoE) and moe.gate.weight.dtype == torch.float32
    assert all(isinstance(m, as_stored) for e in moe.experts for m in (e.gate_up_proj, e.down_proj))
    assert moe.native_block() is not None and NativeDecoder.of(model) is not None
    _assert_one_call_and_layers_match(hf, model, config, monkeypatch)


def _assert_one_call_and_layers_match(hf, model, config, monkeypatch) -> None:
    """The fixed schedule's decode-only steps run in one native call and equal the modules' bit
    for bit; each layer matches transformers' on our inputs."""
    calls = []
    decode_layers = native_decoder.decode_layers
    monkeypatch.setattr(native_decoder, "decode_layers", lambda *a: calls.append(1) or decode_layers(*a))
    got = run_steps(model, config, SINGLE)
    assert calls
    model.native_decoder = False
    torch.testing.assert_close(got, run_steps(model, config, SINGLE), atol=0, rtol=0)
    _assert_layers_match_on_our_inputs(hf, model, config, PROMPTS[2], monkeypatch)


# The experts of a Q4_K_M-like file, per MoE layer (gate, up, down): K-quants and the other
# formats kept as stored, and Q4_0 / Q4_1 (kept as w4a8, the same codes and scales).
Q = gguf.GGMLQuantizationType
_EXPERT_TYPES = {
    "qwen3_moe": {0: (Q.Q4_K, Q.Q4_K, Q.Q6_K), 2: (Q.Q5_K, Q.Q4_K, Q.Q8_0)},
    "mixtral": {0: (Q.Q4_K, Q.Q5_K, Q.Q6_K), 1: (Q.Q4_0, Q.Q4_0, Q.Q4_1), 2: (Q.Q8_0, Q.Q8_0, Q.Q5_0)},
}
_STORED = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q5_0)


def _expert_gguf(arch: str, path: Path, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """A random model of the architecture at widths the K-quants take (hidden and expert width
    256) written to ``path`` as GGUF: experts as ``_EXPERT_TYPES``' blocks (3-D stacks), other
    matrices Q8_0, router and vectors F32. Returns the transformers model holding gguf.quants'
    dequantization of every block (the file's exact weights)."""
    torch.manual_seed(0)
    changes = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256)
    if arch == "mixtral":
        changes |= dict(num_attention_heads=4, num_key_value_heads=2)
    hf = HF_CLASSES[arch](CONFIGS[arch](**changes)).eval()
    randomize_vectors(hf)
    stacks: dict[str, tuple[Q, np.ndarray]] = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim == 2 and not name.endswith("mlp.gate.weight"):
                p.copy_(torch.from_numpy(gguf.quants.dequantize(_q8_0(p.numpy()), Q.Q8_0)).view(p.shape))
        for i, (gate_t, up_t, down_t) in _EXPERT_TYPES[arch].items():
            experts = hf.model.layers[i].mlp.experts
            num, rows, cols = experts.down_proj.shape
            seed = 10 * i
            gate, gate_w = random_weight_blocks(gate_t, (num, cols, rows), seed=seed)
            up, up_w = random_weight_blocks(up_t, (num, cols, rows), seed=seed + 1)
            down, down_w = random_weight_blocks(down_t, (num, rows, cols), seed=seed + 2)
            experts.gate_up_proj.copy_(torch.cat([gate_w, up_w], dim=1))
            experts.down_proj.copy_(down_w)
            for proj, qtype, blocks in (("gate", gate_t, gate), ("up", up_t, up), ("down", down_t, down)):
                stacks[f"blk.{i}.ffn_{proj}_exps.weight"] = (qtype, blocks)
    add_tensor = gguf.GGUFWriter.add_tensor

    def add_blocks(self, name: str, tensor: np.ndarray, **kwargs) -> None:
        if name in stacks:
            return add_tensor(self, name, stacks[name][1], raw_dtype=stacks[name][0])
        if tensor.ndim < 2 or "ffn_gate_inp" in name:
            return add_tensor(self, name, tensor, **kwargs)
        return add_tensor(self, name, _q8_0(tensor), raw_dtype=Q.Q8_0)

    with monkeypatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", add_blocks)
        _write_gguf(path, hf)
    return hf


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_gguf_experts_run_as_stored(arch: str, tmp_path: Path, monkeypatch) -> None:
    """``--dtype auto`` on a file whose experts are K-quant (and Q8_0 / Q5_0) 3-D stacks runs
    each expert from the file's own blocks, byte for byte, never dequantizing them at load
    (Q4_0 / Q4_1 experts keep their codes as w4a8); every MoE layer is one native call, the
    one-call decoder takes the model and gives the modules' logits bit for bit, and each layer
    stays within int8 activations' rounding of transformers' on gguf.quants' dequantization
    (``_assert_layers_match_on_our_inputs``)."""
    if not library.available() or auto_linears() == "float32":
        pytest.skip("GGUF blocks as stored need the native kernels (not scalar)")
    path = tmp_path / f"{arch}-experts.gguf"
    hf = _expert_gguf(arch, path, monkeypatch)
    dequantized: list[str] = []
    dequantize = gguf_file.GGUFFile.dequantize
    with monkeypatch.context() as mp:
        mp.setattr(gguf_file.GGUFFile, "dequantize", lambda f, name, *a: dequantized.append(name) or dequantize(f, name, *a))
        model, config = load(Case(arch, str(path), ("w4a8", 32, True, False)), SINGLE)  # what --dtype auto sets
    f = gguf_file.GGUFFile(path)
    for i, types in _EXPERT_TYPES[arch].items():
        moe = model.layers[i].mlp
        assert isinstance(moe, FusedMoE) and moe.native_block() is not None
        names = [f"blk.{i}.ffn_{proj}_exps.weight" for proj in ("gate", "up", "down")]
        if types[0] not in _STORED:
            assert all(isinstance(m, W4A8Linear) for e in moe.experts for m in (e.gate_up_proj, e.down_proj))
            continue
        assert not set(names) & set(dequantized)
        for e, expert in enumerate(moe.experts):
            expected = [(int(types[0]), f.blocks(names[0])[e]), (int(types[1]), f.blocks(names[1])[e])]
            if types[0] == types[1]:  # one part of both
                expected = [(int(types[0]), torch.cat([expected[0][1], expected[1][1]]))]
            assert_holds_blocks(expert.gate_up_proj, expected)
            assert_holds_blocks(expert.down_proj, [(int(types[2]), f.blocks(names[2])[e])])
    assert NativeDecoder.of(model) is not None
    _assert_one_call_and_layers_match(hf, model, config, monkeypatch)


def test_gguf_expert_shards_keep_whole_blocks(tmp_path: Path, monkeypatch) -> None:
    """At 2 ranks each expert's gate/up rows split and stay as stored; a down projection stays
    as stored where each rank's 128 columns are whole blocks of its format (Q8_0's 32, Q5_0's
    32) and is requantized where they cut a 256-weight super-block (Q6_K), its stack then
    dequantized at load like any requantized tensor."""
    if not library.available():
        pytest.skip("GGUF blocks as stored need the native kernels")
    path = tmp_path / "qwen3_moe-experts.gguf"
    _expert_gguf("qwen3_moe", path, monkeypatch)
    f = gguf_file.GGUFFile(path)
    out = gguf_linears(f, gguf_loader.gguf_config(f), QuantizationConfig("w4a8", 32, True, False), TPGroup(1, 2))
    layer0, layer2 = (f"layers.{i}.mlp.experts.5" for i in (0, 2))
    assert [(q, b.shape[0]) for q, b in out.kept[f"{layer0}.gate_up_proj"].parts] == [(int(Q.Q4_K), 256)]
    assert f"{layer0}.down_proj" not in out.kept
    assert [(q, b.shape[0]) for q, b in out.kept[f"{layer2}.gate_up_proj"].parts] == [(int(Q.Q5_K), 128), (int(Q.Q4_K), 128)]
    down = out.kept[f"{layer2}.down_proj"]
    assert (down.in_features, down.out_features) == (128, 256)
    # Rank 1's columns 128..255 of expert 5: the second half of each row's Q8_0 blocks.
    assert torch.equal(down.parts[0][1], f.blocks("blk.2.ffn_down_exps.weight")[5][:, 4:].flatten(1))
    assert "blk.0.ffn_down_exps.weight" not in out.stored_tensors
    assert {"blk.0.ffn_gate_exps.weight", "blk.2.ffn_down_exps.weight"} <= out.stored_tensors


# --- tensor parallelism --------------------------------------------------------------------

TP_CASES = [("qwen3_moe", None), ("mixtral", None), ("qwen3_moe", ("w8a8", 32, True)), ("mixtral", ("w4a8", 32, True))]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """(unsharded logits, rank 0's logits at 2 ranks) per case: float32 and quantized experts."""
    root = tmp_path_factory.mktemp("moe-tp")
    cases = []
    for arch, quant in TP_CASES:
        torch.manual_seed(0)
        hf = HF_CLASSES[arch](CONFIGS[arch]()).eval()
        randomize_vectors(hf)
        hf.save_pretrained(root / arch)
        cases.append(Case(f"{arch}-{quant[0] if quant else 'float32'}", str(root / arch), quant))
    return reference(cases), run_group(cases, 2, root / "logits.pt")


@pytest.mark.parametrize("name", [f"{a}-{q[0] if q else 'float32'}" for a, q in TP_CASES])
def test_two_ranks_give_the_unsharded_logits(tp_runs, name: str) -> None:
    """Each rank holds half of every expert's intermediate features and the whole router;
    quantized experts see the same codes and activation groups (only the sum order differs)."""
    expected, got = tp_runs
    assert not isinstance(got[name], str), got[name]
    torch.testing.assert_close(got[name], expected[name], atol=1e-4 if "float32" in name else 1e-3, rtol=0)


def test_expert_shards_split_the_expert_width(tiny) -> None:
    arch, _, path = tiny
    config = load_config(resolve_model(str(path)))
    shard = ModelShard.of(config, TPGroup(1, 2))
    assert shard.split_of("layers.0.mlp.experts.3.gate_proj.weight") == (0, 32, 64)
    assert shard.split_of("layers.0.mlp.experts.3.down_proj.weight") == (1, 32, 64)
    assert shard.split_of("layers.0.mlp.gate.weight") is None  # the router: replicated
    if arch == "qwen3_moe":  # the dense layer splits its own width
        assert shard.split_of("layers.1.mlp.up_proj.weight") == (0, 96, 192)
    check_tensor_parallel_size(config, 2, True)
    with pytest.raises(ValueError, match="experts' down projection"):  # 48 of each expert's 96 per rank
        check_tensor_parallel_size(dataclasses.replace(config, moe_intermediate_size=96), 2, True)


# --- the fused kernel --------------------------------------------------------------------------

HIDDEN, INTER, EXPERTS = 96, 80, 8  # neither a multiple of the 32-column panels


def _block(kind: str, renormalize: bool) -> FusedMoE:
    """8 random experts, top-2, each on our packed kernels: ``kind`` float32 | w8a8 | w4a8 |
    mixed (the kinds in turn)."""
    torch.manual_seed(1)
    moe = FusedMoE(HIDDEN, INTER, EXPERTS, 2, renormalize, torch.float32)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.3)
    kinds = ["float32", "w8a8", "w4a8"]
    for e, expert in enumerate(moe.experts):
        expert_kind = kinds[e % 3] if kind == "mixed" else kind
        for name in ("gate_up_proj", "down_proj"):
            weight = torch.randn(getattr(expert, name).weight.shape) * 0.2
            layer = {
                "float32": lambda w: PackedLinear(w, None),
                "w8a8": W8A8Linear,
                "w4a8": lambda w: W4A8Linear(quantize_q4a8(w)),
            }[expert_kind](weight)
            setattr(expert, name, layer)
    return moe


@pytest.mark.parametrize("kind", ["float32", "w8a8", "w4a8", "mixed"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_kernel_matches_the_experts_one_by_one(native_isa: str, kind: str, renormalize: bool) -> None:
    """One native call equals PyTorch's routing and each active expert's own layer on its
    tokens; at 1 and 3 tokens most experts get none, at 80 every one gets some."""
    moe = _block(kind, renormalize)
    gen = torch.Generator().manual_seed(2)
    block = moe.native_block()
    assert block is not None
    for tokens in (1, 3, 80):
        x = torch.randn(tokens, HIDDEN, generator=gen)
        _, experts = route(torch.nn.functional.linear(x, moe.gate.weight), 2, renormalize)
        assert (experts.unique().numel() < EXPERTS) == (tokens < 80)
        got = fused_moe(block, x)
        torch.testing.assert_close(got, moe._forward_experts(x), atol=1e-5, rtol=1e-5)
        # Batch-invariant: each token alone gives its row.
        torch.testing.assert_close(fused_moe(block, x[-1:]), got[-1:], atol=0, rtol=0)


# Experts as GGUF blocks (gate, up, down types; None: w8a8, a packed kind beside them).
_BLOCK_EXPERTS = [(Q.Q4_K, Q.Q5_K, Q.Q6_K), (Q.Q6_K, Q.Q6_K, Q.Q4_K), (Q.Q8_0, Q.Q5_0, Q.Q8_0), None]


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_kernel_with_gguf_block_experts(native_isa: str, renormalize: bool) -> None:
    """Experts run from GGUF blocks as stored (a gate/up of two formats, a down of a third),
    mixed with w8a8 ones: one native call equals each active expert's own layer on its
    tokens, is batch-invariant, and stays within int8 activations' rounding of the float
    formula on gguf.quants' dequantized weights."""
    size, experts = 256, 8  # the K-quants' super-block
    torch.manual_seed(4)
    moe = FusedMoE(size, size, experts, 2, renormalize, torch.float32)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.1)
    dense = []
    for e, expert in enumerate(moe.experts):
        types = _BLOCK_EXPERTS[e % len(_BLOCK_EXPERTS)]
        if types is None:
            weights = [torch.randn(2 * size, size) * 0.1, torch.randn(size, size) * 0.1]
            expert.gate_up_proj, expert.down_proj = W8A8Linear(weights[0]), W8A8Linear(weights[1])
            dense.append(weights)
            continue
        (gate, gate_w), (up, up_w), (down, down_w) = (
            random_weight_blocks(t, (size, size), seed=3 * e + j) for j, t in enumerate(types)
        )
        parts = [(int(types[0]), torch.from_numpy(gate)), (int(types[1]), torch.from_numpy(up))]
        expert.gate_up_proj = KQuantLinear(kquant.StoredWeight(parts, size))
        expert.down_proj = KQuantLinear(kquant.StoredWeight([(int(types[2]), torch.from_numpy(down))], size))
        dense.append([torch.cat([gate_w, up_w]), down_w])
    block = moe.native_block()
    assert block is not None
    gen = torch.Generator().manual_seed(5)
    for tokens in (1, 3, 80):
        x = torch.randn(tokens, size, generator=gen)
        got = fused_moe(block, x)
        torch.testing.assert_close(got, moe._forward_experts(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused_moe(block, x[-1:]), got[-1:], atol=0, rtol=0)
        weights, chosen = route(torch.nn.functional.linear(x, moe.gate.weight), 2, renormalize)
        exact = torch.zeros(tokens, size, dtype=torch.float64)
        for t in range(tokens):
            for j in range(2):
                gate_up, down = (w.double() for w in dense[chosen[t, j]])
                gate, up = (gate_up @ x[t].double()).chunk(2)
                exact[t] += weights[t, j].double() * (down @ (torch.nn.functional.silu(gate) * up))
        assert (got.double() - exact).norm() / exact.norm() < 0.02  # int8 activations (and w8a8 weights)


def test_fused_kernel_float32_matches_dense_pytorch(native_isa: str) -> None:
    """Float32 experts against the plain formula: softmax, top-2, SwiGLU, weighted sum."""
    moe = _block("float32", renormalize=False)
    torch.manual_seed(3)
    weights = {
        (e, n): torch.randn(getattr(expert, n).out_features, getattr(expert, n).in_features) * 0.2
        for e, expert in enumerate(moe.experts) for n in ("gate_up_proj", "down_proj")
    }
    for (e, n), w in weights.items():
        setattr(moe.experts[e], n, PackedLinear(w, None))
    x = torch.randn(20, HIDDEN)
    probs = torch.nn.functional.linear(x, moe.gate.weight).softmax(-1)
    top, experts = probs.topk(2)
    expected = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(2):
            e = experts[t, j].item()
            gate, up = (x[t] @ weights[e, "gate_up_proj"].T).chunk(2)
            expected[t] += top[t, j] * (torch.nn.functional.silu(gate) * up) @ weights[e, "down_proj"].T
    torch.testing.assert_close(fused_moe(moe.native_block(), x), expected, atol=1e-4, rtol=1e-4)
