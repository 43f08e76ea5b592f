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


def quantize_int8(w: torch.Tensor, row_max: torch.Tensor | None = None) -> Int8Weight:
    """Symmetric per-output-channel int8 of a [N, K] float matrix: codes in [-127, 127].

    ``row_max`` [N]: each row's max|w| to scale by instead of its own (a tensor-parallel slice
    of longer rows takes the whole rows', so its codes are the unsharded weight's).
    Error bound: ``|w - dequantize| <= scale / 2`` per element.
    """
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if row_max is None else row_max.float().view(-1, 1)
    scales = _round_up_to_kernel((amax / 127).clamp_min(_TINY))
    q = (w / scales).round_().clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q, scales)


# MSE search of quantize_int4: trial scales put ``_SEARCH_STEPS`` code ranges from 14 to 16
# steps wide over each group's [min, max] (under 15 clips the ends, over 15 leaves codes
# unused), and groups are quantized in chunks of about this many weights (cache-sized).
_SEARCH_STEPS = 10
_SEARCH_CHUNK = 1 << 18


def _int4_codes(x: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[R, G, gs] weights -> float codes in [0, 15] nearest to them under ``(q - 8) * s + z``."""
    return (x - zeros).div_(scales).round_().add_(8).clamp_(0, 15)


def _int4_sse(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[R, G, 1] sum of squared errors of each group's reconstruction ``(q - 8) * s + z``."""
    return q.sub(8).mul_(scales).add_(zeros).sub_(x).square_().sum(-1, keepdim=True)


def _int4_minmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, G, gs] -> (scales, zeros) [R, G, 1] in the kernel's precision, each group's [min, max]
    split in 15 steps with the scale rounded up, so that no code is clamped."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scales = _round_up_to_kernel(((hi - lo) / 15).clamp_min(_TINY))
    return scales, _round_to_kernel(lo + 8 * scales)  # the kernel's zero point: the value of code 8


def _least_squares(x: torch.Tensor, q: torch.Tensor, sum_x: torch.Tensor):
    """The ``s, m`` minimizing each group's ``sum((s * q + m - x)**2)`` for fixed codes ``q``
    (a line fit of x against q), with the sums it took; ``s`` is NaN where all codes are equal."""
    n = x.shape[-1]
    sum_q = q.sum(-1, keepdim=True)
    sum_qq = torch.linalg.vecdot(q, q).unsqueeze(-1)
    sum_qx = torch.linalg.vecdot(q, x).unsqueeze(-1)
    det = n * sum_qq - sum_q * sum_q
    s = (n * sum_qx - sum_q * sum_x) / det  # det == 0 only when the codes are all equal
    return s, (sum_x - s * sum_q) / n, sum_q, sum_qq, sum_qx


