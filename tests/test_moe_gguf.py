"""Mixture-of-experts models as GGUF files written as llama.cpp's converter does: F32, Q8_0 and K-quant experts."""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedllm.distributed.parallel_state import SINGLE, TPGroup
from pagedllm.kernels import library
from pagedllm.layers.fused_moe import FusedMoE, route
from pagedllm.layers.quantization.linear import KQuantLinear, Q8A8Linear, W4A8Linear
from pagedllm.models import gguf_file, gguf_loader, native_decoder
from pagedllm.models.gguf_linears import gguf_linears
from pagedllm.models.loader import load_model, resolve_model
from pagedllm.models.native_decoder import NativeDecoder
from pagedllm.platforms.cpu import auto_linears
from pagedllm.quantization_config import QuantizationConfig
from tests.models_util import (
    GGUF_NAMES,
    finish_gguf,
    gguf_writer,
    llama_cpp_permute,
    prefill_logits,
    random_weight_blocks,
    randomize_vectors,
)
from tests.models_util import MOE_CONFIGS as CONFIGS
from tests.models_util import MOE_HF_CLASSES as HF_CLASSES
from tests.models_util import MOE_PROMPTS as PROMPTS
from tests.models_util import tiny  # noqa: F401 (the fixture)
from tests.tensor_parallel_ranks import Case, load, run_steps
from tests.utils import assert_holds_blocks


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
