"""Speculative decoding's n-gram proposer: the longest suffix's most recent match, max_tokens, its buffers."""

from __future__ import annotations

import numpy as np

from pagedllm import SamplingParams
from pagedllm.core.request import Request
from pagedllm.spec_decode.ngram_proposer import NgramProposer, find_ngram_drafts

EOS = 2


def ngram(tokens: list[int], k: int = 4, lo: int = 2, hi: int = 5) -> list[int]:
    return find_ngram_drafts(np.array(tokens, dtype=np.int64), k, lo, hi)


def test_ngram_longest_suffix_most_recent_occurrence() -> None:
    # Suffix [1, 2, 3] occurs at 0 (followed by 4 9 ...) and, one shorter, [2, 3] at 6 (then 8).
    assert ngram([1, 2, 3, 4, 9, 9, 2, 3, 8, 8, 1, 2, 3]) == [4, 9, 9, 2]
    # Two occurrences of the longest match: the most recent one wins.
    assert ngram([5, 6, 1, 5, 6, 2, 5, 6], lo=1) == [2, 5, 6, 2]
    assert ngram([1, 2, 3, 4], lo=1) == []  # no earlier occurrence at all
    assert ngram([7, 1, 2, 9, 2], lo=2) == []  # only a 1-gram matches
    assert ngram([7, 1, 2, 9, 2], lo=1) == [9, 2, 9, 2]


def test_ngram_overlapping_copy_keeps_the_period() -> None:
    assert ngram([4, 1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]
    assert ngram([3, 3, 3], k=3, lo=1) == [3, 3, 3]


def test_ngram_proposer_caps_at_max_tokens_and_frees_state() -> None:
    proposer = NgramProposer(4, 1, 3)
    req = Request("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=3), [EOS], 64)
    proposer.propose([req])
    assert req.spec_token_ids == [3, 1] and req.spec_probs is None  # max_tokens - 1 drafts
    req.append_output_token(3)
    proposer.propose([req])  # the buffer grows by the new token only
    assert req.spec_token_ids == [1]
    proposer.remove_finished(set())
    assert not proposer._buffers