def _int4_search(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[R, G, gs] -> (codes [R, G, gs], scales, zeros [R, G, 1]) minimizing each group's squared error.

    For each trial code range (see ``_SEARCH_STEPS``), codes are assigned over [min, max] and
    the scale and offset fitted to them by least squares; the best fit by its (float) error
    is rounded to the kernel's precision, its codes reassigned, and refitted once more. A
    group keeps whichever of that and plain min/max has the smaller exact error, so the
    search never does worse than min/max on any group.
    """
    n = x.shape[-1]
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    width = (hi - lo).clamp_min(_TINY)
    sum_x, sum_xx = x.sum(-1, keepdim=True), torch.linalg.vecdot(x, x).unsqueeze(-1)
    shifted = x - lo
    best_err = torch.full_like(lo, float("inf"))
    best_s, best_m = width / 15, lo
    for i in range(_SEARCH_STEPS):
        q = (shifted * ((14 + 2 * i / _SEARCH_STEPS) / width)).round_().clamp_(0, 15)
        s, m, sum_q, sum_qq, sum_qx = _least_squares(x, q, sum_x)
        err = sum_xx + s * s * sum_qq + n * m * m + 2 * s * m * sum_q - 2 * s * sum_qx - 2 * m * sum_x
        better = err < best_err  # False where NaN (all codes equal)
        best_err = torch.where(better, err, best_err)
        best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)

    def rounded(s: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = _round_to_kernel(s.clamp_min(_TINY))  # a negative or NaN fit loses to min/max below
        return s, _round_to_kernel(m + 8 * s)

    # Candidates are (scales, zeros); codes follow from them. Only [R, G, 1] tensors are kept.
    s, z = rounded(best_s, best_m)
    q = _int4_codes(x, s, z)
    err = _int4_sse(x, q, s, z)
    refit_s, refit_m, *_ = _least_squares(x, q, sum_x)  # refit to the codes the rounded fit gave
    for cand_s, cand_z in (rounded(refit_s, refit_m), _int4_minmax(x)):
        cand_err = _int4_sse(x, _int4_codes(x, cand_s, cand_z), cand_s, cand_z)
        better = cand_err < err  # False where NaN
        s, z, err = torch.where(better, cand_s, s), torch.where(better, cand_z, z), torch.where(better, cand_err, err)
    return _int4_codes(x, s, z), s, z


def quantize_int4(w: torch.Tensor, group_size: int, search: bool = True) -> Int4Weight:
    """Asymmetric int4 of a [N, K] float matrix in groups of ``group_size`` along K.

    With ``search`` (the default), each group's scale and zero point minimize its squared
    reconstruction error (see ``_int4_search``): never more than min/max's, and far less where
    the weights already lie on a coarser grid (GGUF Q4_K; figures: docs/benchmarks.md). Codes may then be clamped at a group's ends, so there is no per-element
    bound beyond min/max's on the group's total.

    Without it, plain min/max: each group's range [min, max] is split into 15 steps. Error
    bound: ``scale / 2`` per element, plus the bfloat16 rounding of the zero point
    (``|zero| / 512``; the kernel's zero point is bfloat16, and the codes are chosen against
    the rounded one).

    Either way scales and zero points are exactly the kernel's bfloat16 values, and the codes
    are chosen against them, so :meth:`Int4Weight.dequantize` is what the kernel computes with.

    Raises:
        ValueError: if ``group_size`` does not divide K.
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension {k}")
    groups = w.float().view(n, k // group_size, group_size)
    q = torch.empty(groups.shape, dtype=torch.uint8)
    scales = torch.empty(n, k // group_size)
    zeros = torch.empty(n, k // group_size)
    rows = max(1, _SEARCH_CHUNK // k)
    for r in range(0, n, rows):
        x = groups[r : r + rows]
        if search:
            cq, s, z = _int4_search(x)
        else:
            s, z = _int4_minmax(x)
            cq = _int4_codes(x, s, z)
        q[r : r + rows], scales[r : r + rows], zeros[r : r + rows] = cq, s.squeeze(-1), z.squeeze(-1)
    return Int4Weight(q.view(n, k), scales, zeros - 8 * scales)


Q4A8_GROUP = 32  # the w4a8 kernel's group of input features (csrc/linear.cpp QG)
_F16_TINY = 2.0**-24  # the least positive float16: a scale that rounds below it becomes it


def quantize_q4a8(w: torch.Tensor) -> Int4Weight:
    """4-bit codes of a [N, K] float matrix for the w4a8 kernel: ``w = d * q + m`` per group
    of 32 along K (the last group may be partial: scales and mins are [N, ceil(K / 32)]), with
    d and m float16 values.

    Each group's d and m come from ``quantize_int4``'s least-squares search (K zero padded to
    whole groups), rounded to float16; the codes are then chosen against the rounded values,
    so the kernel computes with exactly ``d * q + m``.
    """
    n, k = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -k % Q4A8_GROUP))
    fitted = quantize_int4(padded, Q4A8_GROUP)
    d = fitted.scales.half().float().clamp_min(_F16_TINY)
    m = fitted.mins.half().float()
    groups = padded.view(n, -1, Q4A8_GROUP)
    q = ((groups - m.unsqueeze(-1)) / d.unsqueeze(-1)).round_().clamp_(0, 15).to(torch.uint8)
    return Int4Weight(q.view(n, -1)[:, :k].contiguous(), d, m)


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
