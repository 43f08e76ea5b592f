"""N-gram proposer (prompt lookup decoding): drafts copied from earlier in the request's own tokens.

Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` method. The longest suffix of the
request's tokens (prompt + output) of length in [``prompt_lookup_min``, ``prompt_lookup_max``]
that also occurs earlier is found; the drafts are the ``k`` tokens that followed its most
recent earlier occurrence. No model runs, so the drafts carry no distribution (q is one-hot).

Cost per request and step is one vectorized comparison of the last token against the
sequence (O(length), in numpy), then a narrowing of the few candidate positions one token
further back per n-gram length. Each request's tokens live in a numpy buffer that grows by
the step's new tokens only, so no Python list is converted per step.
"""

from __future__ import annotations

from collections.abc import Container

import numpy as np

from pagedllm.core.request import Request
from pagedllm.spec_decode.proposer import max_num_drafts


def find_ngram_drafts(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """The drafts for one sequence (see the module docstring); [] when no n-gram matches.

    Args:
        tokens: int64 array [L], prompt + output so far.
        k: number of drafts wanted.
        min_n, max_n: n-gram lengths tried, longest first in effect.

    Returns:
        k token ids. When the occurrence ends less than k tokens before the end, the copy
        runs on into the tokens it is itself proposing (an overlapping copy, as in LZ77), so
        a periodic tail such as ``a b a b`` keeps its period.
    """
    length = len(tokens)
    if length <= min_n:
        return []
    # ends: positions e < L - 1 where tokens[e - n + 1 : e + 1] equals the n-token suffix.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    n = 1
    while len(ends) and n < max_n:
        longer = ends[ends >= n]
        longer = longer[tokens[longer - n] == tokens[length - 1 - n]]
        if not len(longer):
            break
        ends, n = longer, n + 1
    if n < min_n or not len(ends):
        return []
    start = int(ends[-1]) + 1  # the most recent occurrence
    period = length - start
    drafts = tokens[start : start + k].tolist()
    while len(drafts) < k:
        drafts.append(drafts[len(drafts) - period])
    return drafts


class NgramProposer:
    """Prompt-lookup drafts for every decoding request.

    Args:
        num_speculative_tokens: k, drafts per request and step.
        prompt_lookup_min, prompt_lookup_max: n-gram lengths tried.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._buffers: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (tokens, length)

    def propose(self, requests: list[Request]) -> None:
        """Set ``spec_token_ids`` (and ``spec_probs = None``) of each request; [] when no match."""
        for request in requests:
            k = max_num_drafts(request, self.k)
            drafts = find_ngram_drafts(self._tokens(request), k, self.min_n, self.max_n) if k > 0 else []
            request.spec_token_ids, request.spec_probs = drafts, None

    def remove_finished(self, live: Container[str]) -> None:
        """Drop the buffers of requests that are no longer in ``live`` (finished or aborted)."""
        for request_id in [r for r in self._buffers if r not in live]:
            del self._buffers[request_id]

    def _tokens(self, request: Request) -> np.ndarray:
        """The request's tokens as an int64 array, appending only what is new since last time."""
        buffer, length = self._buffers.get(request.request_id, (None, 0))
        total = request.num_tokens
        if buffer is None or len(buffer) < total:
            grown = np.empty(max(2 * total, 256), dtype=np.int64)
            if buffer is not None:
                grown[:length] = buffer[:length]
            buffer = grown
        buffer[length:total] = request.all_token_ids[length:total]
        self._buffers[request.request_id] = (buffer, total)
        return buffer[:total]
