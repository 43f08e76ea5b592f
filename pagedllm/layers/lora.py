"""LoRA on any linear layer, many adapters in one batch (Punica's SGMV idea).

A step's tokens are ordered so that each adapter's tokens form runs (``LoRABatch.segments``);
per run, a projection adds ``(x @ A.T) @ B.T`` (B pre-scaled): one shrink into the summed
rank of the layer's parts (a fused q/k/v or gate/up layer has one part per projection, each
with its own A), then one expand through the parts' B laid block-diagonally (each part's
rank columns feed only its slice of the output; zeros elsewhere). Where the native kernels
run and activations are float32, all runs of a projection go through one call
(``kernels.lora.lora_sgmv``, each token's update from its own row alone); elsewhere two
PyTorch matmuls per run. Tokens of the base model, and layers an adapter does not target,
get nothing added; a step without adapters runs the base layer alone. The base may be any linear layer (float32, int8/int4, w8a8, w4a8, GGUF blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.kernels import library
from pagedllm.kernels.lora import MAX_RANK, lora_sgmv


@dataclass
class LoRABatch:
    """The current step's adapter runs, shared by every ``LoRALinear`` of a model.

    Attributes:
        segments: (first token, end token, adapter id) per run of tokens of one adapter, in
            the step's flattened token order; tokens in no run use the base model. Empty: no
            adapter in the step.
    """

    segments: list[tuple[int, int, int]] = field(default_factory=list)
    key: tuple[int, ...] = ()  # the runs' adapter ids
    version: int = 0  # counts changes to the installed adapters
    runs: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.int64))  # [S, 2] (first, end)
    native: bool = field(default_factory=library.available)  # the native kernel runs here

    def set(self, segments: list[tuple[int, int, int]]) -> None:
        """The next step's runs."""
        self.segments = segments
        self.key = tuple(lid for _, _, lid in segments)
        self.runs = torch.tensor([[a, b] for a, b, _ in segments], dtype=torch.int64).reshape(-1, 2)


@dataclass
class _LayerAdapter:
    a_t: torch.Tensor  # [in_features, R]: the parts' A stacked, R the sum of their ranks
    b_t: torch.Tensor  # [R, out_features]: each part's B.T in its rank rows and output columns


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
        # The kernel's per-run arguments (A.T and B.T addresses, ranks) for the runs' adapters.
        self._native_args: tuple[tuple[int, ...], tuple[torch.Tensor, ...]] | None = None

    def set_adapter(self, adapter_id: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> None:
        """Install adapter ``adapter_id``'s update: part index -> (A [r, in_features], B
        [part's out_features, r], scaled), cast to ``dtype`` (the activations')."""
        order = sorted(parts)
        rank = sum(parts[i][0].shape[0] for i in order)
        b_t = torch.zeros(rank, self.part_slices[-1][1], dtype=dtype)
        r0 = 0
        for index in order:
            a, b = parts[index]
            start, stop = self.part_slices[index]
            if b.shape != (stop - start, a.shape[0]):
                raise ValueError(f"part {index}: B is {list(b.shape)}, expected {[stop - start, a.shape[0]]}")
            b_t[r0 : r0 + a.shape[0], start:stop] = b.t()
            r0 += a.shape[0]
        if rank > MAX_RANK:
            raise ValueError(f"the summed rank {rank} of this layer's parts exceeds {MAX_RANK}")
        a_t = torch.cat([parts[i][0] for i in order]).t().to(dtype).contiguous()
        self.adapters[adapter_id] = _LayerAdapter(a_t, b_t)
        self._native_args = None

    def remove_adapter(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)
        self._native_args = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] (rows may be strided) -> [T, out_features] in x's dtype."""
        y = self.base(x)
        batch = self.batch
        if not batch.segments:
            return y
        if batch.native and x.dtype == torch.float32:
            lora_sgmv(x, y, batch.runs, *self.native_args(batch.key))
            return y
        for start, stop, adapter_id in batch.segments:
            layer = self.adapters.get(adapter_id)
            if layer is None:  # the adapter leaves this layer alone
                continue
            y[start:stop].addmm_(x[start:stop] @ layer.a_t, layer.b_t)
        return y

    def native_args(self, key: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """(A.T addresses, B.T addresses, ranks) of the runs' adapters (``key``: their ids),
        kept while the adapters and the runs' order stay the same (decode steps in a row)."""
        if self._native_args is None or self._native_args[0] != key:
            layers = [self.adapters.get(lid) for lid in key]
            a = [0 if la is None else la.a_t.data_ptr() for la in layers]
            b = [0 if la is None else la.b_t.data_ptr() for la in layers]
            ranks = [0 if la is None else la.a_t.shape[1] for la in layers]
            self._native_args = (key, tuple(torch.tensor(v, dtype=torch.int64) for v in (a, b, ranks)))
        return self._native_args[1]

    def extra_repr(self) -> str:
        return f"parts={[stop - start for start, stop in self.part_slices]}, adapters={sorted(self.adapters)}"
