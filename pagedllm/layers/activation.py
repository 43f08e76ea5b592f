"""Gated MLP activations (Shazeer 2020, "GLU Variants Improve Transformer"): SwiGLU's
``silu(gate) * up`` and GeGLU's ``gelu_tanh(gate) * up`` (Gemma 3).

Call: ``act(gate_up)`` for gate_up [T, 2 * I] (gate first); computed in place in the gate
half, which is returned: a [T, I] view with row stride 2 * I. The native kernels take float32
(one pass over the rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels import elementwise
from pagedllm.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """``silu(gate) * up``, in place in the gate half."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype != torch.float32:  # a model cast after it was built: the kernel is float32
            return self.forward_native(gate_up)
        elementwise.silu_and_mul(gate_up)
        return gate_up[:, : gate_up.shape[1] // 2]


class GeluTanhAndMul(CustomOp):
    """``gelu(gate, approximate="tanh") * up``, in place in the gate half."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return gate.copy_(F.gelu(gate, approximate="tanh")).mul_(up)

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype != torch.float32:
            return self.forward_native(gate_up)
        elementwise.gelu_tanh_and_mul(gate_up)
        return gate_up[:, : gate_up.shape[1] // 2]
