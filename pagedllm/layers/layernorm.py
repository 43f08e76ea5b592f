"""RMSNorm (Zhang & Sennrich 2019), with the residual add of pre-norm blocks fused in."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import ops


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dimension.

    Args:
        hidden_size: size of the normalized (last) dimension.
        eps: added to the mean square for stability.
        dtype: dtype of the weight (the model's dtype).
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.shape = (hidden_size,)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``x`` to the residual stream, then normalize it.

        Args:
            x: [..., hidden_size], the previous block's output (or the embeddings).
            residual: [..., hidden_size], the residual stream so far; None before the first
                block. Float32 on the native kernel: updated in place and returned.

        Returns:
            (normalized [..., hidden_size], new residual stream [..., hidden_size]), both in x's dtype.
        """
        # One native pass over the rows; the residual stream is the model's own, so add in place.
        stream = x if residual is None else residual
        out = ops.add_rms_norm(None if residual is None else x, stream, self.weight, self.eps)
        if out is not None:
            return out, stream
        if residual is not None:
            x = x + residual
        return F.rms_norm(x, self.shape, self.weight, self.eps), x
