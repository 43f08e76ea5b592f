"""LoRA on any linear layer, many adapters in one batch (Punica's SGMV idea).

A step's tokens are ordered so that each adapter's tokens form runs (``LoRABatch.segments``);
per run, a projection adds ``(x @ A.T) @ B.T`` (B pre-scaled): one shrink into the summed
rank of the layer's parts (a fused q/k/v or gate/up layer has one part per projection, each
with its own A), then per part the expand of its rank columns into its slice of the output.
A and B are kept in the engine's ``lora_dtype`` (float32 or bfloat16). Where the native
kernels run and activations are float32, all runs of a projection go through one call
(``kernels.lora.lora_sgmv``, each token's update from its own row alone); elsewhere PyTorch
matmuls per run and part, in the activations' dtype. Tokens of the base model, and layers an adapter does not target,
get nothing added; a step without adapters runs the base layer alone. The base may be any linear layer (float32, int8/int4, w8a8, w4a8, GGUF blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.kernels import library
from pagedllm.kernels.lora import MAX_PARTS, MAX_RANK, from_panels, lora_sgmv, to_panels


@dataclass
class LoRABatch:
    """The current step's adapter runs, shared by every ``LoRALinear`` of a model.

    Attributes:
        segments: (first token, end token, adapter id) per run of tokens of one adapter, in
            the step's flattened token order; tokens in no run use the base model. Empty: no
            adapter in the step.
        dtype: the element type adapters are installed in, for every LoRA layer.
    """

    segments: list[tuple[int, int, int]] = field(default_factory=list)
    dtype: torch.dtype = torch.float32  # the adapters' A and B: float32 or bfloat16 (native), else the activations'

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
    a_t: torch.Tensor  # the parts' A stacked, transposed ([in_features, R], R their summed rank), in panels
    b_t: torch.Tensor  # each part's B.T [r, its out_features] in panels, one after another (kernels.lora.to_panels)
    ranks: tuple[int, ...]  # each part's rank (0: the part is not updated), MAX_PARTS entries


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


class LoRALinear(nn.Module):
    """``base(x)`` plus the update of each token's adapter.

    Args:
        base: the linear layer, [T, in_features] -> [T, out_features] in x's dtype.
        part_sizes: the output features of each part, in order (summing to out_features),
            at most ``MAX_PARTS``.
        batch: the model's step state.
    """

    def __init__(self, base: nn.Module, part_sizes: list[int], batch: LoRABatch) -> None:
        super().__init__()
        if not 1 <= len(part_sizes) <= MAX_PARTS:
            raise ValueError(f"a LoRA layer has 1 to {MAX_PARTS} parts, got {len(part_sizes)}")
        self.base = base
        self.batch = batch
        starts = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        self.part_slices = [(s, s + n) for s, n in zip(starts, part_sizes, strict=True)]
        self.part_widths = torch.tensor(part_sizes, dtype=torch.int64)
        self.adapters: dict[int, _LayerAdapter] = {}
        # The kernel's per-run arguments (A.T and B.T addresses, ranks) for the runs' adapters.
        self._native_args: tuple[tuple[int, ...], tuple[torch.Tensor, ...]] | None = None

    def set_adapter(self, adapter_id: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Install adapter ``adapter_id``'s update: part index -> (A [r, in_features], B
        [part's out_features, r], scaled), kept in the batch's ``dtype``.

        Raises:
            ValueError: a B that does not fit its part, or a summed rank above ``MAX_RANK``.
        """
        dtype = self.batch.dtype
        ranks = [0] * MAX_PARTS
        blocks = []
        for index in sorted(parts):
            a, b = parts[index]
            start, stop = self.part_slices[index]
            if b.shape != (stop - start, a.shape[0]):
                raise ValueError(f"part {index}: B is {list(b.shape)}, expected {[stop - start, a.shape[0]]}")
            ranks[index] = a.shape[0]
            blocks.append(to_panels(b.t().to(dtype)))
        rank = sum(ranks)
        if rank > MAX_RANK:
            raise ValueError(f"the summed rank {rank} of this layer's parts exceeds {MAX_RANK}")
        a_t = to_panels(torch.cat([parts[i][0] for i in sorted(parts)]).t().to(dtype))
        self.adapters[adapter_id] = _LayerAdapter(a_t, torch.cat(blocks), tuple(ranks))
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
            lora_sgmv(x, y, self.part_widths, batch.runs, *self.native_args(batch.key), dtype=batch.dtype)
            return y
        for start, stop, adapter_id in batch.segments:
            layer = self.adapters.get(adapter_id)
            if layer is None:  # the adapter leaves this layer alone
                continue
            h = x[start:stop] @ from_panels(layer.a_t, x.shape[-1]).to(x.dtype)
            r0 = b0 = 0
            for (p0, p1), r in zip(self.part_slices, layer.ranks, strict=False):
                if r:
                    width = _round16(p1 - p0)
                    b = from_panels(layer.b_t[b0 : b0 + r * width], r)[:, : p1 - p0]
                    y[start:stop, p0:p1].addmm_(h[:, r0 : r0 + r], b.to(x.dtype))
                    b0 += r * width
                r0 += r
        return y

    def native_args(self, key: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """(A.T addresses [S], B.T addresses [S], ranks [S, MAX_PARTS]) of the runs' adapters
        (``key``: their ids), kept while the adapters and the runs' order stay the same
        (decode steps in a row)."""
        if self._native_args is None or self._native_args[0] != key:
            layers = [self.adapters.get(lid) for lid in key]
            a = [0 if la is None else la.a_t.data_ptr() for la in layers]
            b = [0 if la is None else la.b_t.data_ptr() for la in layers]
            ranks = [(0,) * MAX_PARTS if la is None else la.ranks for la in layers]
            arrays = (torch.tensor(a, dtype=torch.int64), torch.tensor(b, dtype=torch.int64),
                      torch.tensor(ranks, dtype=torch.int64).reshape(len(key), MAX_PARTS))
            self._native_args = (key, arrays)
        return self._native_args[1]

    def extra_repr(self) -> str:
        return f"parts={[stop - start for start, stop in self.part_slices]}, adapters={sorted(self.adapters)}"
