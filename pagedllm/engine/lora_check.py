"""The front end's check of a request's LoRA adapter, before anything is queued.

Every adapter a request names is read once here (the whole folder, checked against the base
model: ``models.lora_adapter.read_adapter``), so a bad adapter fails its request with a
clear error and never reaches the engine core; later requests naming the same adapter
(``LoRARequest`` equal) skip the read.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.errors import InvalidParamError
from pagedllm.lora_request import LoRARequest
from pagedllm.models.lora_adapter import read_adapter

_REMEMBERED = 256  # adapters known good, least recently used forgotten first


class LoRAChecker:
    """Args:
        config: engine settings (``enable_lora``, ``max_lora_rank``).
        model_config: the base model adapters must fit.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.enabled = config.enable_lora
        self.max_rank = config.max_lora_rank
        self.model_config = model_config
        self._good: OrderedDict[LoRARequest, None] = OrderedDict()

    def check(self, lora: LoRARequest) -> None:
        """Raise unless ``lora`` can run.

        Raises:
            InvalidParamError (param "lora_request"): LoRA not enabled, or not a LoRARequest
                with a positive id.
            LoRAError: the adapter cannot be read or does not fit the base model (the message
                names the problem: rank, shapes, file).
        """
        if not self.enabled:
            raise InvalidParamError(
                "lora_request", "LoRA adapters are not enabled: start the engine with enable_lora=True (--enable-lora)"
            )
        if not isinstance(lora, LoRARequest) or isinstance(lora.id, bool) or not isinstance(lora.id, int) or lora.id < 1:
            raise InvalidParamError("lora_request", f"expected a LoRARequest(name, id, path) with id >= 1, got {lora!r:.120}")
        if lora in self._good:
            self._good.move_to_end(lora)
            return
        read_adapter(lora.path, self.model_config, self.max_rank)
        self._good[lora] = None
        if len(self._good) > _REMEMBERED:
            self._good.popitem(last=False)
