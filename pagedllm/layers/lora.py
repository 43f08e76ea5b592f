"""LoRA on any linear layer, many adapters in one batch (Punica's SGMV idea, in PyTorch).

A step's tokens are ordered so that each adapter's tokens form runs (``LoRABatch.segments``);
per run, a projection adds ``(x @ A.T) @ B.T`` (B pre-scaled): one shrink into the summed
rank of the layer's parts, then one expand per part into its slice of the output (a fused
q/k/v or gate/up layer has one part per projection). Tokens of the base model, and layers
an adapter does not target, get nothing added; a step without adapters runs the base layer
alone. The base may be any linear layer (float32, int8/int4, w8a8, w4a8, GGUF blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LoRABatch:
    """The current step's adapter runs, shared by every ``LoRALinear`` of a model.

    Attributes:
        segments: (first token, end token, adapter id) per run of tokens of one adapter, in
            the step's flattened token order; tokens in no run use the base model. Empty: no
            adapter in the step.
    """

    segments: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class _LayerAdapter:
    a: torch.Tensor  # [sum of the parts' ranks, in_features]
    expand: list[tuple[int, int, int, int, torch.Tensor]]  # (out start, out stop, rank start, rank stop, B.T)


class LoRALinear(nn.Module):
    """``base(x)`` plus the update of each token's adapter.

    Args:
        base: the linear layer, [T, in_features] -> [T, out_features] in x's dtype.
        part_sizes: the output features of each part, in order (summing to out_features).
        batch: the model's step state.
    """

    def __init__(self, base: nn.Module, part_sizes: list[int], batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        starts = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        self.part_slices = [(s, s + n) for s, n in zip(starts, part_sizes, strict=True)]
        self.adapters: dict[int, _LayerAdapter] = {}

    def set_adapter(self, adapter_id: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> None:
        """Install adapter ``adapter_id``'s update: part index -> (A [r, in_features], B
        [part's out_features, r], scaled), cast to ``dtype`` (the activations')."""
        a_rows, expand, r0 = [], [], 0
        for index in sorted(parts):
            a, b = parts[index]
            start, stop = self.part_slices[index]
            if b.shape[0] != stop - start:
                raise ValueError(f"part {index} has {b.shape[0]} outputs, expected {stop - start}")
            a_rows.append(a)
            expand.append((start, stop, r0, r0 + a.shape[0], b.to(dtype).t().contiguous()))
            r0 += a.shape[0]
        self.adapters[adapter_id] = _LayerAdapter(torch.cat(a_rows).to(dtype).contiguous(), expand)

    def remove_adapter(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] (rows may be strided) -> [T, out_features] in x's dtype."""
        y = self.base(x)
        for start, stop, adapter_id in self.batch.segments:
            layer = self.adapters.get(adapter_id)
            if layer is None:  # the adapter leaves this layer alone
                continue
            h = x[start:stop] @ layer.a.t()
            rows = y[start:stop]
            for o0, o1, r0, r1, bt in layer.expand:
                rows[:, o0:o1].addmm_(h[:, r0:r1], bt)
        return y

    def extra_repr(self) -> str:
        return f"parts={[stop - start for start, stop in self.part_slices]}, adapters={sorted(self.adapters)}"
