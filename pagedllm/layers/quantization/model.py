"""Quantize a loaded model in place: its linear layers become packed int8 / int4 layers."""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from pagedllm.distributed.parallel_state import SINGLE, TPGroup
from pagedllm.distributed.sharding import is_row_parallel
from pagedllm.quantization_config import GROUP_SIZES, QuantizationConfig
from pagedllm.kernels.kquant import StoredWeight
from pagedllm.layers.quantization.gguf import GGUFLinears
from pagedllm.layers.quantization.linear import QuantizedLinear, W4A8Linear, W8A8Linear, make_linear, stored_linear
from pagedllm.layers.quantization.weights import Int4Weight, QuantizedWeight, quantize_int4, quantize_int8, quantize_q4a8

logger = logging.getLogger("pagedllm")


def _targets(model: nn.Module, quant: QuantizationConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Layer name -> (float weight [N, K], bias or None) of every linear layer to quantize."""
    targets = {
        name: (m.weight, m.bias)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and (name != "lm_head" or quant.lm_head)
    }
    if quant.lm_head and getattr(model, "lm_head", None) is None:  # tied: logits use the embedding
        targets["lm_head"] = (model.embed_tokens.weight, None)
    return targets


def _check_group_size(targets: dict[str, tuple[torch.Tensor, torch.Tensor | None]], quant: QuantizationConfig) -> None:
    if quant.mode != "int4":
        return
    dims = {weight.shape[1] for weight, _ in targets.values()}
    for name, (weight, _) in targets.items():
        if weight.shape[1] % quant.group_size:
            fitting = [g for g in GROUP_SIZES if all(d % g == 0 for d in dims)]
            raise ValueError(
                f"quantization_group_size {quant.group_size} does not divide the input dimension "
                f"{weight.shape[1]} of {name}; group sizes that fit this model: {', '.join(map(str, fitting)) or 'none'}"
            )


def _cast_floats(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast float parameters and buffers to ``dtype``, but not the quantized layers' kernel buffers."""
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.is_floating_point():
                setattr(module, name, nn.Parameter(p.to(dtype), requires_grad=False))
        if isinstance(module, QuantizedLinear):
            continue
        for name, b in module.named_buffers(recurse=False):
            if b.is_floating_point():
                setattr(module, name, b.to(dtype))


def _summary(quant: QuantizationConfig, sources: dict[str, list[str]], layouts: dict[str, str]) -> str:
    """``int8: kept from GGUF 4 Q4_1 as int4 g32; requantized 96 Q5_0`` (counts of tensors)."""
    counts: dict[str, Counter[str]] = {"kept from GGUF": Counter(), "requantized": Counter()}
    for layer, types in sources.items():
        if layer in layouts:
            counts["kept from GGUF"].update(f"{t} as {layouts[layer]}" for t in types)
        else:
            counts["requantized"].update(types)
    paths = [f"{path} " + ", ".join(f"{n} {t}" for t, n in sorted(c.items())) for path, c in counts.items() if c]
    return f"{quant.describe()}: " + "; ".join(paths) + ("" if quant.lm_head else "; lm_head float")


def _whole_row_maxima(weights: dict[str, torch.Tensor], tp: TPGroup) -> dict[str, torch.Tensor]:
    """Per layer, the max|w| of each whole row of which ``weights[name]`` is this rank's slice
    (row-parallel layers): one max all-reduce over the group for all of them, in the same
    order on every rank; nothing at size 1 (each row is whole)."""
    if tp.size == 1 or not weights:
        return {}
    # NaN as inf: the maximum keeps it, so a row with a NaN is non-finite on every rank.
    local = torch.cat([w.detach().float().abs().amax(dim=1) for w in weights.values()])
    maxima = tp.all_reduce_max(torch.nan_to_num(local, nan=float("inf")))
    return dict(zip(weights, maxima.split([w.shape[0] for w in weights.values()])))


def quantize_model(
    model: nn.Module,
    quant: QuantizationConfig,
    dtype: torch.dtype,
    gguf: GGUFLinears | None = None,
    num_workers: int = 1,
    tp: TPGroup = SINGLE,
) -> str:
    """Replace the model's linear layers by quantized ones, then cast its other floats to ``dtype``.

    Args:
        model: a loaded model with ``nn.Linear`` layers, in float32 so that weights are
            quantized from exact values.
        quant: the mode, group size and whether the lm_head too.
        dtype: the model's compute dtype (norms, embedding, attention, KV cache).
        gguf: what the GGUF file holds per layer; its ``kept`` layers take their unpacked
            blocks instead of being quantized from float.
        num_workers: threads quantizing different layers at once (torch ops release the GIL).
        tp: the tensor-parallel group the model is a shard of: the row-parallel layers of the
            per-row schemes (w8a8, int8) take their whole rows' scales (one collective), so
            each rank's codes are the unsharded model's.

    Returns:
        The load log's summary: which path how many tensors took, by source type.

    Raises:
        ValueError: if the int4 group size does not divide some layer's input dimension, or a
            w8a8 layer's weight holds NaN or inf (naming the layer).
    """
    targets = _targets(model, quant)
    _check_group_size(targets, quant)
    kept = {} if gguf is None else gguf.kept

    def is_w8a8(name: str) -> bool:
        if isinstance(kept.get(name), StoredWeight):
            return False
        kept_q4 = isinstance(kept.get(name), Int4Weight)
        # w4a8 keeps the lm_head at 8 bits, as llama.cpp's 4-bit files keep their output matrix.
        return quant.mode == "w8a8" or (
            quant.mode == "w4a8" and (name == "lm_head" or (not kept_q4 and not quant.requantize_4bit))
        )

    # The per-row schemes (w8a8, int8) scale a row-parallel slice by its whole row's maximum.
    per_row = [n for n in targets if is_w8a8(n) or (quant.mode == "int8" and n not in kept)]
    row_max = _whole_row_maxima({n: targets[n][0] for n in per_row if is_row_parallel(n)}, tp)

    def build(name: str) -> tuple[str, QuantizedLinear]:
        weight, bias = targets[name]
        qweight: QuantizedWeight
        if isinstance(kept.get(name), StoredWeight):
            return name, stored_linear(kept[name], bias)
        if is_w8a8(name):
            try:
                return name, W8A8Linear(weight, bias, row_max.get(name))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from e
        kept_q4 = kept.get(name) if isinstance(kept.get(name), Int4Weight) else None
        if quant.mode == "w4a8":
            return name, W4A8Linear(kept_q4 if kept_q4 is not None else quantize_q4a8(weight), bias)
        if name in kept:
            qweight = kept[name]
        elif quant.mode == "int8":
            qweight = quantize_int8(weight, row_max.get(name))
        else:
            qweight = quantize_int4(weight, quant.group_size)
        return name, make_linear(qweight, bias)

    with ThreadPoolExecutor(num_workers) as pool:
        for name, layer in pool.map(build, list(targets)):
            parent, _, attr = name.rpartition(".")
            # A tied lm_head (None before) becomes a quantized copy used for the logits only.
            setattr(model.get_submodule(parent), attr, layer)
    _cast_floats(model, dtype)
    model.dtype = dtype

    if gguf is not None:
        sources = {layer: [t.name for t in types] for layer, types in gguf.sources.items()}
    else:  # an HF checkpoint: one count per checkpoint tensor, several in a fused layer
        packed = model.packed_modules_mapping
        sources = {name: ["float"] * len(packed.get(name.rpartition(".")[2], [name])) for name in targets}
    summary = _summary(quant, sources, {} if gguf is None else gguf.layouts)
    logger.info("quantized %s", summary)
    return summary
