"""Repetition, presence and frequency penalties of a step's rows in one call
(csrc/penalties.cpp). Raises on tensors outside its contract (``kernels.args``)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.kernels.args import check_cpu, check_float32, check_index, ptr, require


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    offsets: torch.Tensor,
    num_prompt: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> None:
    """Penalize ``logits`` in place (``layers.sampling_metadata.PenaltyTensors`` semantics).

    Args:
        logits: [S, V] float32 with unit column stride.
        rows: [P] int64, distinct rows of ``logits`` in [0, S) (the caller's to keep distinct).
        tokens: [N] int32 in [0, V), row after row each row's prompt tokens then output tokens.
        offsets: [P + 1] int64, row p's tokens are tokens[offsets[p] : offsets[p + 1]].
        num_prompt: [P] int64, how many of those are the prompt's.
        repetition, presence, frequency: [P] float32 (1, 0, 0: off).

    Raises:
        RuntimeError: no native library here.
        ValueError: tensors outside this contract.
    """
    lib = require()
    num_rows, vocab = len(rows), logits.shape[-1]
    check_cpu(logits, tokens, repetition, presence, frequency)
    check_float32("apply_penalties", logits)
    check_float32("apply_penalties", repetition, presence, frequency, contiguous=True)
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"apply_penalties needs logits [S, V] with unit column stride, got {list(logits.shape)}")
    check_index(rows, "rows", (num_rows,))
    check_index(offsets, "offsets", (num_rows + 1,))
    check_index(num_prompt, "num_prompt", (num_rows,))
    if any(t.shape != (num_rows,) for t in (repetition, presence, frequency)):
        raise ValueError(f"apply_penalties needs [{num_rows}] repetition, presence and frequency")
    if tokens.dtype != torch.int32 or tokens.dim() != 1 or not tokens.is_contiguous():
        raise ValueError(f"apply_penalties needs contiguous int32 tokens, got {tokens.dtype} {list(tokens.shape)}")
    if not num_rows:
        return
    # In numpy, in this thread: torch would wake its thread team for each of these small passes.
    o, t, r = offsets.numpy(), tokens.numpy(), rows.numpy()
    if o[0] != 0 or o[-1] != len(t) or (np.diff(o) < num_prompt.numpy()).any():
        raise ValueError("apply_penalties: offsets must run from 0 to len(tokens), each row at least its prompt")
    if len(t) and not (0 <= t.min() and t.max() < vocab):
        raise ValueError(f"apply_penalties: token ids must be in [0, {vocab})")
    if not (0 <= r.min() and r.max() < len(logits)):
        raise ValueError(f"apply_penalties: rows must be in [0, {len(logits)})")
    lib.apply_penalties(
        ptr(logits), logits.stride(0), num_rows, vocab, ptr(rows), ptr(tokens), ptr(offsets), ptr(num_prompt),
        ptr(repetition), ptr(presence), ptr(frequency),
    )
