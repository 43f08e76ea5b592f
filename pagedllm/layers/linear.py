"""Float32 linear layers on our native GEMM (csrc/linear.cpp), with the weight packed once.

Measured on the target CPU (docs/benchmarks.md): against ``F.linear`` in float32 on one
thread, the packed panels run 1.3-1.6x faster at 32 rows and 1.0-1.2x at 64-256 rows. Each
row's result is independent of the other rows in the call, so outputs are batch-invariant.
This is the ``--dtype float32`` path; ``--dtype auto`` runs the linear layers as w8a8
(``layers/quantization/linear.py``), 1.4-3.6x faster again.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import ops
from pagedllm.kernels.ops import PANEL


def pad_to_panels(column_values: torch.Tensor) -> torch.Tensor:
    """[N] per-output-column values, zero padded to whole panels: the kernels read a panel's worth."""
    return torch.nn.functional.pad(column_values, (0, -column_values.shape[0] % PANEL))


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` for float32 ``x`` of shape [T, in_features].

    Args:
        weight: [out_features, in_features] float (read once, then only the packed copy).
        bias: [out_features] or None.

    Raises:
        RuntimeError: if the native kernels are not available (check ``ops.available()``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_f32", ops.linear_pack_f32(weight.detach()), persistent=False)
        self.register_buffer("bias", None if bias is None else pad_to_panels(bias.detach().float()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] float32 (rows may be strided) -> [T, out_features] float32."""
        return ops.linear_f32(x, self.packed_f32, self.bias, self.out_features)

    def native_desc(self) -> ops.LinearDesc:
        """This layer for the one-call decoder (``ops.decode_layers``)."""
        return ops.linear_desc(ops.LINEAR_F32, self.packed_f32, self.bias, self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of a float32 model, and its logits matmul, by PackedLinear.

    A tied lm_head (``model.lm_head is None``: the logits use the embedding) gets a packed
    copy of the embedding, used for the logits only. Returns the number of layers packed.
    """
    targets = {name: (m.weight, m.bias) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if getattr(model, "lm_head", False) is None:
        targets["lm_head"] = (model.embed_tokens.weight, None)
    for name, (weight, bias) in targets.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, PackedLinear(weight, bias))
    return len(targets)
