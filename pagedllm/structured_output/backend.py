"""The grammar engine: llguidance (Microsoft's guidance-ai/llguidance, a Rust library).

Why llguidance rather than xgrammar: it is one abi3 wheel with no dependencies, while
xgrammar pulls in triton (hundreds of MB) on a CPU-only install; it builds a matcher for a
typical JSON schema in well under a millisecond, with no per-vocabulary precomputation, and
computes masks lazily. See docs/benchmarks.md for the figures on this machine.

This module turns ``StructuredOutputsParams`` into llguidance grammars, checks them, and
builds matchers; it knows nothing of requests or batches.
"""

from __future__ import annotations

import functools
import json

import llguidance
import llguidance.hf

from pagedllm.sampling_params import InvalidParamError
from pagedllm.structured_output.params import StructuredOutputsParams

# Compact JSON, no whitespace between tokens (as vLLM's disable_any_whitespace):
# with free whitespace, small models loop on newlines until max_tokens. A schema's own
# "x-guidance" options override this.
_JSON_OPTIONS = {"whitespace_flexible": False}
# Matchers never raise on a bad grammar: they enter an error state. Grammar errors are
# found by ``check`` before a request is queued.
_LOG_LEVEL = 0


def grammar_text(kind: str, text: str) -> str:
    """The llguidance grammar (its JSON form) for a constraint, given as ``params.key``.

    Raises:
        InvalidParamError: a ``json`` schema that is not a JSON object, or a grammar that
            is neither Lark nor GBNF (``param`` names the field).
    """
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "json":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise InvalidParamError("json", f"json is not a JSON schema object: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
    try:  # Lark as is; GBNF (``root ::= ...``) converted to Lark
        return llguidance.grammar_from("grammar", text)
    except ValueError as e:
        raise InvalidParamError("grammar", f"grammar is neither a Lark nor a GBNF grammar: {e}") from None


@functools.lru_cache(maxsize=256)
def _checked(kind: str, text: str) -> str:
    grammar = grammar_text(kind, text)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        what = "schema" if kind in ("json", "json_object") else kind
        raise InvalidParamError(kind, f"the {what} cannot be compiled: {error.strip()}")
    return grammar


def check(params: StructuredOutputsParams) -> str:
    """Compile-check ``params``; return its grammar text (what ``Compiler.compile`` takes).

    Runs the llguidance compiler without a tokenizer (about a millisecond for a typical
    schema; the last 256 results are cached), so the API process can refuse a bad grammar
    before it reaches the engine core.

    Raises:
        InvalidParamError: the schema, regex or grammar does not compile; the message is
            llguidance's (``param`` names the field: ``json``, ``regex``, ``choice``, ...).
    """
    return _checked(*params.key)


class Compiler:
    """Builds matchers for one model's vocabulary.

    Args:
        tokenizer: the model's fast transformers tokenizer.
        vocab_size: the width of the model's logits (the mask covers ids ``[0, vocab_size)``).
        eos_token_ids: the ids that end generation; a finished grammar allows only these.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        # ~1 s for a 49k vocabulary: build once, in the compile thread.
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids)

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher in its initial state for ``grammar`` (from ``check``).

        Raises:
            ValueError: the grammar does not compile against this vocabulary.
        """
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=_LOG_LEVEL)
        if matcher.is_error():
            raise ValueError(f"grammar does not compile: {matcher.get_error()}")
        return matcher
