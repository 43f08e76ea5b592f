"""Log-probabilities of a token per row, the row's most likely tokens and the token's rank, in
one call (csrc/logprobs.cpp). Raises on tensors outside its contract (``kernels.args``)."""

from __future__ import annotations

import torch

from pagedllm.kernels.args import check_cpu, check_float32, check_index, ptr, require

# The kernel keeps a row's top-N by insertion, O(V * N) per row: for the few tokens logprobs
# ask for (at most 20), not for thousands, where a row would take seconds.
MAX_TOP = 64


def logprobs_rows(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The log-probabilities (log_softmax of each row) of ``token_ids`` and of each row's
    ``num_top`` largest logits, largest first, equal logits by lower token id.

    Args:
        logits: [R, V] float32 with unit column stride, finite but for -inf (never a whole row).
        token_ids: [R] int64, each in [0, V).
        num_top: 0 <= num_top <= min(V, ``MAX_TOP``).

    Returns:
        LongTensor[R, num_top + 1] token ids (column 0: ``token_ids``), FloatTensor[R,
        num_top + 1] their log-probabilities, LongTensor[R] the number of tokens whose logit is
        at least the token's (1: the most likely).

    Raises:
        RuntimeError: no native library here.
        ValueError: tensors outside this contract.
    """
    lib = require()
    rows = len(logits)
    check_cpu(logits)
    check_float32("logprobs_rows", logits)
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logprobs_rows needs logits [R, V] with unit column stride, got {list(logits.shape)}")
    vocab = logits.shape[1]
    check_index(token_ids, "token_ids", (rows,))
    if not 0 <= num_top <= min(vocab, MAX_TOP):
        raise ValueError(f"logprobs_rows: num_top must be in [0, {min(vocab, MAX_TOP)}], got {num_top}")
    if rows and not (0 <= int(token_ids.min()) and int(token_ids.max()) < vocab):
        raise ValueError(f"logprobs_rows: token ids must be in [0, {vocab})")
    ids = torch.empty(rows, num_top + 1, dtype=torch.long)
    logprobs = torch.empty(rows, num_top + 1, dtype=torch.float32)
    ranks = torch.empty(rows, dtype=torch.long)
    if rows:
        lib.logprobs_rows(
            ptr(logits), logits.stride(0), rows, vocab, ptr(token_ids), num_top, ptr(ids), ptr(logprobs), ptr(ranks)
        )
    return ids, logprobs, ranks
