"""Quantized weight matrices, unpacked: integer codes plus float scales, and the quantizers.

These are the exact values a layer computes with; :mod:`.linear` packs them for the kernels.
Scales of weights quantized here are rounded to the kernels' bfloat16 first, and the codes
computed against the rounded scales, so the kernel's weights equal :meth:`dequantize`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The dtype the packed kernels take activations, scales and zero points in (see linear.py).
KERNEL_DTYPE = torch.bfloat16
# Floor of a scale, so an all-zero row or group divides by something; any code then dequantizes to 0.
_TINY = 2.0**-100


def _round_to_kernel(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest KERNEL_DTYPE value, as float32."""
    return x.to(KERNEL_DTYPE).float()


def _round_up_to_kernel(x: torch.Tensor) -> torch.Tensor:
    """Positive float32 -> the least KERNEL_DTYPE value >= it, as float32: a scale rounded up
    still spans the range, so no code is clamped and the error bound stays scale / 2."""
    nearest = x.to(KERNEL_DTYPE)
    above = (nearest.view(torch.int16) + 1).view(KERNEL_DTYPE)  # next value up, for positive floats
    return torch.where(nearest.float() < x, above, nearest).float()


def _expand(per_group: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, G] -> [N, G * group_size], each group's value repeated over its columns."""
    return per_group.repeat_interleave(group_size, dim=1)


@dataclass
class Int8Weight:
    """Symmetric int8 in groups along the input dimension: ``w[n, k] = scales[n, k // group_size] * q[n, k]``.

    Attributes:
        q: [N, K] int8 codes.
        scales: [N, K // group_size] float32. One group per row (group_size == K) is the
            per-output-channel layout; group_size 32 is GGUF Q8_0's blocks.
    """

    q: torch.Tensor
    scales: torch.Tensor

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32."""
        return self.q.float() * _expand(self.scales, self.group_size)

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight:
        """Stack along the output dimension (fused projections); the group sizes must agree."""
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]))


@dataclass
class Int4Weight:
    """Asymmetric int4 in groups along the input dimension:
    ``w[n, k] = scales[n, g] * q[n, k] + mins[n, g]`` with ``g = k // group_size``.

    Attributes:
        q: [N, K] uint8 codes in [0, 15], one per byte (packed by the linear layer).
        scales: [N, K // group_size] float32.
        mins: [N, K // group_size] float32, the zero point as the value of code 0 (GGUF
            Q4_1's ``m``; ``-8 * d`` for Q4_0). The kernel's zero point, the value of code 8,
            is ``mins + 8 * scales``.
    """

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, computed as GGUF's reference does (``d * q + m``)."""
        g = self.group_size
        return self.q.float() * _expand(self.scales, g) + _expand(self.mins, g)

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Stack along the output dimension (fused projections); the group sizes must agree."""
        return Int4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scales", "mins")))


QuantizedWeight = Int8Weight | Int4Weight


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of a [N, K] float matrix: codes in [-127, 127].

    Error bound: ``|w - dequantize| <= scale / 2`` per element.
    """
    w = w.float()
    scales = _round_up_to_kernel((w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(_TINY))
    q = (w / scales).round_().clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q, scales)


def quantize_int4(w: torch.Tensor, group_size: int) -> Int4Weight:
    """Asymmetric min/max int4 of a [N, K] float matrix in groups of ``group_size`` along K.

    Each group's range [min, max] is split into 15 steps. Error bound: ``scale / 2`` per
    element, plus the bfloat16 rounding of the zero point (``|zero| / 512``; the kernel's
    zero point is bfloat16, and the codes are chosen against the rounded one).

    Raises:
        ValueError: if ``group_size`` does not divide K.
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension {k}")
    groups = w.float().view(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = _round_up_to_kernel(((hi - lo) / 15).clamp_min(_TINY))
    zeros = _round_to_kernel(lo + 8 * scales)  # the kernel's zero point: the value of code 8
    q = groups.sub(zeros.unsqueeze(-1)).div_(scales.unsqueeze(-1)).round_().add_(8).clamp_(0, 15)
    return Int4Weight(q.to(torch.uint8).view(n, k), scales, zeros - 8 * scales)


def int8_as_int4_pair(w: Int8Weight) -> Int4Weight:
    """The same matrix as two int4 halves over a doubled input dimension: [N, K] -> [N, 2K].

    With ``u = q + 128 = 16 * hi + lo`` (hi, lo in [0, 15]): ``s * q = 16 s * hi - 128 s + s * lo``,
    so ``x @ w.T == cat([x, x]) @ pair.T`` where ``pair = [hi | lo]`` with scales
    ``[16 s | s]`` and mins ``[-128 s | 0]``: group-wise int8 (GGUF Q8_0) on the int4 kernel,
    which is the only packed CPU kernel with per-group scales.
    """
    u = (w.q.to(torch.int16) + 128).to(torch.uint8)
    q = torch.cat([u >> 4, u & 15], dim=1)
    scales = torch.cat([16 * w.scales, w.scales], dim=1)
    return Int4Weight(q, scales, torch.cat([-128 * w.scales, torch.zeros_like(w.scales)], dim=1))
