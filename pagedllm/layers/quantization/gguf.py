"""GGUF blocks kept as they are, and the one place their bytes are unpacked in torch.

Two ways to keep them:
- unpacked to codes and scales for the packed kernels: Q8_0 -> int8 in groups of 32, Q4_0 /
  Q4_1 -> int4 group 32. A mode keeps the block formats no more precise than itself: int8
  keeps Q8_0 and Q4_0 / Q4_1, int4 and w4a8 keep Q4_0 / Q4_1, in their own groups of 32
  whatever ``group_size`` says (that applies to what is quantized here). Requantizing them
  could only add error: 4-bit blocks through int8 come out about 1% off, through int4 at
  group 64, off enough to cost SmolLM2 26% perplexity.
- as stored, byte for byte (``--dtype auto``: ``requantize_4bit`` off): Q8_0, Q5_0,
  Q4_K, Q5_K, Q6_K go to the K-quant GEMM (``kernels.kquant.StoredWeight``), so a layer
  reads no more bytes than the file holds; Q4_0 / Q4_1 still run as w4a8 (the same bytes).

Block layouts (llama.cpp ggml-common.h), 32 weights per block, an fp16 scale ``d`` first:
Q8_0 ``d, 32 x int8`` (w = d * q); Q4_0 ``d, 16 bytes`` (w = d * (q - 8)); Q4_1
``d, m, 16 bytes`` (w = d * q + m); Q5_0 ``d, 32 fifth bits, 16 bytes`` (w = d * (q - 16));
weight j in the low nibble of byte j and weight j + 16 in its high nibble. Unpacking copies
codes and scales bit for bit: the dequantized values equal ``gguf.quants.dequantize``'s
exactly. The K-quants' 256-weight super-blocks are read by ``csrc/kquant.cpp`` alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedllm.kernels import kquant
from pagedllm.layers.quantization.weights import Int4Weight, Int8Weight, QuantizedWeight
from pagedllm.quantization_config import QuantizationConfig

Q = GGMLQuantizationType


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """[N, B, bytes] blocks -> the fp16 at byte ``start`` of each, as [N, B] float32 (exact)."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, B, 16] bytes -> [N, B * 32] uint8 codes: per block the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).flatten(1)


_BITS = torch.arange(8, dtype=torch.uint8)


def _q5_codes(blocks: torch.Tensor) -> torch.Tensor:
    """[N, B, 22] Q5_0 blocks -> [N, B * 32] uint8 codes in [0, 31] (bit j of qh is weight j's fifth)."""
    fifth = ((blocks[..., 2:6].unsqueeze(-1) >> _BITS) & 1).flatten(-2) << 4  # [N, B, 32]
    return _nibbles(blocks[..., 6:]) | fifth.flatten(1)


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


def dequantize_blocks(qtype: GGMLQuantizationType, blocks: torch.Tensor, out: torch.Tensor) -> bool:
    """Write the [n, 32] float32 weights of [n, bytes] Q8_0 / Q4_0 / Q4_1 / Q5_0 blocks into
    ``out``, bit-identical to ``gguf.quants.dequantize``; False (nothing written) for any
    other type."""
    b = blocks.unsqueeze(1)
    if qtype == Q.Q8_0:
        torch.mul(b[..., 2:].view(torch.int8).flatten(1), _fp16(b, 0), out=out)
    elif qtype == Q.Q4_0:  # d * q - 8 * d: exact in float32
        d = _fp16(b, 0)
        torch.addcmul(d * -8, _nibbles(b[..., 2:]), d, out=out)
    elif qtype == Q.Q4_1:
        torch.addcmul(_fp16(b, 2), _nibbles(b[..., 4:]), _fp16(b, 0), out=out)
    elif qtype == Q.Q5_0:  # d * q - 16 * d: exact in float32
        d = _fp16(b, 0)
        torch.addcmul(d * -16, _q5_codes(b), d, out=out)
    else:
        return False
    return True


