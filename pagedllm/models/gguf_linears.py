"""Which linear layers of a GGUF file keep their blocks as stored, unpacked for this rank.

Reads the file through ``gguf_loader`` (names and row order in HF's convention) and the model
class's fused projections; the block formats themselves are ``layers.quantization.gguf``'s.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import SINGLE, TPGroup
from pagedllm.distributed.sharding import ModelShard, shard_tensor
from pagedllm.quantization_config import QuantizationConfig
from pagedllm.layers.quantization.gguf import STORED_LAYOUT, GGUFLinears, kept_unpackers, stores
from pagedllm.models.gguf_loader import GGUFFile, hf_name, hf_rows
from pagedllm.models.registry import get_model_class
from pagedllm.models.weights import NUM_SHARDS


def _layer_of(gguf_name: str, config: ModelConfig) -> tuple[str, int] | None:
    """(our linear layer's name, shard index in it) for a GGUF weight; None if not a linear's."""
    if gguf_name == "token_embd.weight":
        return ("lm_head", 0) if config.tie_word_embeddings else None
    name = hf_name(gguf_name, config.architecture).removeprefix("model.")
    if not name.endswith(".weight") or "norm" in name or ".experts." in name or ".mlp.gate." in name:
        return None  # norms; a mixture of experts' router (float) and experts (requantized)
    parts = name.removesuffix(".weight").split(".")
    for fused, projections in get_model_class(config.architecture).packed_modules_mapping.items():
        if parts[-1] in projections:
            return ".".join([*parts[:-1], fused]), projections.index(parts[-1])
    return ".".join(parts), 0


def _rank_blocks(f: GGUFFile, name: str, config: ModelConfig, shard: ModelShard | None) -> torch.Tensor:
    """Tensor ``name``'s blocks [rows, K / 32, bytes], rows in HF order, cut to the rank's part:
    rows of a column-parallel layer, whole blocks along K of a row-parallel one."""
    blocks = hf_rows(f.blocks(name), name, config)
    split = None if shard is None else shard.split_of(hf_name(name, config.architecture))
    return blocks if split is None else shard_tensor(blocks, split, GGML_QUANT_SIZES[f.tensors[name].qtype][0])


def _storable(f: GGUFFile, name: str, config: ModelConfig, shard: ModelShard | None) -> bool:
    """Whether the rank's part of tensor ``name`` can run as stored: the K-quant GEMM takes its
    type at the rank's input size, and a row-parallel split falls on block boundaries."""
    info = f.tensors[name]
    k = info.shape[1]
    split = None if shard is None else shard.split_of(hf_name(name, config.architecture))
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
    shards: dict[str, dict[int, str]] = {}
    for gguf_name in f.tensors:
        where = _layer_of(gguf_name, config)
        if where is not None and (where[0] != "lm_head" or quant.lm_head):
            shards.setdefault(where[0], {})[where[1]] = gguf_name
    kept = kept_unpackers(quant)
    out = GGUFLinears()
    for layer, by_index in shards.items():
        names = [by_index[i] for i in sorted(by_index)]
        types = out.sources[layer] = [f.tensors[n].qtype for n in names]
        fused_in_file = any(hf_name(n, config.architecture).split(".")[-2] in NUM_SHARDS for n in names)
        if (shard is not None and fused_in_file) or not all(t in kept for t in types):
            continue
        layouts = {kept[t][0] for t in types}
        if len(layouts) != 1 or (STORED_LAYOUT in layouts and not all(_storable(f, n, config, shard) for n in names)):
            continue
        parts = [kept[f.tensors[n].qtype][1](_rank_blocks(f, n, config, shard)) for n in names]
        out.kept[layer] = type(parts[0]).cat(parts)
        out.layouts[layer] = layouts.pop()
        if out.layouts[layer] == STORED_LAYOUT:  # the embedding's lookup reads a tied lm_head's tensor
            out.stored_tensors.update(n for n in names if n != "token_embd.weight")
    return out
