"""The batched LoRA update (csrc/lora.cpp): every run of one adapter's tokens in one call."""

from __future__ import annotations

import torch

from pagedllm.kernels import abi
from pagedllm.kernels.args import check_cpu, ptr, require

MAX_RANK = abi.CONSTANTS["PAGEDLLM_LORA_MAX_RANK"]


def lora_sgmv(
    x: torch.Tensor, y: torch.Tensor, segments: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor, ranks: torch.Tensor
) -> None:
    """``y[t] += (x[t] @ A_s.T) @ B_s.T`` in place for each token t of each run s.

    Args:
        x: [T, K] float32, rows at any stride, each row contiguous.
        y: [T, N] float32, the same; written in place.
        segments: [S, 2] int64 contiguous: run s is tokens [start, stop).
        a_t, b_t: [S] int64: addresses of run s's float32 A.T [K, R_s] and B.T [R_s, N],
            contiguous (the caller keeps them alive).
        ranks: [S] int64: R_s in [0, MAX_RANK] (0: nothing added to that run).

    Raises:
        RuntimeError: no native library here.
        ValueError: tensors outside this contract.
    """
    lib = require()
    check_cpu(x, y, segments, a_t, b_t, ranks)
    if x.dtype != torch.float32 or y.dtype != torch.float32 or x.stride(-1) != 1 or y.stride(-1) != 1:
        raise ValueError("lora_sgmv: x and y must be float32 with contiguous rows")
    s = segments.shape[0]
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in (segments, a_t, b_t, ranks)) or (
        segments.shape != (s, 2) or a_t.shape != (s,) or b_t.shape != (s,) or ranks.shape != (s,)
    ):
        raise ValueError("lora_sgmv: segments [S, 2] and a_t, b_t, ranks [S] must be contiguous int64")
    if s and int(segments.max()) > x.shape[0] or x.shape[0] != y.shape[0]:
        raise ValueError(f"lora_sgmv: runs beyond x's {x.shape[0]} rows, or y's {y.shape[0]} rows differ")
    if lib.lora_sgmv(ptr(x), x.stride(0), ptr(y), y.stride(0), x.shape[1], y.shape[1], ptr(segments), s,
                     ptr(a_t), ptr(b_t), ptr(ranks)) != 0:
        raise ValueError(f"lora_sgmv: a rank outside [0, {MAX_RANK}] or a reversed run")
