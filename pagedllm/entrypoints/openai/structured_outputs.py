"""The request fields that ask for structured output, in OpenAI's and vLLM's shapes, as one
``StructuredOutputsParams`` (compile-checked, so a bad one is a 400 naming its field)."""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.protocol import SamplingRequest
from pagedllm.errors import InvalidParamError
from pagedllm.structured_output import StructuredOutputsParams, backend
from pagedllm.structured_output.params import KINDS

# vLLM's older per-kind fields -> StructuredOutputsParams field.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def _response_format(value: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(param, StructuredOutputsParams kwargs) of OpenAI's ``response_format``; None for text.
    ``json_schema``'s ``name``, ``description`` and ``strict`` are hints (the output always
    follows the schema, as vLLM's), but of OpenAI's types (str, str, bool) or null."""
    kind = value.get("type")
    for key in value:
        if key not in ("type", "json_schema"):
            raise InvalidParamError(f"response_format.{key}", f"response_format.{key} is not supported")
    if "json_schema" in value and kind != "json_schema":  # it would constrain nothing
        raise InvalidParamError(
            "response_format.json_schema", f"response_format.json_schema needs type 'json_schema', got {kind!r:.80}"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidParamError(
                "response_format.json_schema.schema",
                "response_format json_schema needs json_schema.schema, a JSON schema object",
            )
        for key in spec:
            if key not in _JSON_SCHEMA_KEYS:
                raise InvalidParamError(f"response_format.json_schema.{key}", f"response_format.json_schema.{key} is not supported")
        for key, kind in (("name", str), ("description", str), ("strict", bool)):  # OpenAI's types, not coerced
            if spec.get(key) is not None and not isinstance(spec[key], kind):
                raise InvalidParamError(f"response_format.json_schema.{key}",
                                        f"response_format.json_schema.{key} must be a {kind.__name__} or null, "
                                        f"got {type(spec[key]).__name__}")
        return "response_format.json_schema.schema", {"json": spec["schema"]}
    raise InvalidParamError(
        "response_format", f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r:.80}"
    )


def structured_outputs_params(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, from ``response_format``, ``structured_outputs``
    or a ``guided_*`` field; None when it asks for none (or for ``{"type": "text"}``).

    Raises:
        InvalidParamError: an unknown ``response_format`` type or field, more than one
            constraint, or one that is malformed or does not compile (empty ``choice``,
            invalid schema, regex or grammar); ``param`` is the request field at fault.
    """
    found = _constraint(req)
    if found is None:
        return None
    param, kwargs = found
    try:
        params = StructuredOutputsParams(**kwargs)
        backend.check(params)
    except InvalidParamError as e:
        raise InvalidParamError(param, f"{param}: {e}") from None
    return params


def structured_outputs_field(req: SamplingRequest) -> str | None:
    """The request field the constraint of a checked request (``structured_outputs_params``)
    comes from: ``guided_regex``, ``structured_outputs.json``, ``response_format.json_schema.schema``,
    ...; None when it asks for none."""
    found = _constraint(req)
    return None if found is None else found[0]


def _constraint(req: SamplingRequest) -> tuple[str, dict[str, Any]] | None:
    """(request field, ``StructuredOutputsParams`` kwargs) of the one constraint a request asks
    for, unchecked (``structured_outputs`` that sets no field is one, which the check refuses);
    None when it asks for none.

    Raises:
        InvalidParamError: an unknown ``response_format`` type or field, or more than one constraint.
    """
    found: list[tuple[str, dict[str, Any]]] = []
    if req.response_format is not None and (rf := _response_format(req.response_format)) is not None:
        found.append(rf)
    for key, value in (req.structured_outputs or {}).items():
        if key not in KINDS:
            raise InvalidParamError(
                f"structured_outputs.{key}",
                f"structured_outputs.{key} is not supported; the fields are {', '.join(KINDS)}",
            )
        if value is not None:
            found.append((f"structured_outputs.{key}", {key: value}))
    if req.structured_outputs is not None and all(v is None for v in req.structured_outputs.values()):
        # {} or only nulls: as a whole, so that the check refuses it (exactly one field is needed)
        found.append(("structured_outputs", req.structured_outputs))
    for name, kind in GUIDED_FIELDS.items():
        if (value := getattr(req, name)) is not None:
            found.append((name, {kind: value}))
    if len(found) > 1:
        raise InvalidParamError(
            found[1][0], f"a request takes one structured output constraint; got {found[0][0]} and {found[1][0]}"
        )
    return found[0] if found else None
