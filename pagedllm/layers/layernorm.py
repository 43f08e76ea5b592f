"""RMSNorm (Zhang & Sennrich 2019), with the residual add of pre-norm blocks fused in."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import elementwise
from pagedllm.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dimension; the native kernel does
    the residual add and the norm in one pass over float32 rows.

    Args:
        hidden_size: size of the normalized (last) dimension.
        eps: added to the mean square for stability.
        dtype: dtype of the weight (the model's dtype).

    Call: ``norm(x, residual=None)``. Add ``x`` to the residual stream, then normalize it.
        x: [..., hidden_size], the previous block's output (or the embeddings).
        residual: [..., hidden_size], the residual stream so far; None before the first
            block. Float32 on the native kernel: updated in place (if contiguous) and returned.
        Returns (normalized [..., hidden_size], new residual stream [..., hidden_size]), both
        in x's dtype.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.shape = (hidden_size,)
        self.eps = eps

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        return F.rms_norm(x, self.shape, self.weight, self.eps), x

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype != torch.float32:  # a model cast after it was built: the kernel is float32
            return self.forward_native(x, residual)
        # The residual stream is the model's own, so the add happens in place.
        stream = (x if residual is None else residual).contiguous()
        out = elementwise.add_rms_norm(None if residual is None else x.contiguous(), stream, self.weight, self.eps)
        return out, stream
