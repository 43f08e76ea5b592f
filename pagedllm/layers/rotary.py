"""Rotary position embedding (Su et al. 2021) in the GPT-NeoX / HF ``rotate_half`` layout.

The first and second halves of each head are the two coordinates of each rotated pair:
``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import elementwise
from pagedllm.layers.custom_op import CustomOp


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to ``max_position``, computed once, looked up per step.

    Args:
        head_dim: rotated dimension (the whole head).
        max_position: number of positions to precompute.
        base: RoPE theta.
        dtype: dtype of the cache (the model's dtype, as HF casts cos/sin to it).
    """

    def __init__(self, head_dim: int, max_position: int, base: float, dtype: torch.dtype) -> None:
        super().__init__()
        # Explicit CPU device: the loader builds the model under torch.device("meta"), and
        # this buffer is not in any checkpoint, so it must hold real values from the start.
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
        freqs = torch.outer(torch.arange(max_position, device="cpu").float(), inv_freq).repeat(1, 2)  # [P, D]
        cache = torch.stack([freqs.cos(), freqs.sin()], 1)  # [P, 2, D]
        # Sign of rotate_half folded into sin: rotate_half(x) * sin == roll(x, D/2) * signed_sin.
        cache[:, 1, : head_dim // 2].neg_()
        self.register_buffer("cos_sin", cache.unsqueeze(2).to(dtype), persistent=False)  # [P, 2, 1, D]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of each token's position: two [T, 1, head_dim] tensors.

        Looked up once per step and shared by all layers.
        """
        cos_sin = self.cos_sin[positions]
        return cos_sin[:, 0], cos_sin[:, 1]


class ApplyRotary(CustomOp):
    """Rotate heads by the cos and signed sin of :meth:`RotaryEmbedding.forward`.

    Call: ``rotate(x, cos, sin, scale=None)`` for x [T, num_heads, head_dim] (q and k heads
    together, heads contiguous, rows at any stride), cos, sin [T, 1, head_dim] and ``scale``
    [num_heads, head_dim] float32 or None: each rotated head times its row (a second multiply;
    an int8 cache's channel scales, ``layers/key_scales.py``). The native kernel rotates
    float32 heads in place and returns x; PyTorch returns a new tensor.
    """

    def forward_native(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        y = torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)
        return y if scale is None else y.mul_(scale)

    def forward_cpu(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.dtype != torch.float32:  # a model cast after it was built: the kernel is float32
            return self.forward_native(x, cos, sin, scale)
        elementwise.rotary_inplace(x, cos, sin, scale)
        return x
