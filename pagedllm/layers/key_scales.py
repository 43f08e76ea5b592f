"""Per-channel key scales for the int8 K/V cache: keys divided, queries multiplied, after RoPE.

An int8 cache row holds one token's key head with one scale (its max |value| / 127,
``csrc/kv_rows.h``). Some models' keys carry a few channels many times larger than the rest
(Qwen2's, from its k_proj bias; Gemma 3's, from its k_norm weight): the row's scale then
follows those channels and the others keep a handful of codes, so scores move. Dividing each
key channel by a factor s_c and multiplying the query's same channel by it leaves every score
q . k unchanged in exact arithmetic, while the cached keys' channels come out of similar sizes
and share the row's codes evenly (SmoothQuant's migration, Xiao et al. 2023, §4, applied
between q and k, where the query is never quantized).

The factors come from the weights alone, so the cached rows depend on nothing a request
brings (prefix-cache hits and tensor-parallel ranks agree): for key channel c of a layer
whose attention input is ``RMSNorm(x) * g``,
``m_c^2 = (sum_j (W_k[c, j] g_j)^2 + b_c^2) * n_c^2``, the channel's expected square for
unit-variance normalized inputs, with ``n`` the k_norm weight of layers that normalize each
key head (Qwen3, Gemma 3; 1 without). RoPE over a head's leading R dims (R = D, or fewer with
partial rotary embeddings) rotates channel c < R/2 with c + R/2, so both take their pair's
``sqrt(m_c^2 + m_{c+R/2}^2)``, and the factors commute with the rotation; a channel past R
keeps its own ``m_c``. Then ``s_c = (that size) ** ALPHA``, divided by the head's geometric
mean of those sizes' powers (one per pair, one per unrotated channel) so that they sit around 1.
A head's factors depend on its own rows only: a rank's heads get the whole model's.

Applied to the int8 cache alone (``applies``): e4m3 codes carry a relative error of their
own that equal channel sizes do not reduce. Measured on Qwen2.5-Coder-0.5B, SmolLM2-135M and
Gemma 3 270M in docs/benchmarks.md ("key channel scales").
"""

from __future__ import annotations

import torch

# The migration strength: s_c = (expected |k_c|) ** ALPHA. 1 would equalize the channels if
# the expected sizes were exact; the weight-only estimate is off by a few times per channel,
# and 0.75 measured best over three models (docs/benchmarks.md).
ALPHA = 0.75


def applies(cache_dtype: torch.dtype) -> bool:
    """Whether a K/V cache of this dtype stores keys divided by the key scales."""
    return cache_dtype == torch.int8


def key_scales(
    k_weight: torch.Tensor,
    k_bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    num_kv_heads: int,
    k_norm_weight: torch.Tensor | None = None,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """The factors s [num_kv_heads, head_dim] float32 the keys are divided by (the module docstring's).

    Args:
        k_weight: [num_kv_heads * head_dim, hidden], the key rows of the projection (rows in
            HF order: RoPE's halves are the first and second half of each head's leading
            ``rotary_dim`` channels).
        k_bias: [num_kv_heads * head_dim] or None.
        norm_weight: [hidden], the RMSNorm weight the projection's input is scaled by.
        k_norm_weight: [head_dim], the per-head key RMSNorm's weight (as the model multiplies
            by it), or None.
        rotary_dim: the channels RoPE rotates (``ModelConfig.rotary_dim``); None: the whole head.
    """
    w = k_weight.float() * norm_weight.float()
    m2 = w.square().sum(1)
    if k_bias is not None:
        m2 += k_bias.float().square()
    m2 = m2.view(num_kv_heads, -1)
    if k_norm_weight is not None:
        m2 = m2 * k_norm_weight.float().square()
    r = rotary_dim or m2.shape[1]
    rotated = m2[:, :r].reshape(num_kv_heads, 2, -1)
    # [Hkv, R / 2 + D - R]: a squared size per rotated pair, then per unrotated channel.
    sizes = torch.cat([rotated[:, 0] + rotated[:, 1], m2[:, r:]], 1)
    s = sizes.sqrt().clamp_min(torch.finfo(torch.float32).tiny).pow(ALPHA)
    s = s / s.log().mean(1, keepdim=True).exp()
    pairs = s[:, : r // 2]
    return torch.cat([pairs, pairs, s[:, r // 2 :]], 1).contiguous()


def qk_factors(scales: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[num_heads + num_kv_heads, head_dim] float32: each query head's KV head's ``scales`` row,
    then each key head's reciprocals, for ``ApplyRotary`` over q and k heads side by side."""
    group = num_heads // scales.shape[0]
    return torch.cat([scales.repeat_interleave(group, 0), scales.reciprocal()]).contiguous()
