"""Next-token masks of a batch's constrained rows, one bit per token, applied to logits in place.

A step's masks can be filled in a background thread (:class:`PendingMasks`) while the forward
pass runs: they depend only on the tokens each matcher has already accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy  # not llguidance.torch: importing it compiles a kernel we do not use (torch._dynamo, seconds)
import numpy as np
import torch

from pagedllm.structured_output.request import StructuredOutputRequest

_executor: llguidance.LLExecutor | None = None
_filler: ThreadPoolExecutor | None = None


def _parallel() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:  # llguidance's own thread pool: masks of many rows fill in parallel
        _executor = llguidance.LLExecutor()
    return _executor


def _background() -> ThreadPoolExecutor:
    global _filler
    if _filler is None:  # one thread: steps run one at a time, so their fills do too
        _filler = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-masks")
    return _filler


def fill_bitmask(
    grammars: Sequence[StructuredOutputRequest], vocab_size: int, drafts: Sequence[Sequence[int]] | None = None
) -> torch.Tensor:
    """The allowed next tokens of each grammar, as bits.

    Args:
        grammars: ready grammar states, one per constrained request.
        vocab_size: V, the logits' width.
        drafts: per grammar, draft tokens to verify (speculative decoding): its rows are the
            masks after 0, 1, ..., k drafts, the matcher left as it was. All drafts but the last
            are allowed; a last one the grammar forbids (a sampled draft kept for the verifier to
            reject) is not consumed, and the row after it, which is never sampled, repeats its
            mask. None: no drafts.

    Returns:
        IntTensor[R, ceil(V / 32)], int32: bit ``t % 32`` of word ``t // 32`` is set when
        token t is allowed; R = sum(len(drafts[i]) + 1), one row per grammar without drafts.
    """
    num_rows = len(grammars) if drafts is None else sum(len(d) + 1 for d in drafts)
    bitmask = llguidance.numpy.allocate_token_bitmask(num_rows, vocab_size)
    if drafts is None and len(grammars) > 1:
        llguidance.numpy.fill_next_token_bitmask_par(
            _parallel(), [(g.matcher, i) for i, g in enumerate(grammars)], bitmask
        )
        return torch.from_numpy(bitmask)
    row = 0
    for i, grammar in enumerate(grammars):
        steps = () if drafts is None else drafts[i]
        consumed = 0
        for token in steps:
            llguidance.numpy.fill_next_token_bitmask(grammar.matcher, bitmask, row)
            consumed += grammar.matcher.try_consume_tokens([token])  # 0 for a forbidden last draft
            row += 1
        llguidance.numpy.fill_next_token_bitmask(grammar.matcher, bitmask, row)
        row += 1
        if consumed:
            grammar.matcher.rollback(consumed)
    return torch.from_numpy(bitmask)


class PendingMasks:
    """The masks of a step's constrained rows (no drafts), being filled in a background thread.

    Until :meth:`masks` returns, the thread reads the matchers of ``grammars``: nothing may
    advance them (the step's forward pass does not).

    Args:
        grammars: ready grammar states, distinct.
        vocab_size: V, the logits' width.
    """

    def __init__(self, grammars: Sequence[StructuredOutputRequest], vocab_size: int) -> None:
        self._rows = {id(g): i for i, g in enumerate(grammars)}
        self._bitmask: Future[torch.Tensor] = _background().submit(fill_bitmask, list(grammars), vocab_size)

    def masks(self, grammars: Sequence[StructuredOutputRequest]) -> torch.Tensor:
        """The masks of ``grammars`` (some of those given, any order), as ``fill_bitmask``
        returns them: IntTensor[len(grammars), ceil(V / 32)]. Waits for the fill.

        Raises:
            Exception: what the fill raised.
        """
        bitmask = self._bitmask.result()
        index = [self._rows[id(g)] for g in grammars]
        return bitmask if index == list(range(bitmask.shape[0])) else bitmask[index]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set the logits of disallowed tokens to -inf, in place; other rows are untouched.

    Args:
        logits: FloatTensor[S, V] on the CPU.
        bitmask: IntTensor[R, ceil(V / 32)] from ``fill_bitmask``.
        rows: R distinct row indices of ``logits``, one per row of ``bitmask``.
    """
    vocab = logits.shape[1]
    # Little-endian words: byte b of word w holds tokens 32w + 8b .. 32w + 8b + 7, low bit first.
    banned = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab].view(np.bool_)
    # Numpy works in this thread: torch would split a fill this small across its thread team,
    # and on busy cores waiting for the team to wake costs more than the fill itself.
    values = logits.numpy()
    if len(rows) == values.shape[0] and list(rows) == list(range(len(rows))):
        np.copyto(values, -np.inf, where=banned)
        return
    for mask, row in zip(banned, rows):
        np.copyto(values[row], -np.inf, where=mask)
