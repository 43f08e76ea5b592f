"""Every layer of a decoder for a batch of decode tokens in one native call (csrc/decoder.cpp),
and the structs that describe the model to it (pagedllm_abi.h documents each field):
``LayerDesc`` one decoder layer, ``DecoderDesc`` the model (``models/native_decoder.py``
fills both); ``kernels.linear.LinearDesc`` each packed linear layer."""

from __future__ import annotations

import ctypes

import torch

from pagedllm.kernels import abi
from pagedllm.kernels.args import check_cpu, check_index, ptr, require

LayerDesc, DecoderDesc, _StepGroup = (abi.STRUCTS[name] for name in ("LayerDesc", "DecoderDesc", "StepGroup"))


def decode_layers(
    decoder: DecoderDesc,
    stream: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    slot_mappings: list[torch.Tensor],
    block_tables: list[torch.Tensor],
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """Every layer of a decoder and its final norm, for B decode tokens, in one native call.

    Args:
        decoder: the model's weights, sizes and K/V caches (``models/native_decoder.py``);
            heads as ``kernels.attention.decode_attention_supported`` accepts.
        stream: [B, hidden] float32, contiguous: the tokens' (scaled) embeddings; on return
            the residual stream (as the modules leave it).
        cos_sin: the global and the local RoPE table's rows, each [B, 2, 1, head_dim] float32,
            contiguous (``RotaryEmbedding.cos_sin[positions]``; the same tensor twice without
            sliding-window layers).
        slot_mappings, block_tables: per KV cache group (``decoder.num_groups``), [B] and
            [B, max_blocks] int64; seq_lens: [B] int64.

    Returns:
        [B, hidden] float32: the final norm's output.

    Raises:
        RuntimeError: no native library here.
        ValueError: tensors that do not fit the decoder, or a decoder the kernel refuses.
    """
    lib = require()
    check_cpu(stream, *cos_sin)
    b, h, d = stream.shape[0], decoder.hidden, decoder.head_dim
    if stream.shape != (b, h) or stream.dtype != torch.float32 or not stream.is_contiguous():
        raise ValueError(f"stream: need contiguous float32 [B, {h}], got {stream.dtype} {list(stream.shape)}")
    for table in cos_sin:
        if table.shape != (b, 2, 1, d) or table.dtype != torch.float32 or not table.is_contiguous():
            got = f"{table.dtype} {list(table.shape)}"
            raise ValueError(f"cos_sin: need contiguous float32 [{b}, 2, 1, {d}], got {got}")
    if len(slot_mappings) != decoder.num_groups or len(block_tables) != decoder.num_groups:
        raise ValueError(f"need {decoder.num_groups} KV cache groups, got {len(slot_mappings)}, {len(block_tables)}")
    groups = (_StepGroup * decoder.num_groups)()
    for group, slots, tables in zip(groups, slot_mappings, block_tables):
        check_index(slots, "slot_mapping", (b,))
        check_index(tables, "block_tables", (b, tables.shape[-1]))
        group.slots, group.block_tables, group.max_blocks = ptr(slots), ptr(tables), tables.shape[1]
    check_index(seq_lens, "seq_lens", (b,))
    out = torch.empty_like(stream)
    tables = (ctypes.c_void_p * 2)(ptr(cos_sin[0]), ptr(cos_sin[1]))
    if lib.decode_layers(ctypes.byref(decoder), ptr(stream), tables, groups, ptr(seq_lens), b, ptr(out)) != 0:
        raise ValueError("decode_layers refused the decoder (a linear kind, group or head shape it lacks)")
    return out
