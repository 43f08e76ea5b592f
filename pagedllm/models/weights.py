"""Loading HF-named checkpoint tensors into models whose q/k/v and gate/up are fused."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedllm.config import ModelConfig

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


def unfuse(weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with fused projections (Phi-3's) split into HF's separate ones.

    A ``*.qkv_proj.weight`` of rows [q (heads x head_dim); k; v (kv heads x head_dim each)]
    becomes ``q_proj`` / ``k_proj`` / ``v_proj``, a ``*.gate_up_proj.weight`` of rows [gate;
    up] (``intermediate_size`` each) ``gate_proj`` / ``up_proj``, as views; trailing dims ride
    along and other tensors pass through. The whole model's sizes: split before sharding.

    Raises:
        ValueError: a fused tensor whose rows do not add up to its parts'.
    """
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    splits = {
        "qkv_proj": (("q_proj", "k_proj", "v_proj"), (q, kv, kv)),
        "gate_up_proj": (("gate_proj", "up_proj"), (config.intermediate_size,) * 2),
    }
    for name, tensor in weights:
        module, _, param = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf not in splits:
            yield name, tensor
            continue
        names, sizes = splits[leaf]
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"{name} has {tensor.shape[0]} rows, expected {' + '.join(map(str, sizes))}")
        for part, piece in zip(names, tensor.split(sizes), strict=True):
            yield f"{parent}.{part}.{param}", piece


def load_fused(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """Cast each (our name, tensor) to ``dtype``, stack the fused projections, load strictly.

    Raises:
        ValueError: a fused projection misses some of its shards; the checkpoint lacks a
            parameter of the model or holds one the model has no place for (named).
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
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)

    def listed(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    if missing:
        raise ValueError(f"the checkpoint lacks {listed(missing)} (the parameters as this model names them)")
    if unexpected:
        raise ValueError(f"the checkpoint holds {listed(unexpected)}, which this model has no place for")
