"""What a request's output must match: vLLM's ``StructuredOutputsParams``."""

from __future__ import annotations

import json as jsonlib
from typing import Any

import msgspec

from pagedllm.errors import InvalidParamError

# One of these must be set; ``json_object`` is any JSON object.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Constrain a request's output to a JSON schema, a regex, a list of choices or a grammar.

    Exactly one field is set. A msgspec struct, so it travels to the engine core inside
    ``SamplingParams``.

    Attributes:
        json: a JSON schema, as a dict or its JSON text; a dict is kept as its JSON text
            (msgpack, which carries the params to the engine core, holds no integer past 64
            bits, and a schema may: ``"default": 100000000000000000000``).
        regex: a regular expression the whole output matches (Rust ``regex`` syntax).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar, in Lark syntax (llguidance's) or GBNF/EBNF.
        json_object: any JSON object (OpenAI's ``response_format: json_object``).

    Raises:
        InvalidParamError: at construction, unless exactly one field is set with the right
            type (``param`` names the field: ``"json"``, ``"choice"``, ...).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        self.check()
        if isinstance(self.json, dict):
            try:
                self.json = jsonlib.dumps(self.json, ensure_ascii=False, allow_nan=False)
            except ValueError:
                raise InvalidParamError("json", "the schema holds NaN or Infinity, which are not JSON values") from None
            except TypeError as e:
                raise InvalidParamError("json", f"json must be a JSON schema: {e}") from None
            except RecursionError:
                raise InvalidParamError("json", "the schema nests too deeply") from None

    def check(self) -> None:
        """Exactly one constraint, of the right type (run again before queueing).

        Raises:
            InvalidParamError: naming the field at fault.
        """

        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidParamError(
                kinds[1] if kinds else "structured_outputs",
                f"structured outputs need exactly one of {', '.join(KINDS)}; got {kinds or 'none'}",
            )
        kind = kinds[0]
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, (str, dict)):
            raise InvalidParamError("json", f"json must be a JSON schema (an object), got {type(value).__name__}")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise InvalidParamError(kind, f"{kind} must be a non-empty string, got {value!r:.80}")
        if kind == "choice" and (
            not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value)
        ):
            raise InvalidParamError("choice", f"choice must be a non-empty list of non-empty strings, got {value!r:.80}")
        if kind == "json_object" and value is not True:
            raise InvalidParamError("json_object", f"json_object must be true if set, got {value!r}")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal for equal constraints, the compile cache's key.

        Raises:
            InvalidParamError: ``json`` text that is not JSON.
        """
        from pagedllm.errors import InvalidParamError

        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = jsonlib.loads(value)
                except ValueError as e:
                    raise InvalidParamError("json", f"json is not valid JSON: {e}") from None
            # Key order kept: llguidance emits properties in the schema's order.
            return kind, jsonlib.dumps(value, separators=(",", ":"))
        if kind == "choice":
            return kind, jsonlib.dumps(list(value))
        return kind, "" if kind == "json_object" else value
