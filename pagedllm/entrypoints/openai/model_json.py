"""JSON that a model wrote, read without trusting its shape: a grammar or a sampler can drive an
output into any depth of ``[[[[...``, and Python's ``json`` recurses once per level, so text
nested deeper than ``MAX_DEPTH`` is refused before it is parsed."""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

# Deeper than any tool's arguments need, well inside the interpreter's recursion limit.
MAX_DEPTH = 128

# A JSON string (or an unterminated one's rest), skipped by the depth scan: brackets in it are text.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def nesting_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` in ``text`` outside JSON strings (0 for none), in
    one linear pass; a closing bracket too many counts as closing nothing."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    steps = (1 if c in "[{" else -1 for c in brackets)
    return max(accumulate(steps, lambda depth, step: max(depth + step, 0), initial=0))


def loads(text: str) -> Any:
    """``json.loads(text)``, for model output.

    Raises:
        ValueError: ``text`` is not JSON, or is nested deeper than ``MAX_DEPTH``.
    """
    if nesting_depth(text) > MAX_DEPTH:
        raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text)
    except RecursionError:  # a belt: the scan above already bounds the depth
        raise ValueError("JSON nested too deeply") from None
