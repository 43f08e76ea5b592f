"""The server's LoRA adapters by name: ``--lora-modules`` at start, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` at run time; the OpenAI ``model`` field selects one.

Each load gets a new id, so an adapter loaded again under the same name (other files) never
shares prefix-cache blocks or a worker's loaded weights with the one before. Unloading only
stops new requests from naming the adapter: requests already running keep theirs.
"""

from __future__ import annotations

import asyncio
import itertools

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.lora_modules import LoRAModule
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.errors import LoRAError
from pagedllm.lora_request import LoRARequest


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
