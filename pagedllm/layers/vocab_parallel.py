"""The vocabulary split over tensor-parallel ranks: embedding lookup and logits gather.

Each rank holds rows [start, start + rows) of the embedding (and of an untied lm_head, see
``distributed/sharding.py``). A lookup gives the rank's rows for ids in its range and zeros
for the rest, summed over the ranks: exactly the one rank's row, as the sum adds only zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TPGroup


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[vocab_start, vocab_start + weight.shape[0])`` of the vocabulary's embedding.

    Args:
        weight: [rows, hidden] this rank's rows (``weight`` like ``nn.Embedding``'s, frozen).
        vocab_start: the id of its first row.
        tp: the group whose ranks hold the other rows.
    """

    def __init__(self, weight: torch.Tensor, vocab_start: int, tp: TPGroup) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
        self.vocab_start = vocab_start
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] int64 (any id of the vocabulary) -> [T, hidden], equal on every rank."""
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)


def gather_logits(logits: torch.Tensor, vocab_size: int, vocab_padded: int, tp: TPGroup) -> torch.Tensor | None:
    """Every rank's logits of its vocabulary rows, side by side on rank 0.

    Args:
        logits: [S, rows] float32, this rank's columns (the last rank's may be fewer; every
            rank must call with the same S).
        vocab_padded: the most rows a rank holds: each rank's logits are padded to it.

    Returns:
        [S, vocab_size] float32, contiguous, on rank 0; None on the others.
    """
    if logits.shape[-1] < vocab_padded:
        logits = F.pad(logits, (0, vocab_padded - logits.shape[-1]))
    full = tp.gather_last_dim(logits)
    return None if full is None else full[..., :vocab_size].contiguous()
