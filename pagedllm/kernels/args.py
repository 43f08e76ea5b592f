"""Tensors as the kernel wrappers hand them to the library: addresses, and the checks of what
the C code cannot check itself (device, dtype, shape, layout). A tensor outside a kernel's
contract raises ValueError here, before any C code reads or writes out of bounds."""

from __future__ import annotations

import ctypes

import torch

from pagedllm.kernels.library import native_library


def require() -> ctypes.CDLL:
    """The library this process runs.

    Raises:
        RuntimeError: there is none (check ``library.available()``).
    """
    lib = native_library()
    if lib is None:
        raise RuntimeError("no native kernels here (pagedllm/csrc did not build, or PAGEDLLM_DISABLE_NATIVE=1)")
    return lib


def ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def prompt_row(rows: int, prompt_from: int | None) -> int:
    """The C GEMMs' ``prompt_from`` for a call of ``rows`` rows: the first row that is a prompt
    token, or ``rows`` where None (no prompt rows)."""
    return rows if prompt_from is None else prompt_from


def ptr_or_none(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def check_cpu(*tensors: torch.Tensor) -> None:
    """Raises ValueError unless every tensor is on the CPU."""
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"the native kernels read CPU tensors, got one on {t.device}")


def check_float32(name: str, *tensors: torch.Tensor, contiguous: bool = False) -> None:
    """Raises ValueError unless every tensor is float32 (and contiguous, if asked)."""
    for t in tensors:
        if t.dtype != torch.float32 or (contiguous and not t.is_contiguous()):
            layout = "contiguous " if contiguous else ""
            raise ValueError(f"{name} needs {layout}float32 tensors, got {t.dtype} {list(t.shape)}")


def matrix(t: torch.Tensor, name: str) -> torch.Tensor:
    """t itself, checked to be a 2-D CPU tensor."""
    if t.dim() != 2 or t.device.type != "cpu":
        raise ValueError(f"{name} must be a 2-D CPU tensor, got {list(t.shape)} on {t.device}")
    return t


def check_index(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    """Raises ValueError unless t is a contiguous int64 CPU tensor of ``shape``."""
    if t.dtype != torch.int64 or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name}: need contiguous int64 {list(shape)} on the CPU, got {t.dtype} {list(t.shape)}")
