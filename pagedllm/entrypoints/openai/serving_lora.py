"""The server's LoRA adapters by name: ``--lora-modules`` at start, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` at run time; the OpenAI ``model`` field selects one.

Each load gets a new id, so an adapter loaded again under the same name (other files) never
shares prefix-cache blocks or a worker's loaded weights with the one before. Unloading only
stops new requests from naming the adapter: requests already running keep theirs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.serving_engine import OpenAIError
from pagedllm.errors import LoRAError
from pagedllm.lora_request import LoRARequest


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


class ServingLoRA:
    """Args:
        engine: the engine (its front end checks adapters: ``processor.lora``).
        base_names: the served model's names (no adapter may take one).
    """

    def __init__(self, engine: AsyncLLM, base_names: tuple[str, ...]) -> None:
        self.engine = engine
        self.base_names = base_names
        self.adapters: dict[str, LoRARequest] = {}
        self._parents: dict[str, str] = {}  # adapter name -> its base_model_name, where one was given
        self._ids = itertools.count(1)

    def load(self, module: LoRAModule) -> LoRARequest:
        """Check ``module``'s adapter and serve it under its name (at start: ``--lora-modules``).

        Raises:
            OpenAIError: 400 where LoRA is off, the name is taken, or the adapter cannot run
                (unreadable, unsupported, rank above ``--max-lora-rank``, another base model).
        """
        lora = self._new(module.name, module.path)
        self._check(lora)
        self._add(lora)
        if module.base_model_name is not None:
            self._parents[lora.name] = module.base_model_name
        return lora

    async def load_async(self, name: str, path: str) -> LoRARequest:
        """``load`` with the adapter's files read and checked off the event loop (the other
        requests' streams go on meanwhile); the name is taken once the check has passed.

        Raises:
            OpenAIError: as ``load``.
        """
        lora = self._new(name, path)
        await asyncio.to_thread(self._check, lora)
        return self._add(lora)

    def _new(self, name: str, path: str) -> LoRARequest:
        if not self.engine.config.enable_lora:
            raise OpenAIError(400, "LoRA adapters are not enabled: start the server with --enable-lora", param="lora_name")
        self._check_name(name)
        return LoRARequest(name, next(self._ids), path)

    def _check_name(self, name: str) -> None:
        if not name or name in self.base_names or name in self.adapters:
            raise OpenAIError(400, f"the model name {name!r} is already in use or empty", param="lora_name")

    def _check(self, lora: LoRARequest) -> None:
        try:
            self.engine.processor.lora.check(lora)
        except (LoRAError, ValueError) as e:
            raise OpenAIError(400, f"cannot load LoRA adapter {lora.name!r}: {e}", param="lora_path") from None

    def _add(self, lora: LoRARequest) -> LoRARequest:
        self._check_name(lora.name)  # again: a concurrent load may have taken it during the check
        self.adapters[lora.name] = lora
        return lora

    def unload(self, name: str) -> None:
        """Stop serving ``name`` (404 if no such adapter is loaded)."""
        if self.adapters.pop(name, None) is None:
            raise OpenAIError(404, f"no LoRA adapter named {name!r} is loaded", "NotFoundError", "lora_name")
        self._parents.pop(name, None)

    def parent(self, name: str) -> str:
        """The model ``/v1/models`` names as adapter ``name``'s ``parent``: the
        ``base_model_name`` it was served with, else the first served name (vLLM's)."""
        return self._parents.get(name, self.base_names[0])

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model (or no model:
        absent, null or "", which vLLM also serves with the base model).

        Raises:
            OpenAIError: 404 for a name that is neither the base model nor a loaded adapter.
        """
        if not model or model in self.base_names:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            served = ", ".join(f"`{n}`" for n in [*self.base_names, *self.adapters])
            raise OpenAIError(404, f"the model `{model}` does not exist; this server serves {served}",
                              "NotFoundError", "model")
        return lora
