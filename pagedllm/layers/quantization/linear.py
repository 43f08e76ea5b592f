"""Linear layers over packed int8 / int4 weights, on PyTorch's CPU kernels.

- per-channel int8: ``aten._weight_int8pack_mm`` (int8 [N, K] codes, one scale per row);
- group-wise int4: ``aten._weight_int4pack_mm_for_cpu`` over ``_convert_weight_to_int4pack_for_cpu``
  (two codes per byte; per group a scale and the zero point ``w(code 8)``; ``w = (q - 8) * s + z``);
- group-wise int8 (GGUF Q8_0 blocks): the int4 kernel over the weight split in two nibble
  halves (``weights.int8_as_int4_pair``), the input repeated; torch has no such int8 kernel.

Activations go through these kernels in bfloat16 (``weights.KERNEL_DTYPE``) whatever the
model's dtype, and outputs are cast back to the input's dtype, so a float32 model can use
these layers too. Why bfloat16: the kernels' fast path is bfloat16, and with float32 or
float16 activations they take a far slower reference path (docs/benchmarks.md).

Also the layers on our native integer GEMMs (csrc/linear.cpp, csrc/kquant.cpp): ``W8A8Linear``,
``W4A8Linear``, ``Q8A8Linear`` and ``KQuantLinear``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.kernels import kquant, library
from pagedllm.kernels import linear as kernels
from pagedllm.layers.linear import pad_to_panels
from pagedllm.layers.quantization.weights import (
    KERNEL_DTYPE,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    int8_as_int4_pair,
)

_aten = torch.ops.aten
_INT4_ROW_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu wants N % 16 == 0
_prompt_from: int | None = None  # set by prompt_rows


@contextlib.contextmanager
def prompt_rows(first: int | None) -> Iterator[None]:
    """Within it, the int8 layers (``W8A8Linear``, ``Q8A8Linear``, ``W4A8Linear``,
    ``KQuantLinear``) called on a step's rows take rows ``first`` on as prompt tokens, on their
    prompt kernel, as the one-call decoder does (``CausalLM.forward``). A caller that passes a
    layer other rows (an expert's tokens) sets None: no prompt rows."""
    global _prompt_from
    was, _prompt_from = _prompt_from, first
    try:
        yield
    finally:
        _prompt_from = was


class QuantizedLinear(nn.Module):
    """``y = x @ w.T + bias`` with ``w`` packed; subclasses hold the packed buffers.

    Args:
        in_features, out_features: the matrix is [out_features, in_features].
        bias: [out_features] float, or None; kept float (cast with the model's other floats).
    """

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] float (rows may be strided) -> [T, out_features] in x's dtype."""
        y = self._matmul(x.to(KERNEL_DTYPE).contiguous())  # torch's packed kernels want dense rows
        if self.bias is not None:
            y = y + self.bias  # in the wider of the two dtypes
        return y.to(x.dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in_features] bfloat16 -> [T, out_features] bfloat16."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(QuantizedLinear):
    """Per-output-channel int8 weights: buffers ``qweight`` [N, K] int8 and ``scales`` [N] bfloat16."""

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None = None) -> None:
        if weight.scales.shape[1] != 1:
            raise ValueError(f"Int8Linear needs one scale per row, got group size {weight.group_size}")
        super().__init__(weight.q.shape[1], weight.q.shape[0], bias)
        self.register_buffer("qweight", weight.q.contiguous())
        self.register_buffer("scales", weight.scales[:, 0].to(KERNEL_DTYPE))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _aten._weight_int8pack_mm(x, self.qweight, self.scales)


