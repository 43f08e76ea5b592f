"""The batched LoRA update (csrc/lora.cpp): every run of one adapter's tokens in one call."""

from __future__ import annotations

import torch

from pagedllm.kernels import abi
from pagedllm.kernels.args import check_cpu, ptr, require

MAX_RANK = abi.CONSTANTS["PAGEDLLM_LORA_MAX_RANK"]
MAX_PARTS = abi.CONSTANTS["PAGEDLLM_LORA_MAX_PARTS"]
# The A and B element types the kernel reads, and their PAGEDLLM_LORA_* codes.
DTYPE_CODES = {torch.float32: abi.CONSTANTS["PAGEDLLM_LORA_F32"], torch.bfloat16: abi.CONSTANTS["PAGEDLLM_LORA_BF16"]}


def to_panels(m: torch.Tensor) -> torch.Tensor:
    """[rows, cols] -> lora_sgmv's layout of an A.T or a part's B.T, flat and contiguous: the
    columns zero-padded to cols16 (a multiple of 16), cut into panels of 16 columns, panel
    after panel ([cols16 / 16, rows, 16]); m's dtype."""
    rows, cols = m.shape
    padded = m.new_zeros(rows, (cols + 15) // 16 * 16)
    padded[:, :cols] = m
    return padded.view(rows, -1, 16).transpose(0, 1).contiguous().flatten()


def from_panels(flat: torch.Tensor, rows: int) -> torch.Tensor:
    """``to_panels``' inverse: [rows, cols16], the padding columns included (a copy)."""
    return flat.view(-1, rows, 16).transpose(0, 1).reshape(rows, -1)


def lora_sgmv(
    x: torch.Tensor, y: torch.Tensor, part_widths: torch.Tensor, segments: torch.Tensor, a: torch.Tensor,
    b: torch.Tensor, ranks: torch.Tensor, dtype: torch.dtype = torch.float32,
) -> None:
    """``y[t] += (x[t] @ A_s.T) @ B_s.T`` in place for each token t of each run s, B per part.

    Args:
        x: [T, K] float32, rows at any stride, each row contiguous.
        y: [T, N] float32, the same; written in place; its N columns are P parts.
        part_widths: [P] int64, P in [1, MAX_PARTS]: each part's columns, summing to N.
        segments: [S, 2] int64 contiguous: run s is tokens [start, stop).
        a, b: [S] int64: addresses of run s's A.T [K, R] (the parts' rank columns in order,
            R their sum) and of each part's B.T [r, width] (parts of rank 0 left out), one
            after another, each as ``to_panels`` lays it out; in ``dtype`` (the caller keeps
            them alive).
        ranks: [S, MAX_PARTS] int64: run s's rank of each part (0: nothing added to it; entries
            past P ignored), summing to at most MAX_RANK.
        dtype: A and B's element type, a key of ``DTYPE_CODES``; the arithmetic is float32.

    Raises:
        RuntimeError: no native library here.
        ValueError: tensors outside this contract.
    """
    lib = require()
    check_cpu(x, y, part_widths, segments, a, b, ranks)
    if x.dtype != torch.float32 or y.dtype != torch.float32 or x.stride(-1) != 1 or y.stride(-1) != 1:
        raise ValueError("lora_sgmv: x and y must be float32 with contiguous rows")
    if dtype not in DTYPE_CODES:
        raise ValueError(f"lora_sgmv: A and B must be one of {list(DTYPE_CODES)}, got {dtype}")
    s = segments.shape[0]
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in (part_widths, segments, a, b, ranks)) or (
        segments.shape != (s, 2) or a.shape != (s,) or b.shape != (s,) or ranks.shape != (s, MAX_PARTS)
    ):
        raise ValueError("lora_sgmv: segments [S, 2], a, b [S] and ranks [S, MAX_PARTS] must be contiguous int64")
    if part_widths.ndim != 1 or int(part_widths.sum()) != y.shape[1]:
        raise ValueError(f"lora_sgmv: part widths {part_widths.tolist()} do not sum to y's {y.shape[1]} columns")
    if s and int(segments.max()) > x.shape[0] or x.shape[0] != y.shape[0]:
        raise ValueError(f"lora_sgmv: runs beyond x's {x.shape[0]} rows, or y's {y.shape[0]} rows differ")
    if lib.lora_sgmv(ptr(x), x.stride(0), ptr(y), y.stride(0), x.shape[1], ptr(part_widths), part_widths.shape[0],
                     ptr(segments), s, ptr(a), ptr(b), ptr(ranks), DTYPE_CODES[dtype]) != 0:
        raise ValueError(f"lora_sgmv: a rank outside [0, {MAX_RANK}] (summed over parts), a part count outside "
                         f"[1, {MAX_PARTS}] or a reversed run")
