"""What this CPU runs: the dtype and linear-layer policy of ``--dtype auto``, by the native
kernel variant loaded (or the PyTorch fallback without one)."""

from __future__ import annotations

import torch

from pagedllm.config import parse_dtype, parse_kv_cache_dtype
from pagedllm.kernels import library


def dtype_settings(
    dtype: str | torch.dtype, kv_cache_dtype: str = "auto", quantization: str | None = None
) -> dict[str, object]:
    """EngineConfig fields for the dtype and quantization flags.

    "auto" on the native kernels: float32 activations, bfloat16 K/V, and linear layers as
    ``auto_linears()`` picks for the kernels' variant: the GGUF's Q4_K / Q5_K / Q6_K / Q5_0 /
    Q8_0 blocks as stored, w4a8 where it stores Q4_0 / Q4_1 blocks, w8a8 for the other weights
    (the lm_head likewise), or float32. "auto" on the PyTorch fallback (no
    native library): float32 activations and K/V, and the linear layers, the lm_head included,
    as weight-only ``int8`` (GGUF 4-bit and Q8_0 blocks kept as stored). Why each choice, with
    the figures: docs/benchmarks.md ("Small batches at the memory roofline", "PyTorch
    fallback"). Where ``quantization`` names a mode (even "none"), the linear layers are as
    that says. An explicit dtype: that dtype throughout. ``kv_cache_dtype`` other than "auto"
    overrides the K/V dtype ("int8", "fp8" / "fp8_e4m3": the 8-bit caches).

    Raises:
        ValueError: for an unknown dtype name or K/V dtype.
    """
    auto = isinstance(dtype, str) and dtype.lower() == "auto"
    kv = parse_kv_cache_dtype(kv_cache_dtype)
    if auto and library.active_isa() is None:  # the PyTorch fallback: K/V in the model's dtype, never cast
        fallback: dict[str, object] = {"dtype": torch.float32, "kv_cache_dtype": kv, "quantization": quantization}
        if quantization is None:  # weight-only int8, the GGUF's own blocks kept, the lm_head too
            fallback |= {"quantization": auto_linears(), "quantize_lm_head": True}
        return fallback
    settings: dict[str, object] = {
        "dtype": parse_dtype(dtype),
        "kv_cache_dtype": kv or (torch.bfloat16 if auto else None),
        "quantization": quantization or "none",
    }
    linears = auto_linears() if auto and quantization is None else "float32"
    if linears != "float32":
        # Only the file's own 4-bit blocks run as w4a8: auto never lowers a weight's precision.
        settings |= {"quantization": linears, "quantize_lm_head": True, "requantize_4bit": False}
    return settings


def lora_dtype_setting(dtype: str | torch.dtype, lora_dtype: str | torch.dtype = "auto") -> torch.dtype | None:
    """EngineConfig.lora_dtype for the flags: "auto" with dtype "auto" on the native kernels:
    bfloat16 (half the bytes of A and B to read per token tile, widened in registers; figures in
    docs/benchmarks.md, "LoRA adapters"); "auto" otherwise: None (the model's dtype);
    "float32" or "bfloat16": that.

    Raises:
        ValueError: for another name.
    """
    if isinstance(lora_dtype, torch.dtype):
        return lora_dtype
    name = lora_dtype.lower()
    if name == "auto":
        auto = isinstance(dtype, str) and dtype.lower() == "auto"
        return torch.bfloat16 if auto and library.active_isa() is not None else None
    if name in ("float32", "fp32", "bfloat16", "bf16"):
        return parse_dtype(name)
    raise ValueError(f"lora_dtype must be auto, float32 or bfloat16, got {lora_dtype!r}")


# What ``--dtype auto`` runs the linear layers as, by kernel variant (None: no library:
# PyTorch's weight-only int8 kernels); chosen by measurement (docs/benchmarks.md).
_AUTO_LINEARS: dict[str | None, str] = {
    "avx512_bf16": "w4a8", "avx512_vnni": "w4a8", "avx512": "w4a8", "avx2": "w4a8",
    "neon_dotprod": "w8a8", "neon": "w8a8", "scalar": "float32", None: "int8",
}


def auto_linears() -> str:
    """"w4a8", "w8a8", "float32" or "int8": the linear layers ``--dtype auto`` picks for the ISA
    this process's kernels run, "int8" (weight-only) without a library (w4a8's lm_head is w8a8)."""
    return _AUTO_LINEARS[library.active_isa()]
