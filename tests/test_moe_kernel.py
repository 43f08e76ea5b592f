"""The fused MoE kernel (``csrc/moe.cpp``) against PyTorch's experts one by one on every ISA this CPU runs."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagedllm.kernels import kquant
from pagedllm.kernels.moe import fused_moe
from pagedllm.layers.fused_moe import FusedMoE, route
from pagedllm.layers.linear import PackedLinear
from pagedllm.layers.quantization.linear import KQuantLinear, W4A8Linear, W8A8Linear
from pagedllm.layers.quantization.weights import quantize_q4a8
from tests.models_util import random_weight_blocks

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
