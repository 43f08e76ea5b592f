"""Random sampling in one call per step (csrc/sampling.cpp): softmax at a temperature, min-p,
top-k, top-p and the draw, per row. Raises on tensors outside its contract (``kernels.args``)."""

from __future__ import annotations

import torch

from pagedllm.kernels.args import check_cpu, check_float32, check_index, ptr, require


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """LongTensor[R]: one token per row of ``logits``, drawn at ``u`` from softmax(logits /
    temperature) kept by min-p, then top-k, then top-p of the mass those keep (the sampler's
    semantics, ``layers/sampler.py``). Rows with top-k or top-p draw most likely first, the
    others in vocabulary order; a -inf logit (or one at or below -3e38) is never drawn; a row
    without a finite maximum above -3e38 gets token 0 (the caller reports such rows).

    Args:
        logits: [R, V] float32 with unit column stride.
        temperature: [R] float32, > 0.
        top_k: [R] int64 (<= 0: off; >= V keeps every token, drawn most likely first).
        top_p: [R] float32 (>= 1: off); min_p: [R] float32 (0: off).
        u: [R] float32 in (0, 1].

    Raises:
        RuntimeError: no native library here.
        ValueError: tensors outside this contract.
    """
    lib = require()
    rows = len(logits)
    check_cpu(logits, temperature, top_p, min_p, u)
    check_float32("sample_rows", logits)
    check_float32("sample_rows", temperature, top_p, min_p, u, contiguous=True)
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"sample_rows needs logits [R, V] with unit column stride, got {list(logits.shape)}")
    if any(t.shape != (rows,) for t in (temperature, top_p, min_p, u)):
        raise ValueError(f"sample_rows needs [{rows}] temperature, top_p, min_p and u")
    check_index(top_k, "top_k", (rows,))
    out = torch.empty(rows, dtype=torch.long)
    lib.sample_rows(
        ptr(logits), logits.stride(0), rows, logits.shape[1], ptr(temperature), ptr(top_k), ptr(top_p), ptr(min_p),
        ptr(u), ptr(out),
    )
    return out
