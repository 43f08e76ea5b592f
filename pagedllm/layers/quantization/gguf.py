"""GGUF blocks kept as they are: Q8_0 -> int8 in groups of 32, Q4_0 / Q4_1 -> int4 group 32.

A mode keeps the block formats no more precise than itself: int8 keeps Q8_0 and Q4_0 / Q4_1,
int4 keeps Q4_0 / Q4_1, in their own groups of 32 whatever ``group_size`` says (that applies
to what is quantized here). Requantizing them could only add error: 4-bit blocks through int8
come out about 1% off, through int4 at group 64, off enough to cost SmolLM2 26% perplexity.

Block layouts (llama.cpp ggml-common.h), 32 weights per block, an fp16 scale ``d`` first:
Q8_0 ``d, 32 x int8`` (w = d * q); Q4_0 ``d, 16 bytes`` (w = d * (q - 8)); Q4_1
``d, m, 16 bytes`` (w = d * q + m), weight j in the low nibble of byte j and weight j + 16
in its high nibble. Unpacking copies codes and scales bit for bit: the dequantized values
equal ``gguf.quants.dequantize``'s exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType

from pagedllm.layers.quantization.weights import Int4Weight, Int8Weight, QuantizedWeight

Q = GGMLQuantizationType


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """[N, B, bytes] blocks -> the fp16 at byte ``start`` of each, as [N, B] float32 (exact)."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, B, 16] bytes -> [N, B * 32] uint8 codes: per block the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).flatten(1)


def unpack_q8_0(blocks: torch.Tensor) -> Int8Weight:
    """[N, K / 32, 34] Q8_0 blocks -> int8 with group size 32."""
    return Int8Weight(blocks[..., 2:].contiguous().view(torch.int8).flatten(1), _fp16(blocks, 0))


def unpack_q4_0(blocks: torch.Tensor) -> Int4Weight:
    """[N, K / 32, 18] Q4_0 blocks -> int4 group 32 with ``mins = -8 d``."""
    d = _fp16(blocks, 0)
    return Int4Weight(_nibbles(blocks[..., 2:]), d, -8 * d)


def unpack_q4_1(blocks: torch.Tensor) -> Int4Weight:
    """[N, K / 32, 20] Q4_1 blocks -> int4 group 32 with ``mins = m``."""
    return Int4Weight(_nibbles(blocks[..., 4:]), _fp16(blocks, 0), _fp16(blocks, 2))


# GGUF types each mode keeps, and their unpacker.
KEPT: dict[str, dict[GGMLQuantizationType, Callable[[torch.Tensor], QuantizedWeight]]] = {
    "int8": {Q.Q8_0: unpack_q8_0, Q.Q4_0: unpack_q4_0, Q.Q4_1: unpack_q4_1},
    "int4": {Q.Q4_0: unpack_q4_0, Q.Q4_1: unpack_q4_1},
    "w8a8": {},  # its own packed layout: requantized from float
    "w4a8": {Q.Q4_0: unpack_q4_0, Q.Q4_1: unpack_q4_1},  # d, m float16 as the kernel takes them
}
# The layout a kept type unpacks to (for the load log, and to keep a fused layer's rows alike).
KEPT_LAYOUT = {Q.Q8_0: "int8 g32", Q.Q4_0: "int4 g32", Q.Q4_1: "int4 g32"}


@dataclass
class GGUFLinears:
    """What a GGUF file holds for each linear layer of the model (``layers.3.mlp.gate_up_proj``,
    ``lm_head``; a tied lm_head's source is ``token_embd``).

    Attributes:
        sources: per layer, the GGUF types of its tensors, in fused order.
        kept: the layers whose tensors are all of kept types of one layout, unpacked (rows in
            HF order, fused projections stacked); the rest are quantized from float.
    """

    sources: dict[str, list[GGMLQuantizationType]] = field(default_factory=dict)
    kept: dict[str, QuantizedWeight] = field(default_factory=dict)
