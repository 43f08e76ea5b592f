"""Counters of speculative decoding: drafts proposed, drafts accepted, and where."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Cumulative counts since the engine started (vLLM's definitions).

    Attributes:
        num_drafts: verifications run: request-steps that had at least one draft token.
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: of those, tokens accepted.
        accepted_per_position: entry i counts the drafts whose token at position i was accepted.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verification: ``num_accepted`` of its leading ``num_draft_tokens`` drafts held."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend([0] * (num_draft_tokens - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


def acceptance_rate(num_accepted_tokens: int, num_draft_tokens: int) -> float:
    """Accepted / proposed draft tokens, in [0, 1]; 0 before any draft."""
    return num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0


def mean_acceptance_length(num_accepted_tokens: int, num_drafts: int) -> float:
    """Tokens produced per verification: the accepted drafts plus the one sampled token; 1 before any."""
    return 1.0 + num_accepted_tokens / num_drafts if num_drafts else 1.0
