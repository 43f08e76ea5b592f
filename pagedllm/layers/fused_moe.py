"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts,
each a SwiGLU MLP, and their outputs are summed weighted by the router's probabilities.

The experts are ordinary linear layers (``experts.{e}.gate_up_proj`` / ``down_proj``), so
loading, packing (``pack_linears``) and quantization (``quantize_model``) treat them as any
other (a GGUF file's experts run from its blocks as stored under ``--dtype auto``,
``models/gguf_linears``); the router (``gate``) is not a linear layer and stays float. Where
every expert is on our native kernels (packed float32, w8a8, w4a8, or GGUF blocks as stored)
and activations are float32, the whole block is one native call (``kernels/moe.py``,
``csrc/moe.cpp``: tokens grouped by expert, each active expert's GEMMs over its tokens only);
otherwise PyTorch runs it expert by expert.

Tensor parallelism (as vLLM without expert parallelism): every rank holds every expert's
share of the intermediate dimension (gate/up rows column-parallel, down columns
row-parallel) and the whole router; the block's partial sums are all-reduced once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import SINGLE, TPGroup
from pagedllm.kernels import library
from pagedllm.kernels.kquant import LINEAR_KQUANT
from pagedllm.kernels.linear import LINEAR_F32, LINEAR_KINDS, linear_desc, linear_pack_f32
from pagedllm.kernels.moe import NativeMoE, fused_moe
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.quantization.linear import prompt_rows

# The layer kinds csrc/moe.cpp runs an expert on.
_MOE_KINDS = range(LINEAR_KINDS)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, top_k] float32, experts [T, top_k] int64): the
    softmax over all experts (in float32), its top_k, divided by their sum when ``renormalize``."""
    probs = logits.float().softmax(-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(-1, keepdim=True)
    return weights, experts


class MoEExpert(nn.Module):
    """One expert's SwiGLU MLP: ``gate_up_proj`` [2 I, hidden] (gate rows first), ``down_proj`` [hidden, I]."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Router(nn.Module):
    """The router's weight [num_experts, hidden] (a parameter, not a linear layer: never quantized)."""

    def __init__(self, num_experts: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)


class FusedMoE(nn.Module):
    """The mixture-of-experts MLP of one layer.

    Args:
        hidden_size: the model's width.
        intermediate_size: each expert's MLP width held by this rank (the whole width / tp.size).
        num_experts, top_k: experts, and those each token runs.
        renormalize: the top_k weights are divided by their sum (Mixtral; Qwen3-MoE's
            ``norm_topk_prob``); else they stay softmax probabilities over all experts.
        tp: the tensor-parallel group (its all-reduce sums the ranks' partial outputs).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        dtype: torch.dtype,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Router(num_experts, hidden_size, dtype)
        self.experts = nn.ModuleList(MoEExpert(hidden_size, intermediate_size, dtype) for _ in range(num_experts))
        # Built on the first call (after packing / quantization put the final layers in place);
        # False: the experts are not all on our packed kernels.
        self._native: NativeMoE | None | bool = None

    def native_block(self) -> NativeMoE | None:
        """The block as one native call's descriptor, or None where it cannot be (no native
        kernels, a float router not in float32, an expert layer not on the native kernels: an
        ``nn.Linear`` of another dtype, weight-only int8 / int4)."""
        if self._native is None:
            layers = [layer for expert in self.experts for layer in (expert.gate_up_proj, expert.down_proj)]
            weight = self.gate.weight
            descs = [m.native_desc() for m in layers] if all(hasattr(m, "native_desc") for m in layers) else []
            on_kernels = bool(descs) and all(d.kind in _MOE_KINDS for d in descs)
            if library.available() and weight.dtype == torch.float32 and on_kernels:
                self.router_packed = linear_pack_f32(weight)
                router = linear_desc(LINEAR_F32, self.router_packed, None, weight.shape[0], weight.shape[1])
                self._native = NativeMoE(router, descs[0::2], descs[1::2], self.top_k, self.renormalize)
            else:
                self._native = False
        return self._native or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (summed over the ranks)."""
        block = self.native_block() if x.dtype == torch.float32 else None
        out = None if block is None else fused_moe(block, x)
        if out is None:
            out = self._forward_experts(x)
        return self.tp.all_reduce(out)

    def _forward_experts(self, x: torch.Tensor) -> torch.Tensor:
        """PyTorch, expert by expert: each active expert runs on its own tokens."""
        weights, experts = route(F.linear(x, self.gate.weight), self.top_k, self.renormalize)
        out = torch.zeros_like(x)
        with prompt_rows(None):  # an expert's rows are not the step's (the native block's kernels, too)
            for e in experts.unique().tolist():
                token, slot = (experts == e).nonzero(as_tuple=True)
                y = self.experts[e](x[token])
                out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
        return out