def unpack_stored(qtype: GGMLQuantizationType, blocks: torch.Tensor) -> kquant.StoredWeight:
    """[N, K / block, bytes] blocks -> the weight as stored, for the K-quant GEMM.

    Raises:
        ValueError: a type or K the K-quant GEMM does not take (``kquant.row_bytes``).
    """
    return kquant.StoredWeight([(int(qtype), blocks.reshape(blocks.shape[0], -1))], _in_features(qtype, blocks))


def _in_features(qtype: GGMLQuantizationType, blocks: torch.Tensor) -> int:
    return blocks.shape[1] * GGML_QUANT_SIZES[qtype][0]


def stores(qtype: GGMLQuantizationType, in_features: int) -> bool:
    """Whether a tensor of this type and input size can be kept as stored here."""
    return kquant.row_bytes(int(qtype), in_features) > 0


# GGUF types each mode keeps, and their unpacker.
KEPT: dict[str, dict[GGMLQuantizationType, Callable[[torch.Tensor], QuantizedWeight]]] = {
    "int8": {Q.Q8_0: unpack_q8_0, Q.Q4_0: unpack_q4_0, Q.Q4_1: unpack_q4_1},
    "int4": {Q.Q4_0: unpack_q4_0, Q.Q4_1: unpack_q4_1},
    "w8a8": {},  # its own packed layout: requantized from float
    "w4a8": {Q.Q4_0: unpack_q4_0, Q.Q4_1: unpack_q4_1},  # d, m float16 as the kernel takes them
}
# The layout a kept type unpacks to (for the load log, and to keep a fused layer's rows alike).
KEPT_LAYOUT = {Q.Q8_0: "int8 g32", Q.Q4_0: "int4 g32", Q.Q4_1: "int4 g32"}
# The types kept as stored (``unpack_stored``); their layout in the load log.
STORED = (Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
STORED_LAYOUT = "stored"


def keeps_stored(quant: QuantizationConfig) -> bool:
    """Whether ``quant`` keeps the ``STORED`` types as stored: ``--dtype auto``'s integer
    modes (w4a8, or w8a8 on ARM), which lower no weight's precision (``requantize_4bit`` off)."""
    return quant.mode in ("w4a8", "w8a8") and not quant.requantize_4bit


def kept_unpackers(quant: QuantizationConfig) -> dict[GGMLQuantizationType, tuple[str, Callable]]:
    """Per GGUF type ``quant`` keeps: (its layout, its unpacker of [N, K / block, bytes] blocks)."""
    kept = {t: (KEPT_LAYOUT[t], unpack) for t, unpack in KEPT[quant.mode].items()}
    if keeps_stored(quant):
        kept |= {t: (STORED_LAYOUT, lambda blocks, t=t: unpack_stored(t, blocks)) for t in STORED}
    return kept


@dataclass
class GGUFLinears:
    """What a GGUF file holds for each linear layer of the model (``layers.3.mlp.gate_up_proj``,
    ``lm_head``; a tied lm_head's source is ``token_embd``).

    Attributes:
        sources: per layer, the GGUF types of its tensors, in fused order.
        kept: the layers whose tensors are all of kept types of one layout, unpacked (rows in
            HF order, fused projections stacked); the rest are quantized from float.
        layouts: per kept layer, its layout (``KEPT_LAYOUT``'s, or ``STORED_LAYOUT``).
        stored_tensors: the GGUF tensors only kept-as-stored layers use: the loader need not
            dequantize them (a tied embedding, which the lookup reads, is never among them).
    """

    sources: dict[str, list[GGMLQuantizationType]] = field(default_factory=dict)
    kept: dict[str, QuantizedWeight | kquant.StoredWeight] = field(default_factory=dict)
    layouts: dict[str, str] = field(default_factory=dict)
    stored_tensors: set[str] = field(default_factory=set)
