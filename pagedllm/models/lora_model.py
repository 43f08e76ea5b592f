"""A loaded model with LoRA layers around its q/k/v/o and gate/up/down projections.

``LoRAModel(model)`` wraps each decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj``
and ``down_proj`` (whatever their base layers are, after quantization and packing) in a
``LoRALinear`` sharing one ``LoRABatch``; adapters are then installed and removed by id.
The step's adapter runs sit in ``model.lora_batch``, which the modules and the one-call
native decoder read.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.errors import LoRAError
from pagedllm.layers.lora import LoRABatch, LoRALinear
from pagedllm.models.lora_adapter import LoRAAdapter

_MODULES = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


class LoRAModel:
    """LoRA layers installed in ``model`` (a ``CausalLM`` of the Llama or Gemma 3 family),
    adapters kept in ``dtype`` (None: the model's).

    Attributes:
        batch: the step's adapter runs (set before each forward pass).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None) -> None:
        self.model = model
        shard, head_dim = model.shard, model.config.head_dim
        q, kv, inter = shard.num_heads * head_dim, shard.num_kv_heads * head_dim, shard.intermediate_size
        parts = {"qkv_proj": [q, kv, kv], "gate_up_proj": [inter, inter]}
        self.batch = LoRABatch(dtype=dtype or model.dtype)
        self.linears: dict[tuple[int, str], LoRALinear] = {}
        for i, layer in enumerate(model.layers):
            for parent_name, name in _MODULES:
                parent = getattr(layer, parent_name)
                base = getattr(parent, name, None)
                if base is None:  # a mixture of experts has no gate/up/down of its own
                    continue
                wrapped = LoRALinear(base, parts.get(name, [base.out_features]), self.batch)
                setattr(parent, name, wrapped)
                self.linears[(i, name)] = wrapped
        model.lora_batch = self.batch

    def add(self, adapter_id: int, adapter: LoRAAdapter) -> None:
        """Install ``adapter`` (whole-model sizes; cut to the model's shard) under ``adapter_id``."""
        grouped: dict[tuple[int, str], dict[int, tuple]] = {}
        for (layer, module, index), part in adapter.layer_parts(self.model.shard).items():
            grouped.setdefault((layer, module), {})[index] = (part.a, part.b)
        missing = sorted(key for key in grouped if key not in self.linears)
        if missing:
            raise LoRAError(f"the adapter updates layer {missing[0][0]}'s {missing[0][1]}, which this model does not have")
        for key, parts in grouped.items():
            self.linears[key].set_adapter(adapter_id, parts)
        self.batch.version += 1

    def remove(self, adapter_id: int) -> None:
        for linear in self.linears.values():
            linear.remove_adapter(adapter_id)
        self.batch.version += 1
