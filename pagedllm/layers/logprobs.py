"""Log-probabilities of scored tokens and of each row's most likely tokens (vLLM's
``logprobs`` / ``prompt_logprobs``), and the exact top-k that the sampler's truncation shares.

Used by the sampler (logprobs of sampled tokens) and the model runner (prompt logprobs and
speculative verification), always on the model's own logits (vLLM's ``raw_logprobs``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedllm.kernels.logprobs import MAX_TOP, logprobs_rows
from pagedllm.layers.custom_op import CustomOp

_BLOCKS = (64, 32, 16, 8)  # block sizes tried, largest first, by the two-stage ``largest``


class LogprobsTensors(NamedTuple):
    """Top-N logprobs of S positions, the scored token first.

    Attributes:
        token_ids: LongTensor[S, N + 1], the scored token then the N most likely tokens.
        logprobs: FloatTensor[S, N + 1], their log-probabilities.
        ranks: LongTensor[S], the scored token's rank: how many tokens have a logprob at
            least as high as its own (1 = most likely), as vLLM counts it.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


class RowLogprobs(CustomOp):
    """Log-probabilities of one token per row and of the row's N most likely tokens.

    ``forward(logits, token_ids, num_top)``: logits FloatTensor[S, V], unprocessed model
    logits; token_ids LongTensor[S], the token to score at each position (the sampled one, or
    the next prompt token for prompt logprobs); num_top N >= 0. Returns ``LogprobsTensors``
    with token_ids / logprobs of shape [S, N + 1] and ranks [S]. Native: two passes over each
    float32 row (``kernels.logprobs``, N up to its ``MAX_TOP``; equal logits among the N by
    lower token id); PyTorch: logsumexp, a comparison for the ranks and a top-k.
    """

    def forward_native(self, logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
        # logit - logsumexp is log_softmax without materializing another [S, V] float tensor;
        # ranks and top-N are taken on the logits, whose order is the logprobs' order.
        log_norm = logits.logsumexp(dim=-1, keepdim=True)
        token_ids = token_ids.unsqueeze(1)
        token_logits = logits.gather(1, token_ids)
        ranks = (logits >= token_logits).sum(dim=-1)
        top_logits, top_ids = largest(logits, num_top)
        ids = torch.cat([token_ids, top_ids], dim=1)
        return LogprobsTensors(ids, torch.cat([token_logits, top_logits], dim=1) - log_norm, ranks)

    def forward_cpu(self, logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
        if logits.dtype != torch.float32 or logits.stride(-1) != 1 or num_top > MAX_TOP:
            return self.forward_native(logits, token_ids, num_top)  # the kernel reads float32 rows, a few top
        return LogprobsTensors(*logprobs_rows(logits, token_ids.contiguous(), num_top))


def largest(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row of ``values`` [R, V], descending, and their indices.

    Where blocks of b tokens fit (k * b <= V / 4), ``topk`` first runs on the block maxima,
    then on the k best blocks only (k * b entries instead of V), faster than one ``topk``
    over V on the CPU (docs/benchmarks.md). That is exact: every entry of a block left out is at most each of
    the k chosen blocks' maxima, so it cannot displace any of the k largest chosen entries.

    Returns:
        FloatTensor[R, k] values and LongTensor[R, k] token ids.
    """
    num_rows, vocab = values.shape
    block = next((b for b in _BLOCKS if 4 * k * b <= vocab and vocab % b == 0), None)
    if block is None:
        top, ids = values.topk(k, dim=-1)
        return top, ids
    blocks = values.view(num_rows, vocab // block, block)
    best = blocks.amax(dim=-1).topk(k, dim=-1, sorted=False).indices
    candidates = blocks.gather(1, best.unsqueeze(-1).expand(-1, -1, block))
    top, local = candidates.view(num_rows, k * block).topk(k, dim=-1)
    return top, best.gather(1, local // block) * block + local % block
