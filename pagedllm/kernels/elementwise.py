"""The fused elementwise kernels (csrc/elementwise.cpp): residual add + RMSNorm, RoPE, the
gated activations and a row-wise argmax, each one pass over float32 rows. Each call raises on
tensors outside its contract (``kernels.args``)."""

from __future__ import annotations

import torch

from pagedllm.kernels.args import check_cpu, check_float32, ptr, require


def add_rms_norm(x: torch.Tensor | None, stream: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``stream += x`` in place (x None: stream as it is), then RMSNorm of ``stream`` by
    ``weight``: the normalized [..., H] float32.

    Args:
        x: [..., H] float32, contiguous, stream's shape; or None.
        stream: [..., H] float32, contiguous: the residual stream.
        weight: [H] float32, contiguous; eps: added to the mean square.

    Raises:
        RuntimeError: no native library here.
        ValueError: tensors outside this contract.
    """
    lib = require()
    tensors = [stream, weight] if x is None else [x, stream, weight]
    check_cpu(*tensors)
    check_float32("add_rms_norm", *tensors, contiguous=True)
    h = stream.shape[-1]
    if (x is not None and x.shape != stream.shape) or weight.shape != (h,):
        x_shape = None if x is None else list(x.shape)
        raise ValueError(f"add_rms_norm: x {x_shape}, stream {list(stream.shape)}, weight {list(weight.shape)}")
    out = torch.empty_like(stream)
    lib.add_rms_norm(None if x is None else ptr(x), ptr(stream), ptr(weight), ptr(out), stream.numel() // h, h, eps)
    return out


def rotary_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """Rotate the leading R dims of each head of ``x`` in place by cos and signed sin
    (``RotaryEmbedding.forward``'s layout; the other D - R dims unchanged), then multiply each
    head by its row of ``scale``.

    Args:
        x: [T, heads, D] float32, heads contiguous (rows at any stride).
        cos, sin: [T, 1, R] float32, R even and at most D, the two halves of one [T, 2, R]
            buffer's rows (sin right after cos).
        scale: [heads, D] float32, contiguous, or None (no multiply).

    Raises:
        RuntimeError: no native library here.
        ValueError: tensors outside this contract.
    """
    lib = require()
    check_cpu(x, cos, sin)
    check_float32("rotary", x, cos, sin)
    t, heads, d = x.shape
    r = cos.shape[-1]
    if x.stride(2) != 1 or x.stride(1) != d:
        raise ValueError(f"rotary: x's heads must be contiguous, got strides {x.stride()}")
    if (
        r % 2 or r > d or cos.shape != (t, 1, r) or sin.shape != cos.shape or cos.stride(0) != 2 * r
        or cos.stride(-1) != 1 or sin.data_ptr() != cos.data_ptr() + r * cos.element_size()
    ):
        raise ValueError(f"rotary: cos/sin {list(cos.shape)}, {list(sin.shape)} are not RotaryEmbedding's rows for x {list(x.shape)}")
    if scale is not None:
        check_cpu(scale)
        check_float32("rotary", scale, contiguous=True)
        if scale.shape != (heads, d):
            raise ValueError(f"rotary: scale must be [{heads}, {d}], got {list(scale.shape)}")
    lib.rotary_inplace(ptr(x), x.stride(0), ptr(cos), t, heads, d, r, None if scale is None else ptr(scale))


def silu_and_mul(gate_up: torch.Tensor) -> None:
    """``gate = silu(gate) * up`` in place, gate_up: [T, 2 * I] float32 (gate first, rows at
    any stride).

    Raises:
        RuntimeError: no native library here.
        ValueError: tensors outside this contract.
    """
    _act_and_mul("silu_and_mul", gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> None:
    """``gate = gelu_tanh(gate) * up`` in place (GELU's tanh approximation), as ``silu_and_mul``."""
    _act_and_mul("gelu_tanh_and_mul", gate_up)


def _act_and_mul(kernel: str, gate_up: torch.Tensor) -> None:
    lib = require()
    check_cpu(gate_up)
    check_float32(kernel, gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"{kernel} needs [T, 2 * I] with unit column stride, got {list(gate_up.shape)}")
    getattr(lib, kernel)(ptr(gate_up), gate_up.stride(0), gate_up.shape[0], gate_up.shape[1] // 2)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """LongTensor[S]: the first index of each row's maximum of logits [S, V] float32,
    contiguous, as ``argmax`` gives it.

    Raises:
        RuntimeError: no native library here.
        ValueError: tensors outside this contract.
    """
    lib = require()
    check_cpu(logits)
    check_float32("argmax_rows", logits, contiguous=True)
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows needs [S, V], got {list(logits.shape)}")
    out = torch.empty(logits.shape[0], dtype=torch.long)
    lib.argmax_rows(ptr(logits), logits.shape[0], logits.shape[1], ptr(out))
    return out
