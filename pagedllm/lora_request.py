"""``LoRARequest``: which LoRA adapter a request runs with (vLLM's shape)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """A LoRA adapter, named by the caller, applied on top of the base model for one request.

    Attributes:
        name: the adapter's name (what the OpenAI ``model`` field selects).
        id: a positive integer identifying this adapter while it is loaded; two requests with
            the same id must name the same adapter files. Together with ``name`` and ``path`` it
            keys the prefix cache, so blocks computed with one adapter never serve another, an
            id later reused for other files included (the worker then loads the new files).
        path: a PEFT adapter folder (``adapter_config.json`` and ``adapter_model.safetensors``) or
            a llama.cpp GGUF LoRA file.
    """

    name: str
    id: int
    path: str

    @property
    def cache_key(self) -> str:
        """What keeps prefix-cache blocks of this adapter apart from every other's."""
        return f"{self.id}:{self.name}:{self.path}"
