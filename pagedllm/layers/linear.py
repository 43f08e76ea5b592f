"""Float32 linear layers on our native GEMM (csrc/linear.cpp), with the weight packed once.

The ``--dtype float32`` path where the native kernels run (the loader packs the layers then,
and leaves ``nn.Linear`` without them). Each row's result is independent of the other rows in
the call, so outputs are batch-invariant. Why our own GEMM rather than ``F.linear``: it is
faster at the small batches of decode (docs/benchmarks.md); ``--dtype auto`` runs the linear
layers as w8a8 / w4a8 (``layers/quantization/linear.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import linear as kernels
from pagedllm.kernels.linear import PANEL


def pad_to_panels(column_values: torch.Tensor) -> torch.Tensor:
    """[N] per-output-column values, zero padded to whole panels: the kernels read a panel's worth."""
    return torch.nn.functional.pad(column_values, (0, -column_values.shape[0] % PANEL))


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` for float32 ``x`` of shape [T, in_features].

    Args:
        weight: [out_features, in_features] float (read once, then only the packed copy).
        bias: [out_features] or None.

    Raises:
        RuntimeError: if the native kernels are not available (check ``library.available()``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_f32", kernels.linear_pack_f32(weight.detach()), persistent=False)
        self.register_buffer("bias", None if bias is None else pad_to_panels(bias.detach().float()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] float32 (rows may be strided) -> [T, out_features] float32."""
        return kernels.linear_f32(x, self.packed_f32, self.bias, self.out_features)

    def native_desc(self) -> kernels.LinearDesc:
        """This layer for the one-call decoder (``kernels.decoder.decode_layers``)."""
        return kernels.linear_desc(kernels.LINEAR_F32, self.packed_f32, self.bias, self.out_features, self.in_features)

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