class Int4Linear(QuantizedLinear):
    """Group-wise int4 weights: buffers ``packed`` (the kernel's layout, uint8 [N', K / 2]) and
    ``scales_and_zeros`` [K / group_size, N', 2] bfloat16, N' being N rounded up to 16 (the
    padding rows are zero; their outputs are dropped)."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None) -> None:
        n, k = weight.q.shape
        super().__init__(k, n, bias)
        self.group_size = weight.group_size
        pad = -n % _INT4_ROW_MULTIPLE
        q = nn.functional.pad(weight.q.to(torch.int32), (0, 0, 0, pad))
        zeros = weight.mins + 8 * weight.scales
        scales_and_zeros = torch.stack([weight.scales, zeros], dim=-1)  # [N, G, 2]
        scales_and_zeros = nn.functional.pad(scales_and_zeros, (0, 0, 0, 0, 0, pad))
        self.register_buffer("packed", _aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).to(KERNEL_DTYPE).contiguous())

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = _aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)
        return y if y.shape[1] == self.out_features else y[:, : self.out_features]


class Int8BlockLinear(Int4Linear):
    """Group-wise int8 weights (GGUF Q8_0) on the int4 kernel: see ``weights.int8_as_int4_pair``."""

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__(int8_as_int4_pair(weight), bias)
        self.in_features = weight.q.shape[1]

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return super()._matmul(torch.cat([x, x], dim=-1))


class W8A8Linear(QuantizedLinear):
    """int8 weights symmetric per output feature, int8 activations symmetric per group of 32.

    Each row of the weight has one scale (``max|w| / 127``, as vLLM's channel-wise int8
    weights); each row of ``x`` is quantized on the fly per group of 32 input features (as
    llama.cpp's Q8_0 activations), so an outlier feature costs precision only in its own
    group (perplexity beside per-group weight scales and float: docs/benchmarks.md). The sums
    run on our native kernel (``csrc/linear.cpp``, the vector layer's int8 dot product, e.g.
    AVX512-VNNI's ``vpdpbusd``): each group's int32 sum takes one multiply-add with x's scale,
    the weight's scale multiplies once at the end; it reads one byte per weight. Buffers:
    ``packed`` int8 panels (in the kernels' byte encoding), ``wscale`` (float32) per padded
    row, the bias in float32, padded to whole panels.

    Args:
        weight: [out_features, in_features] float.
        bias: [out_features] or None.
        row_max: [out_features], the max|w| of whole rows this weight is a tensor-parallel
            slice of (``kernels.linear_pack_w8a8``), or None: its own rows'.

    Raises:
        ValueError: where the native kernels are missing.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, row_max: torch.Tensor | None = None
    ) -> None:
        n, k = weight.shape
        super().__init__(k, n, None)
        _require_native("w8a8")
        packed, wscale = kernels.linear_pack_w8a8(weight.detach(), row_max)
        self.register_buffer("packed", packed)
        self.register_buffer("wscale", wscale)
        self.register_buffer("padded_bias", None if bias is None else pad_to_panels(bias.detach().float()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] float (rows may be strided) -> [T, out_features] in x's dtype; the
        step's prompt rows (``prompt_rows``) on the prompt kernel."""
        packed = (self.packed, self.wscale)
        y = kernels.linear_w8a8(x.float(), packed, self.padded_bias, self.out_features, _prompt_from)
        return y.to(x.dtype)

    def native_desc(self) -> kernels.LinearDesc:
        """This layer for the one-call decoder (``kernels.decoder.decode_layers``)."""
        packed = (self.packed, self.wscale)
        return kernels.linear_desc(kernels.LINEAR_W8A8, packed, self.padded_bias, self.out_features, self.in_features)


class W4A8Linear(QuantizedLinear):
    """4-bit weights and int8 activations: llama.cpp's Q4_1 x Q8_1 dot product, on our native
    kernel (``csrc/linear.cpp``'s w4a8 GEMM).

    Each group of 32 weights of a row is ``d * q + m`` with codes q in [0, 15] and d, m in
    float16 (GGUF Q4_1 as stored; Q4_0 with m = -8 d, run as ``symmetric``); each row of ``x``
    is quantized on the fly per group of 32 as W8A8Linear does, with the group's code sum for
    the m term. It
    reads 0.625 bytes per weight, half of w8a8's: the faster of the two where a step is bound
    by reading weights (decode of few tokens). Buffers: ``packed`` (uint8 panels, codes and
    float16 d, m interleaved per group), the bias in float32, padded to whole panels.

    Args:
        weight: codes [out_features, in_features] with scales and mins
            [out_features, ceil(in_features / 32)] (``weights.quantize_q4a8``, or GGUF Q4_0 /
            Q4_1 blocks); scales and mins are taken in float16.
        bias: [out_features] or None.

    Raises:
        ValueError: where the native kernels are missing, or the weight's groups are not of 32.
    """

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None) -> None:
        n, k = weight.q.shape
        super().__init__(k, n, None)
        _require_native("w4a8")
        self.symmetric = kernels.q4a8_symmetric(weight.scales, weight.mins)  # packed without mins
        mins = None if self.symmetric else weight.mins
        self.register_buffer("packed", kernels.linear_pack_q4a8(weight.q, weight.scales, mins))
        self.register_buffer("padded_bias", None if bias is None else pad_to_panels(bias.detach().float()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] float (rows may be strided) -> [T, out_features] in x's dtype; the
        step's prompt rows (``prompt_rows``) on the prompt kernel."""
        y = kernels.linear_q4a8(x.float(), self.packed, self.padded_bias, self.out_features, _prompt_from, self.symmetric)
        return y.to(x.dtype)

    def native_desc(self) -> kernels.LinearDesc:
        """This layer for the one-call decoder (``kernels.decoder.decode_layers``)."""
        kind = kernels.LINEAR_Q4A8_SYMMETRIC if self.symmetric else kernels.LINEAR_Q4A8
        return kernels.linear_desc(kind, self.packed, self.padded_bias, self.out_features, self.in_features)


def _require_native(mode: str) -> None:
    if not library.available():
        raise ValueError(f"{mode} needs the native kernels, which do not run here")


class KQuantLinear(QuantizedLinear):
    """GGUF blocks (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0; the parts of a fused layer each in its own
    format) against int8 activations: llama.cpp's Q4_K x Q8_K family on our native kernel
    (``csrc/kquant.cpp``), reading exactly the file's bytes per weight. The blocks are
    repacked at load into the GEMM's 32-row panels (``kernels.kquant.panels``: every M one
    tile, so a row's logits do not depend on the batch), or kept as stored where this
    library's int8 dot product cannot take them so (Q8_0 codes of -128 off VNNI). Activations
    are quantized per row and group of 32 as W8A8Linear does. Buffers: each part's panels or
    blocks (``blocks0``, ...; uint8), the bias in float32, padded to whole panels.

    Args:
        weight: the stored weight (``kernels.kquant.StoredWeight``).
        bias: [out_features] or None.

    Raises:
        ValueError: where the native kernels do not run.
    """

    def __init__(self, weight: kquant.StoredWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.in_features, weight.out_features, None)
        _require_native("GGUF blocks as stored")
        self.stored = kquant.panels(weight) or weight
        for i, part in enumerate(self.stored.parts):
            self.register_buffer(f"blocks{i}", part[1])
        self.register_buffer("padded_bias", None if bias is None else pad_to_panels(bias.detach().float()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] float (rows may be strided) -> [T, out_features] in x's dtype; the
        step's prompt rows (``prompt_rows``) on the prompt kernel (weights in panels)."""
        return kquant.linear(x.float(), self.stored, self.padded_bias, _prompt_from).to(x.dtype)

    def native_desc(self) -> kernels.LinearDesc:
        """This layer for the one-call decoder (``kernels.decoder.decode_layers``)."""
        return kquant.linear_desc(self.stored, self.padded_bias)

    def extra_repr(self) -> str:
        parts = self.stored.parts
        types = ", ".join(f"{p[0]}: {p[2] if len(p) == 3 else p[1].shape[0]} rows" for p in parts)
        layout = "panels" if isinstance(self.stored, kquant.PanelWeight) else "as stored"
        return f"{super().extra_repr()}, ggml types {{{types}}} ({layout})"


class Q8A8Linear(QuantizedLinear):
    """GGUF Q8_0 blocks (``w = d * q`` per group of 32 inputs of a row, d float16) against int8
    activations per group of 32: llama.cpp's Q8_0 x Q8_0 product on our native w8a8 tile
    (``csrc/linear.cpp``'s q8a8 GEMM), codes and d copied bit for bit into panels at load, so
    it reads the file's 1.0625 bytes per weight. Against the K-quant GEMM on the same blocks
    (``KQuantLinear``: the same products, summed in another order) each group's scaling is
    shared by a 32-column tile's dot products instead of paid per activation row, so a decode
    step's few rows (a batch, a speculative verification) cost little more than one. Buffers:
    ``packed`` (int8 panels), ``d`` (float16 per panel, group and column), the bias in float32,
    padded to whole panels.

    Args:
        packed: ``kernels.linear_pack_q8_0``'s two tensors.
        in_features, out_features: the weight's shape [out_features, in_features].
        bias: [out_features] or None.
    """

    def __init__(
        self, packed: kernels.Q8A8Packed, in_features: int, out_features: int, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__(in_features, out_features, None)
        self.register_buffer("packed", packed[0])
        self.register_buffer("d", packed[1])
        self.register_buffer("padded_bias", None if bias is None else pad_to_panels(bias.detach().float()))
        kernels.linear_desc(kernels.LINEAR_Q8A8, packed, self.padded_bias, out_features, in_features)  # checks the fit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] float (rows may be strided) -> [T, out_features] in x's dtype; the
        step's prompt rows (``prompt_rows``) on the prompt kernel."""
        y = kernels.linear_q8a8(x.float(), (self.packed, self.d), self.padded_bias, self.out_features, _prompt_from)
        return y.to(x.dtype)

    def native_desc(self) -> kernels.LinearDesc:
        """This layer for the one-call decoder (``kernels.decoder.decode_layers``)."""
        packed = (self.packed, self.d)
        return kernels.linear_desc(kernels.LINEAR_Q8A8, packed, self.padded_bias, self.out_features, self.in_features)


def stored_linear(weight: kquant.StoredWeight, bias: torch.Tensor | None = None) -> Q8A8Linear | KQuantLinear:
    """The layer for GGUF blocks kept as stored: ``Q8A8Linear`` for a weight all of Q8_0 blocks
    that this library's int8 dot product takes (``kernels.linear_pack_q8_0``), else ``KQuantLinear``.

    Raises:
        ValueError: where the native kernels do not run.
    """
    _require_native("GGUF blocks as stored")
    if len(weight.parts) == 1 and weight.parts[0][0] == int(GGMLQuantizationType.Q8_0):
        packed = kernels.linear_pack_q8_0(weight.parts[0][1], weight.in_features)
        if packed is not None:
            return Q8A8Linear(packed, weight.in_features, weight.out_features, bias)
    return KQuantLinear(weight, bias)


def make_linear(weight: QuantizedWeight, bias: torch.Tensor | None = None) -> QuantizedLinear:
    """The layer that runs ``weight``'s layout (int8 per channel, int8 in groups, or int4)."""
    if isinstance(weight, Int4Weight):
        return Int4Linear(weight, bias)
    if weight.scales.shape[1] == 1:
        return Int8Linear(weight, bias)
    return Int8BlockLinear(weight, bias)
