"""Next-token masks of a batch's constrained rows, one bit per token, applied to logits in place."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.torch
import numpy as np
import torch

from pagedllm.structured_output.request import StructuredOutputRequest

_executor: llguidance.LLExecutor | None = None


def _parallel() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:  # llguidance's own thread pool: masks of many rows fill in parallel
        _executor = llguidance.LLExecutor()
    return _executor


def fill_bitmask(
    grammars: Sequence[StructuredOutputRequest], vocab_size: int, drafts: Sequence[Sequence[int]] | None = None
) -> torch.Tensor:
    """The allowed next tokens of each grammar, as bits.

    Args:
        grammars: ready grammar states, one per constrained request.
        vocab_size: V, the logits' width.
        drafts: per grammar, draft tokens to verify (speculative decoding): its rows are the
            masks after 0, 1, ..., k drafts, the matcher left as it was. None: no drafts.

    Returns:
        IntTensor[R, ceil(V / 32)], int32: bit ``t % 32`` of word ``t // 32`` is set when
        token t is allowed; R = sum(len(drafts[i]) + 1), one row per grammar without drafts.
    """
    num_rows = len(grammars) if drafts is None else sum(len(d) + 1 for d in drafts)
    bitmask = llguidance.torch.allocate_token_bitmask(num_rows, vocab_size)
    if drafts is None and len(grammars) > 1:
        llguidance.torch.fill_next_token_bitmask_par(
            _parallel(), [(g.matcher, i) for i, g in enumerate(grammars)], bitmask
        )
        return bitmask
    row = 0
    for i, grammar in enumerate(grammars):
        steps = () if drafts is None else drafts[i]
        for token in steps:
            llguidance.torch.fill_next_token_bitmask(grammar.matcher, bitmask, row)
            grammar.matcher.consume_token(token)  # drafts were checked against the grammar
            row += 1
        llguidance.torch.fill_next_token_bitmask(grammar.matcher, bitmask, row)
        row += 1
        if steps:
            grammar.matcher.rollback(len(steps))
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set the logits of disallowed tokens to -inf, in place; other rows are untouched.

    Args:
        logits: FloatTensor[S, V].
        bitmask: IntTensor[R, ceil(V / 32)] from ``fill_bitmask``.
        rows: R distinct row indices of ``logits``, one per row of ``bitmask``.
    """
    vocab = logits.shape[1]
    # Little-endian words: byte b of word w holds tokens 32w + 8b .. 32w + 8b + 7, low bit first.
    banned = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    banned_t = torch.from_numpy(banned).view(torch.bool)
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        logits.masked_fill_(banned_t, -torch.inf)
        return
    index = torch.tensor(rows, dtype=torch.long)
    logits[index] = logits[index].masked_fill_(banned_t, -torch.inf)
