"""Loading HF-named checkpoint tensors into models whose q/k/v and gate/up are fused."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# HF projection name -> (our fused projection, index of its rows in it)
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
NUM_SHARDS = {"qkv_proj": 3, "gate_up_proj": 2}

# Fused module -> the checkpoint projections stacked in it, in order (vLLM's name).
PACKED_MODULES_MAPPING: dict[str, list[str]] = {
    fused: [proj for proj, (target, _) in sorted(STACKED.items(), key=lambda kv: kv[1]) if target == fused]
    for fused in NUM_SHARDS
}


def load_fused(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """Cast each (our name, tensor) to ``dtype``, stack the fused projections, load strictly.

    Raises:
        ValueError: a fused projection misses some of its shards.
        RuntimeError: a parameter is missing or unexpected (``load_state_dict(strict=True)``).
    """
    state: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights:
        tensor = tensor.to(dtype)
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in STACKED:
            fused, index = STACKED[parts[-2]]
            parts[-2] = fused
            shards.setdefault(".".join(parts), {})[index] = tensor
        else:
            state[name] = tensor
    for name, pieces in shards.items():
        num = NUM_SHARDS[name.split(".")[-2]]
        if len(pieces) != num:
            raise ValueError(f"checkpoint has {len(pieces)} of the {num} projections fused into {name}")
        state[name] = torch.cat([pieces[i] for i in range(num)])
    module.load_state_dict(state, strict=True, assign=True)
