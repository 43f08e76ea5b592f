"""Float32 linear layers on our native GEMM (csrc/linear.cpp), with the weight packed once.

Measured on the target CPU (docs/benchmarks.md): against ``F.linear`` in float32 on one
thread, the float32 panels run 1.3-1.6x faster at 32 rows and 1.0-1.2x at 64-256 rows. With
few rows a step is bound by reading the weight, and bfloat16 panels (half the bytes) win:
1.65x at 1 row over a whole SmolLM2 step on two threads. vdpbf16ps runs at half the float32
FMA rate, so bfloat16 loses from about 20 rows on (two threads): the bfloat16 copy serves
only steps of at most ``bf16_max_rows`` rows. Each row's result is independent of the other rows in the call,
so float32-only layers (``bf16_max_rows=0``) give batch-invariant outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.cpu_kernels import native_library

PANEL = 32  # output columns per packed panel (csrc/linear.cpp)


def pad_to_panels(column_values: torch.Tensor) -> torch.Tensor:
    """[N] per-output-column values, zero padded to whole panels: the kernels read a panel's worth."""
    return torch.nn.functional.pad(column_values, (0, -column_values.shape[0] % PANEL))


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` for float32 ``x`` of shape [T, in_features].

    Args:
        weight: [out_features, in_features] float (read once, then only the packed copies).
        bias: [out_features] or None.
        bf16_max_rows: steps of at most this many rows use the bfloat16 copy; 0: none kept.

    Raises:
        RuntimeError: if the native kernels are not available (check ``native_library()``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bf16_max_rows: int = 0) -> None:
        super().__init__()
        self._lib = native_library()
        if self._lib is None:
            raise RuntimeError("PackedLinear needs the native kernels (pagedllm/csrc)")
        n, k = weight.shape
        self.in_features, self.out_features = k, n
        panels = -(-n // PANEL)
        w32 = weight.detach().float().contiguous()
        self.register_buffer("packed_f32", torch.empty(panels * PANEL * k), persistent=False)
        self._lib.linear_pack_f32(w32.data_ptr(), self.packed_f32.data_ptr(), n, k)
        self.bf16_max_rows = bf16_max_rows if self._lib.linear_bf16_available() else 0
        packed_bf16 = None
        if self.bf16_max_rows:
            w16 = w32.to(torch.bfloat16)
            packed_bf16 = torch.empty(panels * PANEL * (k + k % 2), dtype=torch.bfloat16)
            self._lib.linear_pack_bf16(w16.data_ptr(), packed_bf16.data_ptr(), n, k)
        self.register_buffer("packed_bf16", packed_bf16, persistent=False)
        self.register_buffer("bias", None if bias is None else pad_to_panels(bias.detach().float()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] float32 (rows may be strided) -> [T, out_features] float32."""
        if x.stride(1) != 1:
            x = x.contiguous()
        t, ldx = x.shape[0], x.stride(0)
        y = x.new_empty(t, self.out_features)
        bias = None if self.bias is None else self.bias.data_ptr()
        if t <= self.bf16_max_rows:
            self._lib.linear_bf16(
                x.data_ptr(), ldx, self.packed_bf16.data_ptr(), bias, y.data_ptr(), t, self.out_features, self.in_features
            )
        else:
            self._lib.linear_f32(
                x.data_ptr(), ldx, self.packed_f32.data_ptr(), bias, y.data_ptr(), t, self.out_features, self.in_features
            )
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, bf16_max_rows={self.bf16_max_rows}"
        )


def pack_linears(model: nn.Module, bf16_max_rows: int) -> int:
    """Replace every ``nn.Linear`` of a float32 model, and its logits matmul, by PackedLinear.

    A tied lm_head (``model.lm_head is None``: the logits use the embedding) gets a packed
    copy of the embedding, used for the logits only. Returns the number of layers packed.
    """
    targets = {name: (m.weight, m.bias) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if getattr(model, "lm_head", False) is None:
        targets["lm_head"] = (model.embed_tokens.weight, None)
    for name, (weight, bias) in targets.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, PackedLinear(weight, bias, bf16_max_rows))
    return len(targets)
