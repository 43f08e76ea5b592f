"""GGUF weights multiplied as the file stores them (``csrc/kquant.cpp``): Q4_K, Q5_K, Q6_K,
Q8_0 and Q5_0 blocks against float32 activations quantized to int8 on the fly.

A ``StoredWeight`` is a weight [N, K] as one or more parts, each the file's blocks for some
rows ([rows, row_bytes(qtype, K)] uint8), stacked along N: a fused q/k/v whose tensors the
file stores in different formats stays one weight; ``panels`` repacks it into the GEMM's
32-row panels (a ``PanelWeight``: the same bytes, rows batch-invariant). ``linear`` is the
GEMM of either (any M: a decode step reads each weight byte once), ``linear_desc`` the same
layer for the one-call decoder, ``dequantize`` rows of one part's blocks as float32 (an
embedding's lookup). Types are ggml's ids (``gguf.GGMLQuantizationType`` values).
"""

from __future__ import annotations

import ctypes

import torch

from pagedllm.kernels import abi, huge_pages
from pagedllm.kernels.args import prompt_row, ptr_or_none, require
from pagedllm.kernels.library import native_library

# The block formats the GEMM reads as stored, by ggml type id.
TYPES = frozenset(abi.CONSTANTS[f"PAGEDLLM_GGML_{name}"] for name in ("Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))
MAX_PARTS = abi.CONSTANTS["PAGEDLLM_KQUANT_MAX_PARTS"]
PANELS = abi.CONSTANTS["PAGEDLLM_KQUANT_PANELS"]  # a part's type flag: its blocks repacked by ``panels``
LINEAR_KQUANT = abi.CONSTANTS["PAGEDLLM_LINEAR_KQUANT"]
_KQuantWeight, _LinearDesc = abi.STRUCTS["KQuantWeight"], abi.STRUCTS["LinearDesc"]


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one row of ``in_features`` weights of ggml type ``qtype`` as the GEMM reads
    it; 0 where it does not take that type or size (K-quants: K a multiple of 256; Q8_0,
    Q5_0: of 64), or no native library runs here."""
    lib = native_library()
    return 0 if lib is None or qtype not in TYPES else int(lib.kquant_row_bytes(qtype, in_features))


class StoredWeight:
    """A weight [out_features, in_features] as GGUF blocks, for ``linear``.

    Args:
        parts: (ggml type id, blocks) pairs, rows stacked in order; blocks [rows,
            row_bytes(type, in_features)] uint8 on the CPU (copied where not contiguous).
            Adjacent parts of one type are merged.
        in_features: K.

    Attributes:
        parts, in_features, out_features (the parts' rows added up); ``desc`` the
        ``KQuantWeight`` the kernels read, pointing into ``parts`` (kept alive here).

    Raises:
        ValueError: no parts, more formats in a row than ``MAX_PARTS``, or blocks that are not
            of their type's row size for ``in_features`` (or no native library here).
    """

    def __init__(self, parts: list[tuple[int, torch.Tensor]], in_features: int) -> None:
        merged: list[tuple[int, torch.Tensor]] = []
        for qtype, blocks in parts:
            size = row_bytes(qtype, in_features)
            if size == 0 or blocks.dim() != 2 or blocks.shape[1] != size or blocks.dtype != torch.uint8:
                raise ValueError(
                    f"GGUF type {qtype} blocks of {in_features} weights per row: need uint8 [rows, {size}] "
                    f"(0: not taken here), got {blocks.dtype} {list(blocks.shape)}"
                )
            if merged and merged[-1][0] == qtype:
                merged[-1] = (qtype, torch.cat([merged[-1][1], blocks]))
            else:
                merged.append((qtype, blocks.contiguous()))
        if not 1 <= len(merged) <= MAX_PARTS:
            raise ValueError(f"a stored weight has 1 to {MAX_PARTS} parts of different formats, got {len(merged)}")
        self.parts = merged
        self.in_features = in_features
        self.out_features = sum(blocks.shape[0] for _, blocks in merged)
        self.desc = _KQuantWeight(num_parts=len(merged))
        for slot, (qtype, blocks) in zip(self.desc.parts, merged):
            slot.type, slot.rows, slot.blocks = qtype, blocks.shape[0], blocks.data_ptr()

    @staticmethod
    def cat(weights: list[StoredWeight]) -> StoredWeight:
        """Stack along the output dimension (fused projections); in_features must agree."""
        return StoredWeight([part for w in weights for part in w.parts], weights[0].in_features)

    def nbytes(self) -> int:
        """Bytes of blocks: what one pass over the weight reads."""
        return sum(blocks.nbytes for _, blocks in self.parts)

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the weight as float32 [stop - start, in_features] (``dequantize``'s values)."""
        out, first = [], 0
        for qtype, blocks in self.parts:
            lo, hi = max(start, first), min(stop, first + len(blocks))
            if lo < hi:
                out.append(dequantize(qtype, blocks, self.in_features, torch.arange(lo - first, hi - first)))
            first += len(blocks)
        return torch.cat(out) if out else torch.empty(0, self.in_features)


class PanelWeight:
    """A ``StoredWeight`` repacked into the GEMM's 32-row panels (``csrc/kquant_panels.h``):
    the same bytes per weight, a row's result the same bits whatever the batch (every M runs
    one tile), a decode step's few rows sharing each group's scaling. Build it with ``panels``.

    Attributes:
        parts: (ggml type id, packed uint8 [panel bytes], rows) triples; in_features,
            out_features; ``desc`` the ``KQuantWeight`` the kernels read (types carrying
            ``PANELS``), pointing into ``parts`` (kept alive here).
    """

    def __init__(self, parts: list[tuple[int, torch.Tensor, int]], in_features: int) -> None:
        self.parts = parts
        self.in_features = in_features
        self.out_features = sum(rows for _, _, rows in parts)
        self.desc = _KQuantWeight(num_parts=len(parts))
        for slot, (qtype, packed, rows) in zip(self.desc.parts, parts):
            slot.type, slot.rows, slot.blocks = qtype | PANELS, rows, packed.data_ptr()

    def nbytes(self) -> int:
        """Bytes of panels: what one pass over the weight reads."""
        return sum(packed.nbytes for _, packed, _ in self.parts)


def panels(weight: StoredWeight) -> PanelWeight | None:
    """``weight`` repacked into panels, or None where this library's GEMM cannot take one of
    its parts so (Q8_0 codes of -128 where its int8 dot product cannot negate them: kept as
    stored). The blocks are copied; ``weight`` is unchanged.

    Raises:
        RuntimeError: no native library here.
    """
    lib = require()
    parts = []
    for qtype, blocks in weight.parts:
        rows, k = blocks.shape[0], weight.in_features
        packed = huge_pages.empty(int(lib.kquant_panel_bytes(qtype, rows, k)), torch.uint8)
        if lib.kquant_pack_panels(qtype, blocks.data_ptr(), rows, k, packed.data_ptr()) != 0:
            return None
        parts.append((qtype, packed, rows))
    return PanelWeight(parts, weight.in_features)


def linear(
    x: torch.Tensor,
    weight: StoredWeight | PanelWeight,
    bias: torch.Tensor | None = None,
    prompt_from: int | None = None,
) -> torch.Tensor:
    """``x @ w.T + bias``: x [M, in_features] float32 (rows at any stride) -> [M, out_features]
    float32, x quantized to int8 per row and group of 32 once per call. A weight in panels takes
    rows from ``prompt_from`` on (None: none) as prompt tokens, as ``linear.linear_q4a8`` does
    (AMX's bfloat16 tiles where ``linear.amx_tiles()``).

    Args:
        bias: float32 [>= out_features] (a panel-padded bias too), or None.

    Raises:
        RuntimeError: no native library here.
        ValueError: x or bias do not fit the weight.
    """
    lib = require()
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != weight.in_features or x.device.type != "cpu":
        raise ValueError(f"x: need float32 [M, {weight.in_features}] on the CPU, got {x.dtype} {list(x.shape)}")
    _check_bias(bias, weight.out_features)
    x = x if x.stride(1) == 1 else x.contiguous()
    m, n = x.shape[0], weight.out_features
    y = x.new_empty(m, n)
    status = lib.linear_kquant(
        x.data_ptr(), x.stride(0), ctypes.byref(weight.desc), ptr_or_none(bias), y.data_ptr(),
        m, n, weight.in_features, prompt_row(m, prompt_from),
    )
    if status != 0:
        raise ValueError(f"the K-quant GEMM refused a weight of parts {[part[0] for part in weight.parts]}")
    return y


def linear_desc(weight: StoredWeight | PanelWeight, bias: torch.Tensor | None) -> ctypes.Structure:
    """The ``LinearDesc`` of a stored or panel weight for the one-call decoder (``kernels.decoder.decode_layers``);
    the caller keeps ``weight`` and ``bias`` alive as long as it is used.

    Raises:
        ValueError: bias does not fit the weight.
    """
    _check_bias(bias, weight.out_features)
    return _LinearDesc(
        LINEAR_KQUANT, weight.out_features, weight.in_features, ctypes.addressof(weight.desc), None, ptr_or_none(bias)
    )


def dequantize(qtype: int, blocks: torch.Tensor, in_features: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weights [len(rows), in_features] of ``rows`` (int64; None: every row) of
    blocks [R, row_bytes(qtype, in_features)] uint8, as ``gguf.quants.dequantize`` gives
    them (to float32 rounding: each weight is one fused multiply-add of its code).

    Raises:
        RuntimeError: no native library here.
        ValueError: blocks not of the type's row size, or rows not int64 within [0, R).
    """
    lib = require()
    size = row_bytes(qtype, in_features)
    if size == 0 or blocks.dim() != 2 or blocks.shape[1] != size or blocks.dtype != torch.uint8:
        raise ValueError(f"blocks: need uint8 [R, {size}] for type {qtype}, got {blocks.dtype} {list(blocks.shape)}")
    blocks = blocks.contiguous()
    if rows is not None:
        if rows.dtype != torch.int64 or rows.dim() != 1 or (rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < len(blocks)):
            raise ValueError(f"rows: need int64 [R'] within [0, {len(blocks)}), got {rows.dtype} {list(rows.shape)}")
        rows = rows.contiguous()
    count = len(blocks) if rows is None else rows.numel()
    out = torch.empty(count, in_features)
    lib.kquant_dequantize(qtype, blocks.data_ptr(), ptr_or_none(rows), count, in_features, out.data_ptr())
    return out


def _check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and (bias.dtype != torch.float32 or bias.dim() != 1 or bias.numel() < n or not bias.is_contiguous()):
        raise ValueError(f"bias: need contiguous float32 [>= {n}], got {bias.dtype} {list(bias.shape)}")
