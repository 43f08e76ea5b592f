"""A rank's LoRA adapters: read on first use, kept for later steps (least recently used out).

Before each forward pass, :meth:`LoRAManager.begin_step` installs the step's adapters that
are not loaded yet (each rank reads the folder and keeps its shard), sets the model's
``LoRABatch`` to the step's runs of tokens per adapter, and drops the least recently used
adapters beyond ``max_cpu_loras`` (never one the step uses).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from pagedllm.config import ModelConfig
from pagedllm.lora_request import LoRARequest
from pagedllm.models.lora_adapter import read_adapter
from pagedllm.models.lora_model import LoRAModel
from pagedllm.worker.step_input import RequestTokens


class LoRAManager:
    """Args:
        model: the loaded model (its LoRA layers are installed here).
        config: the base model's hyper-parameters (adapters are checked against them).
        max_lora_rank: the largest rank an adapter may have.
        max_cpu_loras: adapters kept loaded at most (at least the adapters of one step).
        dtype: the adapters' A and B in memory (None: the model's dtype).
    """

    def __init__(
        self, model, config: ModelConfig, max_lora_rank: int, max_cpu_loras: int, dtype: torch.dtype | None = None
    ) -> None:
        self.lora_model = LoRAModel(model, dtype)
        self.config = config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()  # least recently used first

    def begin_step(self, requests: list[RequestTokens]) -> None:
        """Load the step's adapters and set its runs (``requests`` in forward order).

        Raises:
            LoRAError: an adapter's folder cannot be read or does not fit the model (the
                front end checked it when the request came in; the files changed since).
        """
        segments: list[tuple[int, int, int]] = []
        used: set[int] = set()
        start = 0
        for r in requests:
            end = start + len(r.token_ids)
            if r.lora is not None:
                lid = r.lora.id
                if lid not in used:
                    used.add(lid)
                    self._ensure(r.lora)
                if segments and segments[-1][1] == start and segments[-1][2] == lid:
                    segments[-1] = (segments[-1][0], end, lid)
                else:
                    segments.append((start, end, lid))
            start = end
        self.lora_model.batch.set(segments)
        for lid in [lid for lid in self.loaded if lid not in used][: max(0, len(self.loaded) - self.max_cpu_loras)]:
            del self.loaded[lid]
            self.lora_model.remove(lid)

    def _ensure(self, lora: LoRARequest) -> None:
        known = self.loaded.get(lora.id)
        if known is not None and known == lora:
            self.loaded.move_to_end(lora.id)
            return
        if known is not None:  # the id now names other files: replace them
            self.lora_model.remove(lora.id)
        self.lora_model.add(lora.id, read_adapter(lora.path, self.config, self.max_lora_rank))
        self.loaded[lora.id] = lora
