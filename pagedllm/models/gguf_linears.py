"""Which linear layers of a GGUF file keep their blocks as stored, unpacked for this rank.

Reads the file through ``gguf_loader`` (names and row order in HF's convention) and the model
class's fused projections; the block formats themselves are ``layers.quantization.gguf``'s.
A mixture of experts' 3-D stacks (``ffn_{gate,up,down}_exps``, [experts, rows, columns]) are
one weight matrix per expert here, each expert's layers (``mlp.experts.{e}.gate_up_proj``,
``down_proj``) kept or requantized as a dense layer's would be.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import NamedTuple

import torch
from gguf import GGML_QUANT_SIZES

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import SINGLE, TPGroup
from pagedllm.distributed.sharding import ModelShard, shard_tensor
from pagedllm.quantization_config import QuantizationConfig
from pagedllm.layers.quantization.gguf import STORED_LAYOUT, GGUFLinears, kept_unpackers, stores
from pagedllm.models.gguf_file import GGUFFile
from pagedllm.models.gguf_loader import hf_name, hf_rows
from pagedllm.models.registry import get_model_class
from pagedllm.models.weights import NUM_SHARDS


_EXPERT_STACK = re.compile(r"\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.weight$")


class _Matrix(NamedTuple):
    """One weight matrix of the file: its GGUF tensor, the expert it is of a 3-D stack (None:
    the whole tensor) and its HF name (``model.layers.3.mlp.experts.5.up_proj.weight``)."""

    tensor: str
    expert: int | None
    name: str


def _matrices(f: GGUFFile, config: ModelConfig) -> Iterator[_Matrix]:
    for tensor, info in f.tensors.items():
        name = hf_name(tensor, config.architecture)
        stack = _EXPERT_STACK.search(name)
        if stack is None or len(info.shape) != 3:
            yield _Matrix(tensor, None, name)
            continue
        for e in range(info.shape[0]):
            yield _Matrix(tensor, e, f"{name[: stack.start()]}.mlp.experts.{e}.{stack.group(1)}.weight")


def _layer_of(m: _Matrix, config: ModelConfig) -> tuple[str, int] | None:
    """(our linear layer's name, shard index in it) for a weight matrix; None if not a linear's."""
    if m.tensor == "token_embd.weight":
        return ("lm_head", 0) if config.tie_word_embeddings else None
    name = m.name.removeprefix("model.")
    if not name.endswith(".weight") or "norm" in name or ".mlp.gate." in name:
        return None  # norms; a mixture of experts' router (kept float)
    parts = name.removesuffix(".weight").split(".")
    for fused, projections in get_model_class(config.architecture).packed_modules_mapping.items():
        if parts[-1] in projections:
            return ".".join([*parts[:-1], fused]), projections.index(parts[-1])
    return ".".join(parts), 0


def _rank_blocks(f: GGUFFile, m: _Matrix, config: ModelConfig, shard: ModelShard | None) -> torch.Tensor:
    """Matrix ``m``'s blocks [rows, K / 32, bytes], rows in HF order, cut to the rank's part:
    rows of a column-parallel layer, whole blocks along K of a row-parallel one."""
    blocks = f.blocks(m.tensor)
    blocks = hf_rows(blocks if m.expert is None else blocks[m.expert], m.tensor, config)
    split = None if shard is None else shard.split_of(m.name)
    return blocks if split is None else shard_tensor(blocks, split, GGML_QUANT_SIZES[f.tensors[m.tensor].qtype][0])


def _storable(f: GGUFFile, m: _Matrix, shard: ModelShard | None) -> bool:
    """Whether the rank's part of matrix ``m`` can run as stored: the K-quant GEMM takes its
    type at the rank's input size, and a row-parallel split falls on block boundaries."""
    info = f.tensors[m.tensor]
    k = info.shape[-1]
    split = None if shard is None else shard.split_of(m.name)
    if split is not None and split[0] == 1:
        block = GGML_QUANT_SIZES[info.qtype][0]
        if split[1] % block or split[2] % block:
            return False
        k = split[2] - split[1]
    return stores(info.qtype, k)


def gguf_linears(f: GGUFFile, config: ModelConfig, quant: QuantizationConfig, tp: TPGroup = SINGLE) -> GGUFLinears:
    """Sort the file's linear weights into kept (unpacked from their blocks, or as stored) and
    to requantize.

    A fused layer is kept only when all its tensors unpack to one layout (int8, int4, or as
    stored), as its rows share one kernel. With ``tp``, kept layers hold rank ``tp.rank``'s
    shard; a tensor the file stores fused (Phi-3's ``attn_qkv``, ``ffn_up``), whose rank rows
    are not one span, is then requantized from the float weights the model's loader split and
    cut. A layer to keep as stored whose rank's input the K-quant GEMM does not take (a
    row-parallel split inside a 256-weight super-block, say) is requantized from float too.

    Raises:
        ValueError: a row-parallel layer's rank columns that cut through blocks of 32 (a size
            ``sharding.check_tensor_parallel_size`` rejects for quantized models).
    """
    shard = None if tp.size == 1 else ModelShard.of(config, tp)
    shards: dict[str, dict[int, _Matrix]] = {}
    for m in _matrices(f, config):
        where = _layer_of(m, config)
        if where is not None and (where[0] != "lm_head" or quant.lm_head):
            shards.setdefault(where[0], {})[where[1]] = m
    kept = kept_unpackers(quant)
    out = GGUFLinears()
    # A tensor only kept-as-stored layers use is never dequantized: every expert of a stack counts.
    uses: dict[str, set[bool]] = {}
    for layer, by_index in shards.items():
        matrices = [by_index[i] for i in sorted(by_index)]
        types = out.sources[layer] = [f.tensors[m.tensor].qtype for m in matrices]
        fused_in_file = any(m.name.split(".")[-2] in NUM_SHARDS for m in matrices)
        layout = None
        if (shard is None or not fused_in_file) and all(t in kept for t in types):
            layouts = {kept[t][0] for t in types}
            if len(layouts) == 1 and (STORED_LAYOUT not in layouts or all(_storable(f, m, shard) for m in matrices)):
                layout = layouts.pop()
                parts = [kept[f.tensors[m.tensor].qtype][1](_rank_blocks(f, m, config, shard)) for m in matrices]
                out.kept[layer] = type(parts[0]).cat(parts)
                out.layouts[layer] = layout
        for m in matrices:
            uses.setdefault(m.tensor, set()).add(layout == STORED_LAYOUT)
    # The embedding's lookup reads a tied lm_head's tensor: never among them.
    out.stored_tensors.update(t for t, stored in uses.items() if stored == {True} and t != "token_embd.weight")
    return out
