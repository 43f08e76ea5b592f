"""What the engine core asks of a draft proposer, and how many drafts a request can use."""

from __future__ import annotations

from collections.abc import Container
from typing import Protocol

from pagedllm.core.request import Request


class Proposer(Protocol):
    """Drafts tokens for decoding requests, after each step, for the next step to verify."""

    def propose(self, requests: list[Request]) -> None:
        """Set each request's ``spec_token_ids`` and ``spec_probs`` (FloatTensor[k, V] or None)."""

    def remove_finished(self, live: Container[str]) -> None:
        """Forget per-request state of every request id not in ``live``."""


def max_num_drafts(request: Request, k: int) -> int:
    """Drafts worth proposing: at most k, and none past ``max_tokens`` (a verification always
    emits one token after its accepted drafts). May be 0 or negative."""
    return min(k, request.max_tokens - request.num_output_tokens - 1)
