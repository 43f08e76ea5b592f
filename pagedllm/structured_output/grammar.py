"""Constraints as llguidance grammars, and the full compile check that runs in a grammar worker.

Imports llguidance only (no tokenizer library), so a grammar worker process starts quickly.
"""

from __future__ import annotations

import json

import llguidance

from pagedllm.errors import InvalidParamError

# Compact JSON, no whitespace between tokens (as vLLM's disable_any_whitespace):
# with free whitespace, small models loop on newlines until max_tokens. A schema's own
# "x-guidance" options override this.
_JSON_OPTIONS = {"whitespace_flexible": False}
# Longest error message passed on to a client; llguidance's can echo the whole grammar.
MAX_ERROR_CHARS = 300
# Bytes of output compile_check walks after the first mask: some limits are hit only once output
# starts (a{1000000}'s lexer expressions, after its first byte), and would fail the request
# while it generates, after a stream's 200.
CHECKED_BYTES = 8


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's resource limits, with errors that never echo the grammar or the parser state."""
    return llguidance.LLParserLimits(verbose_errors=False)


def short_error(message: str) -> str:
    """The first line of a library error, with the reason of a regex error (the later line
    "error: ..." of ``regex parse error:``, whose lines between echo the pattern), at most
    ``MAX_ERROR_CHARS`` characters."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    line = lines[0] if lines else "unknown error"
    reason = next((rest for rest in lines[1:] if rest.startswith("error:")), None)
    if reason:
        line = f"{line} {reason.removeprefix('error:').strip()}"
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."


def grammar_text(kind: str, text: str) -> str:
    """The llguidance grammar (its JSON form) for a constraint, given as ``params.key``.

    Raises:
        InvalidParamError: a ``json`` schema that is not a JSON schema object, or a grammar
            that is neither Lark nor GBNF (``param`` names the field).
    """
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "json":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise InvalidParamError("json", f"json is not a JSON schema object: {short_error(str(e))}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        # One terminal: its alternatives go to the lexer. As alternatives of a rule, each would
        # be an item of the parser's first row, which holds at most 2000 (``max_items_in_row``).
        choices = " | ".join(json.dumps(c) for c in json.loads(text))
        return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {choices}")
    try:  # Lark as is; GBNF (``root ::= ...``) converted to Lark
        return llguidance.grammar_from("grammar", text)
    except ValueError as e:
        raise InvalidParamError("grammar", f"grammar is neither a Lark nor a GBNF grammar: {short_error(str(e))}") from None


class _Bytes:
    """A vocabulary of the 256 single bytes and an end token: enough for llguidance to build a
    matcher and its first mask for any grammar, whatever model will run it."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


_byte_tokenizer: llguidance.LLTokenizer | None = None


def compile_check(kind: str, text: str) -> str:
    """Compile a constraint as the engine will, against a byte vocabulary, and compute its
    first mask, then the masks of ``CHECKED_BYTES`` bytes of output (each the lowest byte the
    mask allows); return its grammar text (what ``Compiler.compile`` takes).

    Finds what a compile without a vocabulary misses: rules that can never finish (``a: a
    "x"``, a schema that is its own ``$ref``) and parser limits hit in the first bytes.

    Raises:
        InvalidParamError: ``param`` is ``kind``; a short message, never the grammar.
    """
    global _byte_tokenizer
    grammar = grammar_text(kind, text)
    what = "schema" if kind in ("json", "json_object") else kind
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if error:
        raise InvalidParamError(kind, f"the {what} cannot be compiled: {short_error(error)}")
    if _byte_tokenizer is None:
        _byte_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=257, eos_token=256)
    matcher = llguidance.LLMatcher(_byte_tokenizer, grammar, log_level=0, limits=parser_limits())
    for _ in range(1 + CHECKED_BYTES):
        if matcher.is_error():
            break
        allowed = int.from_bytes(matcher.compute_bitmask()[:32], "little")  # bytes 0-255, not the end
        if matcher.is_error() or not allowed:
            break
        matcher.consume_token((allowed & -allowed).bit_length() - 1)
    if matcher.is_error():
        error = short_error(matcher.get_error())
        if "NoExtensionBias" in error:
            error = "no output can complete it (a rule or $ref that only refers to itself)"
        raise InvalidParamError(kind, f"the {what} cannot be compiled: {error}")
    return grammar
