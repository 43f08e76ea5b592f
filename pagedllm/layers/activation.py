"""Gated MLP activations (Shazeer 2020, "GLU Variants Improve Transformer"): SwiGLU's
``silu(gate) * up`` and GeGLU's ``gelu_tanh(gate) * up`` (Gemma 3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels import ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for gate_up: [T, 2 * I] (gate first), computed in place in the gate
    half; returns that half, a [T, I] view with row stride 2 * I. One native pass for float32."""
    gate, up = gate_up.chunk(2, dim=-1)
    if ops.silu_and_mul(gate_up):
        return gate
    return F.silu(gate, inplace=True).mul_(up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` for gate_up: [T, 2 * I] (gate first), in place
    in the gate half, as :func:`silu_and_mul`."""
    gate, up = gate_up.chunk(2, dim=-1)
    if ops.gelu_tanh_and_mul(gate_up):
        return gate
    return gate.copy_(F.gelu(gate, approximate="tanh")).mul_(up)
