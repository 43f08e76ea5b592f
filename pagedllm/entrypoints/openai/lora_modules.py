"""``--lora-modules``' items: the adapters a server serves from its start (serving_lora.py
registers them). Its own module, importing nothing heavy, so that the command line refuses a
bad item before it loads torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAModule:
    """An adapter served from the start (vLLM's ``LoRAModulePath``).

    Attributes:
        name: what the ``model`` field selects it by.
        path: its PEFT folder or llama.cpp GGUF file.
        base_model_name: the model ``/v1/models`` names as its ``parent``; None: the first
            served name.
    """

    name: str
    path: str
    base_model_name: str | None = None


_MODULE_KEYS = ("name", "path", "base_model_name")


def parse_lora_module(text: str) -> LoRAModule:
    """A ``--lora-modules`` item, in either of vLLM's forms: ``name=path``, or a JSON object
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (the last key optional).

    Raises:
        ValueError: no ``=`` in the first form; in the second, JSON that does not parse, lacks
            ``name`` or ``path``, has a key of none of the three (named), or a value that is not
            a non-empty string (``base_model_name`` may be null); an empty name or path in either.
    """
    if not text.lstrip().startswith("{"):
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path or JSON object items, got {text!r}")
        return LoRAModule(name, path)
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--lora-modules: {text!r} is not valid JSON: {e}") from None
    unknown = [key for key in fields if key not in _MODULE_KEYS]
    if unknown:
        raise ValueError(f"--lora-modules: unknown key {unknown[0]!r} in {text!r}; the keys are "
                         f"{', '.join(_MODULE_KEYS)}")
    for key in ("name", "path"):
        if key not in fields:
            raise ValueError(f"--lora-modules: {text!r} lacks {key!r}")
    for key, value in fields.items():
        if key == "base_model_name" and value is None:  # vLLM's default, spelled out
            continue
        if not isinstance(value, str) or not value:
            raise ValueError(f"--lora-modules: {key!r} must be a non-empty string, got {json.dumps(value)}")
    return LoRAModule(**fields)
