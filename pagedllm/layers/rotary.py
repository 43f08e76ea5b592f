"""Rotary position embedding (Su et al. 2021) in the GPT-NeoX / HF ``rotate_half`` layout.

RoPE rotates the leading R dims of each head (``ModelConfig.rotary_dim``: the whole head, or
fewer with partial rotary embeddings, as transformers' Phi-3), the first and second halves
of those R the two coordinates of each rotated pair: ``out = x * cos + rotate_half(x) * sin``
with ``rotate_half(x) = cat(-x2, x1)``; the head's dims past R pass through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.kernels import elementwise
from pagedllm.layers.custom_op import CustomOp


# RoPE scaling types computed (transformers' rope_type names), each by transformers' own
# ROPE_INIT_FUNCTIONS. Two are fixed at model build where transformers recomputes them per
# sequence (a paged cache keeps K/V rotated once; a prefix hit or a recomputed request must see
# the same rotation): "longrope"'s factor set by the engine's max_model_len, "dynamic"'s base
# by the scaled context (``rope_frequencies``).
ROPE_SCALING_TYPES = ("linear", "llama3", "yarn", "longrope", "dynamic")


# The keys each type's ROPE_INIT_FUNCTION requires (besides rope_theta); dynamic's original
# length is the loaders' (transformers reads the config's max_position_embeddings).
_REQUIRED_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "dynamic": ("factor", "original_max_position_embeddings"),
}
# llama.cpp's frequency factors (a GGUF's ``rope_freqs.weight``, Llama 3.1's RoPE as its
# converter writes it): each inverse frequency divided by its factor. Not a transformers type.
FREQ_FACTORS = "freq_factors"


def check_rope_scaling(scaling: dict[str, Any]) -> None:
    """Raise ValueError unless ``scaling`` (transformers' rope parameters, ``rope_type`` set)
    is plain RoPE or one of ``ROPE_SCALING_TYPES`` with the keys it needs."""
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return
    if rope_type not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"RoPE scaling {rope_type!r} is not supported (supported: {', '.join(ROPE_SCALING_TYPES)})"
        )
    missing = [key for key in _REQUIRED_KEYS[rope_type] if key not in scaling]
    if missing:
        raise ValueError(f"RoPE scaling {rope_type!r} needs {', '.join(missing)} in the rope parameters")


def scaled_context(max_position: int, scaling: dict[str, Any], architecture: str) -> int:
    """The positions a model with this RoPE scaling serves, as vLLM derives its max_model_len:
    linear's and dynamic's ``max_position * factor``, yarn's ``original_max_position_embeddings
    * factor``; llama3's, longrope's (and plain RoPE's) is ``max_position``, which their configs
    already extend, as is Gemma 3's whatever its scaling (vLLM's exception: its
    max_position_embeddings already counts the factor)."""
    rope_type = "default" if architecture == "gemma3" else scaling.get("rope_type", "default")
    if rope_type in ("linear", "dynamic"):
        return int(max_position * scaling["factor"])
    if rope_type == "yarn":
        return int(scaling["original_max_position_embeddings"] * scaling["factor"])
    return max_position


class _RopeConfig:
    """What transformers' ``ROPE_INIT_FUNCTIONS`` read of a model config (rope parameters
    already standardized: ``rope_type``, ``rope_theta``, ``original_max_position_embeddings``).
    Its head is the rotated dims alone, without a ``partial_rotary_factor``: transformers'
    ``int(head_dim * partial_rotary_factor)``, the dim every type computes from."""

    def __init__(self, parameters: dict[str, Any], rotary_dim: int, max_position: int) -> None:
        self.rope_parameters = parameters
        self.head_dim, self.hidden_size, self.num_attention_heads = rotary_dim, rotary_dim, 1
        self.max_position_embeddings = max_position

    def standardize_rope_params(self) -> None:
        pass


def rope_frequencies(
    rotary_dim: int, base: float, max_position: int, scaling: dict[str, Any] | None = None,
    max_model_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies [rotary_dim / 2] float32 and the factor cos and sin are
    multiplied by (YaRN's and LongRoPE's attention factor; 1.0 otherwise), for RoPE over
    ``rotary_dim`` dims of each head (``ModelConfig.rotary_dim``: every type computes from
    it as transformers does from ``int(head_dim * partial_rotary_factor)``).

    ``scaling``: transformers' rope parameters of a scaled RoPE (``rope_type`` one of
    ``ROPE_SCALING_TYPES``, its ``factor`` etc.; ``ModelConfig.rope_scaling``), computed by
    transformers' ``ROPE_INIT_FUNCTIONS`` as its models do, or ``FREQ_FACTORS`` with its
    ``freq_factors`` list; None or empty: plain RoPE. ``max_position``: the positions served
    (``ModelConfig.max_position_embeddings``, ``scaled_context``'s).

    The two types transformers recomputes as a sequence grows are fixed here, for every
    position and request alike (K/V in the paged cache, reused by prefix hits and recomputed
    after preemption, stay valid):

    - ``longrope`` (Phi-3 128k, Phi-3.5): the factors transformers uses for a
      sequence of ``max_model_len`` tokens (None: ``max_position``), as vLLM: ``long_factor``
      when it exceeds ``original_max_position_embeddings``, else ``short_factor``; the
      attention factor either way. So transformers' logits for any sequence when max_model_len
      is at most the original length; else transformers' for a sequence longer than it (its
      short prompts differ: transformers rotates them by the short factors).
    - ``dynamic`` (NTK): the base transformers uses for a sequence of ``max_position`` (the
      original length times ``factor``) tokens, as vLLM's fixed base: ``base * (factor**2 -
      factor + 1) ** (d / (d - 2))``. So transformers' logits for a sequence of that length (or
      a shorter one past the original length once transformers has seen that length); shorter
      sequences differ (transformers rotates one within the original length by plain RoPE).

    Raises:
        ValueError: a type not in ``ROPE_SCALING_TYPES``, one missing its keys, or longrope
            factors not one per rotated pair.
    """
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, device="cpu").float() / rotary_dim)
    if not scaling:
        return inv_freq, 1.0
    if scaling["rope_type"] == FREQ_FACTORS:
        return inv_freq / torch.tensor(scaling[FREQ_FACTORS], dtype=torch.float32, device="cpu"), 1.0
    check_rope_scaling(scaling)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type, seq_len = scaling["rope_type"], None
    if rope_type == "longrope":
        seq_len = max_model_len or max_position
        if any(len(scaling[key]) != rotary_dim // 2 for key in ("short_factor", "long_factor")):
            raise ValueError(f"longrope needs one short_factor and one long_factor per rotated pair ({rotary_dim // 2})")
    elif rope_type == "dynamic":  # transformers' dynamic reads the original length here
        seq_len, max_position = max_position, scaling["original_max_position_embeddings"]
    config = _RopeConfig({**scaling, "rope_theta": base}, rotary_dim, max_position)
    with torch.device("cpu"):  # real values under the loader's torch.device("meta") too
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), seq_len=seq_len)
    return inv_freq.float(), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to ``max_position``, computed once, looked up per step.

    Args:
        rotary_dim: the rotated dims of each head (``ModelConfig.rotary_dim``).
        max_position: number of positions to precompute.
        base: RoPE theta.
        dtype: dtype of the cache (the model's dtype, as HF casts cos/sin to it).
        scaling: the RoPE scaling parameters (``rope_frequencies``); None: plain RoPE.
        max_model_len: the engine's longest request, which picks longrope's factors
            (``rope_frequencies``); None: ``max_position``.
    """

    def __init__(
        self, rotary_dim: int, max_position: int, base: float, dtype: torch.dtype, scaling: dict[str, Any] | None = None,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__()
        # Explicit CPU device: the loader builds the model under torch.device("meta"), and
        # this buffer is not in any checkpoint, so it must hold real values from the start.
        inv_freq, attention_factor = rope_frequencies(rotary_dim, base, max_position, scaling, max_model_len)
        freqs = torch.outer(torch.arange(max_position, device="cpu").float(), inv_freq).repeat(1, 2)  # [P, R]
        cache = torch.stack([freqs.cos(), freqs.sin()], 1)  # [P, 2, R]
        if attention_factor != 1.0:  # YaRN, LongRoPE: cos and sin scaled (transformers' attention_scaling)
            cache.mul_(attention_factor)
        # Sign of rotate_half folded into sin: rotate_half(x) * sin == roll(x, R/2) * signed_sin.
        cache[:, 1, : rotary_dim // 2].neg_()
        self.register_buffer("cos_sin", cache.unsqueeze(2).to(dtype), persistent=False)  # [P, 2, 1, R]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of each token's position: two [T, 1, rotary_dim] tensors.

        Looked up once per step and shared by all layers.
        """
        cos_sin = self.cos_sin[positions]
        return cos_sin[:, 0], cos_sin[:, 1]


class ApplyRotary(CustomOp):
    """Rotate heads by the cos and signed sin of :meth:`RotaryEmbedding.forward`.

    Call: ``rotate(x, cos, sin, scale=None)`` for x [T, num_heads, head_dim] (q and k heads
    together, heads contiguous, rows at any stride), cos, sin [T, 1, R] (R even, at most
    head_dim: each head's leading R dims rotated, the rest passed through) and ``scale``
    [num_heads, head_dim] float32 or None: each rotated head times its row, all head_dim of it
    (a second multiply; an int8 cache's channel scales, ``layers/key_scales.py``). The native
    kernel rotates float32 heads in place and returns x; PyTorch returns a new tensor.
    """

    def forward_native(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        r = cos.shape[-1]
        rotated = x[..., :r]
        y = torch.addcmul(rotated * cos, rotated.roll(r // 2, -1), sin)
        if r < x.shape[-1]:
            y = torch.cat([y, x[..., r:]], -1)
        return y if scale is None else y.mul_(scale)

    def forward_cpu(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.dtype != torch.float32:  # a model cast after it was built: the kernel is float32
            return self.forward_native(x, cos, sin, scale)
        elementwise.rotary_inplace(x, cos, sin, scale)
        return x
