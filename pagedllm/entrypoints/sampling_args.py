"""The sampling flags of ``pagedllm generate`` and ``pagedllm chat`` and the SamplingParams
they make (``--json-schema``, where a command has it, as a structured output)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedllm.engine.arg_utils import finite_float, positive_int


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Sampling flags (SamplingParams' names); values are range-checked before any model loads."""
    parser.add_argument("--max-tokens", type=positive_int, default=128, help="most tokens to generate")
    parser.add_argument("--temperature", type=finite_float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 or -1: off")
    parser.add_argument("--min-p", type=finite_float, default=0.0, help="drop tokens below min_p x the top probability")
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--presence-penalty", type=finite_float, default=0.0, help="in [-2, 2]")
    parser.add_argument("--frequency-penalty", type=finite_float, default=0.0, help="in [-2, 2]")
    parser.add_argument("--repetition-penalty", type=finite_float, default=1.0, help="> 0: above 1 discourages repeating prompt and output tokens; 1 is off")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def json_schema_arg(value: str) -> dict[str, Any]:
    """A JSON schema given as a file path or as JSON text.

    Raises:
        ValueError: neither a file nor JSON text, a file that cannot be read as UTF-8 text, or
            not a JSON object.
    """
    from pathlib import Path

    path = Path(value)
    text = value
    if not value.lstrip().startswith("{") and path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--json-schema: cannot read {value}: {e}") from None
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--json-schema: {value!r:.80} is neither a file nor JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema: must be a JSON object, got {type(schema).__name__}")
    return schema


def sampling_params(args: argparse.Namespace):
    """The SamplingParams of the sampling flags.

    Raises:
        ValueError: a value out of its range, naming the setting as its flag's dest (the
            request's ``seed`` as ``sampling_seed``: ``--seed`` is the engine's).
    """
    from pagedllm.errors import InvalidParamError
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.structured_output import StructuredOutputsParams

    structured = None
    if getattr(args, "json_schema", None) is not None:
        from pagedllm.structured_output import backend  # loads transformers: only where a schema is given

        structured = StructuredOutputsParams(json=json_schema_arg(args.json_schema))
        try:  # a schema that cannot compile is a usage error, before loading
            backend.check(structured)
        except ValueError as e:
            raise ValueError(f"--json-schema: {e}") from None
    try:
        return SamplingParams(
            structured_outputs=structured,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.sampling_seed,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
    except InvalidParamError as e:
        if e.param == "seed":
            raise InvalidParamError("sampling_seed", f"sampling_{e}") from None
        raise
