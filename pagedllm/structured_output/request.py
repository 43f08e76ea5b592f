"""One sequence's grammar state in the engine core."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import llguidance

from pagedllm.errors import InvalidParamError
from pagedllm.structured_output.grammar import short_error


class StructuredOutputRequest:
    """A sequence's matcher: absent while its grammar compiles, then advanced with every
    output token the sequence accepts (so it survives preemption, which keeps output tokens).

    Args:
        compiled: resolves to a matcher in its initial state, shared through the compile
            cache; this sequence advances a copy of its own.
    """

    def __init__(self, compiled: Future[llguidance.LLMatcher]) -> None:
        self._compiled = compiled
        self._matcher: llguidance.LLMatcher | None = None

    @property
    def compiled(self) -> Future[llguidance.LLMatcher]:
        return self._compiled

    @property
    def is_ready(self) -> bool:
        """Whether the grammar has compiled (the scheduler skips the sequence until then).

        Raises:
            Exception: what the compilation raised (the sequence cannot run).
        """
        if self._matcher is None:
            if not self._compiled.done():
                return False
            self._matcher = self._compiled.result().deep_copy()
        return True

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """The matcher (only once ``is_ready``)."""
        assert self._matcher is not None, "the grammar has not compiled yet"
        return self._matcher

    def accept(self, token_id: int) -> None:
        """Advance past an output token; a token the grammar forbids, or one that takes it past
        a parser or lexer limit, leaves the matcher in its error state (see ``error``)."""
        self.matcher.consume_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete (or broken): no token but EOS can follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> InvalidParamError | None:
        """Why the matcher failed, or None. Tokens are sampled under the grammar's mask, so
        what fails is the grammar: a parser or lexer limit hit at some token (a row of more
        than 2000 items, a regex whose lexer states outgrow the limit). That is the request's
        own constraint at fault: ``param`` is ``structured_outputs``."""
        if not self.matcher.is_error():
            return None
        return InvalidParamError(
            "structured_outputs", f"the grammar failed while generating: {short_error(self.matcher.get_error())}"
        )

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` (drafts) the grammar allows in a row from here; state unchanged."""
        return self.matcher.validate_tokens(list(token_ids))
