"""The grammar engine: llguidance (Microsoft's guidance-ai/llguidance, a Rust library).

Why llguidance rather than xgrammar: it is one abi3 wheel with no dependencies, while
xgrammar pulls in triton (hundreds of MB) on a CPU-only install; it builds a matcher for a
typical JSON schema in well under a millisecond, with no per-vocabulary precomputation, and
computes masks lazily. See docs/benchmarks.md for the figures on this machine.

This module checks ``StructuredOutputsParams`` (in an isolated grammar worker, ``checker``)
and builds matchers from the grammars that passed; it knows nothing of requests or batches.
"""

from __future__ import annotations

import llguidance
import llguidance.hf

from pagedllm.structured_output.checker import default_checker
from pagedllm.structured_output.grammar import parser_limits
from pagedllm.structured_output.params import StructuredOutputsParams

# Matchers never raise on a bad grammar: they enter an error state. Grammar errors are
# found by ``check`` before a request is queued.
_LOG_LEVEL = 0


def check(params: StructuredOutputsParams) -> str:
    """Check ``params`` against this process's limits and compile it in a grammar worker;
    return its grammar text (what ``Compiler.compile`` takes). Results are cached.

    Raises:
        InvalidParamError: beyond a limit, does not compile, crashed or outlasted the
            compiler; the message is short (``param`` names the field: ``json``, ``regex``,
            ``choice``, ...).
    """
    return default_checker().check(*params.key)


class Compiler:
    """Builds matchers for one model's vocabulary.

    Args:
        tokenizer: the model's fast transformers tokenizer.
        vocab_size: the width of the model's logits (the mask covers ids ``[0, vocab_size)``).
        eos_token_ids: the ids that end generation; a finished grammar allows only these.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        # ~1 s for a 49k vocabulary: build once, in a compile thread.
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids)

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher in its initial state for ``grammar`` (from ``check``).

        Raises:
            ValueError: the grammar does not compile against this vocabulary.
        """
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=_LOG_LEVEL, limits=parser_limits())
        if matcher.is_error():
            raise ValueError(f"grammar does not compile: {matcher.get_error()}")
        return matcher
