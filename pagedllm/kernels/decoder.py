"""Every layer of a decoder for one step's tokens in one native call (csrc/decoder.cpp),
and the structs that describe the model to it (pagedllm_abi.h documents each field):
``LayerDesc`` one decoder layer, ``DecoderDesc`` the model (``models/native_decoder.py``
fills both); ``kernels.linear.LinearDesc`` each packed linear layer."""

from __future__ import annotations

import ctypes

import torch

from pagedllm.kernels import abi
from pagedllm.kernels.args import check_cpu, check_index, prompt_row, ptr, require

LayerDesc, DecoderDesc, LoRAStep, _StepGroup = (
    abi.STRUCTS[name] for name in ("LayerDesc", "DecoderDesc", "LoRAStep", "StepGroup")
)


def decode_layers(
    decoder: DecoderDesc,
    stream: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    slot_mappings: list[torch.Tensor],
    block_tables: list[torch.Tensor],
    seq_lens: torch.Tensor | None,
    prefill_block_tables: list[torch.Tensor] | None = None,
    spans: torch.Tensor | None = None,
    prompt_from: int | None = None,
) -> torch.Tensor:
    """Every layer of a decoder and its final norm, for one step's T tokens, in one native call:
    B decode queries first (each row past its request's prompt: a decode's token, a speculative
    verification's rows, each over the keys up to its position), then P prompt chunks (causal
    from their offsets).

    Args:
        decoder: the model's weights, sizes and K/V caches (``models/native_decoder.py``);
            heads as ``kernels.attention.decode_attention_supported`` accepts; its ``lora``,
            where set, the step's LoRA updates (runs within the T tokens).
        stream: [T, hidden] float32, contiguous: the tokens' (scaled) embeddings; on return
            the residual stream (as the modules leave it).
        cos_sin: the global and the local RoPE table's rows, each [T, 2, 1, rotary_dim] float32,
            contiguous (``RotaryEmbedding.cos_sin[positions]``; the same tensor twice without
            sliding-window layers).
        slot_mappings: per KV cache group (``decoder.num_groups``), [T] int64.
        block_tables, seq_lens: the decode queries': per group [B, max_blocks] int64, and [B]
            int64 (keys each attends); None when B is 0.
        prefill_block_tables, spans: the prompt chunks': per group [P, max_blocks]
            int64, and [3, P] int64 rows (first row, row count, keys after the step), as
            ``layers.attention_metadata.AttentionMetadata`` holds them; None when P is 0.
        prompt_from: the first row of the prompt chunks, which the int8 layers compute on
            their prompt kernel (``kernels.linear.linear_w8a8``); None: none.

    Returns:
        [T, hidden] float32: the final norm's output.

    Raises:
        RuntimeError: no native library here.
        ValueError: tensors that do not fit the decoder, or a decoder the kernel refuses.
    """
    lib = require()
    check_cpu(stream, *cos_sin)
    t, h, r = stream.shape[0], decoder.hidden, decoder.rotary_dim
    if stream.shape != (t, h) or stream.dtype != torch.float32 or not stream.is_contiguous():
        raise ValueError(f"stream: need contiguous float32 [T, {h}], got {stream.dtype} {list(stream.shape)}")
    for table in cos_sin:
        if table.shape != (t, 2, 1, r) or table.dtype != torch.float32 or not table.is_contiguous():
            got = f"{table.dtype} {list(table.shape)}"
            raise ValueError(f"cos_sin: need contiguous float32 [{t}, 2, 1, {r}], got {got}")
    b = 0 if seq_lens is None else seq_lens.shape[0]
    p = 0 if spans is None else spans.shape[-1]
    if b:
        check_index(seq_lens, "seq_lens", (b,))
    if p:
        check_index(spans, "spans", (3, p))
        if int(spans[0, 0]) != b or int(spans[0, -1] + spans[1, -1]) != t or bool((spans[1] < 1).any()):
            raise ValueError(f"spans: the multi-token requests' rows must follow the {b} decodes and end at row {t}")
    elif b != t:
        raise ValueError(f"{t} tokens, but {b} decodes and no multi-token requests")
    if prompt_from is not None and not b <= prompt_from <= t:
        raise ValueError(f"prompt_from {prompt_from}: the prompt rows follow the {b} decodes, within {t} rows")
    n = decoder.num_groups
    if len(slot_mappings) != n or (b and len(block_tables) != n) or (p and len(prefill_block_tables) != n):
        raise ValueError(f"need {n} KV cache groups of slots and block tables")
    groups = (_StepGroup * n)()
    for g, group in enumerate(groups):
        check_index(slot_mappings[g], "slot_mapping", (t,))
        group.slots = ptr(slot_mappings[g])
        if b:
            tables = block_tables[g]
            check_index(tables, "block_tables", (b, tables.shape[-1]))
            group.block_tables, group.max_blocks = ptr(tables), tables.shape[1]
        if p:
            tables = prefill_block_tables[g]
            check_index(tables, "prefill_block_tables", (p, tables.shape[-1]))
            group.prefill_block_tables, group.prefill_max_blocks = ptr(tables), tables.shape[1]
    out = torch.empty_like(stream)
    rope = (ctypes.c_void_p * 2)(ptr(cos_sin[0]), ptr(cos_sin[1]))
    status = lib.decode_layers(
        ctypes.byref(decoder), ptr(stream), rope, groups, ptr(seq_lens) if b else None, ptr(spans) if p else None,
        t, b, p, prompt_row(t, prompt_from), ptr(out),
    )
    if status != 0:
        raise ValueError(
            "decode_layers refused the decoder (a linear kind, group, head shape, rotary_dim or block size it lacks)"
        )
    return out
