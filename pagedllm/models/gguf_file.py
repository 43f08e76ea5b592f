"""GGUF files (llama.cpp's format): the header, metadata and tensors of one file, read in place.

A small header parser of our own instead of ``gguf.GGUFReader``: the reader builds numpy
views for every string of the vocabulary and merges; here string arrays are skipped and
walked only when a token is looked up (times: docs/benchmarks.md, session 26). The blocks
of 32 (Q8_0, Q4_0, Q4_1, Q5_0) are dequantized in torch
(``layers.quantization.gguf.dequantize_blocks``), bit-identical to ``gguf.quants`` and
faster; Q4_K, Q5_K, Q6_K by the native kernels (``kernels.kquant``);
other formats, or K-quants without a native library, by ``gguf.quants``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize as gguf_dequantize

from pagedllm.kernels import kquant
from pagedllm.layers.quantization.gguf import dequantize_blocks


_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings, left in the file: ``count`` strings starting at ``offset``."""

    offset: int
    count: int


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in the file. ``shape`` is in torch order ([out, in] for weights)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute, in bytes
    nbytes: int


class GGUFFile:
    """A memory-mapped GGUF (v2/v3) file: ``metadata`` and ``tensors`` by name.

    Metadata values are Python scalars/str, numpy arrays for numeric arrays, and
    :class:`StringArray` for string arrays (read with :meth:`find_strings`).

    Raises:
        ValueError: not a GGUF file (magic bytes), an unsupported version, a header that
            cannot be read (cut short, unknown type codes), or a file that ends before the
            last byte of a tensor (an interrupted download); the message names the file.
    """

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            if not f.read(4):  # mmap refuses an empty file
                raise ValueError(f"{path} is empty, not a GGUF file")
            # Copy-on-write mapping: writable, so torch views of it need no copy and warn not.
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if len(self._buf) < 24 or self._buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", self._buf, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        infos = []
        try:
            for _ in range(num_kv):
                key = self._read_str()
                self.metadata[key] = self._read_value(GGUFValueType(self._unpack("<I")))
            for _ in range(num_tensors):
                name = self._read_str()
                dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
                qtype = GGMLQuantizationType(self._unpack("<I"))
                infos.append((name, qtype, tuple(reversed(dims)), self._unpack("<Q")))
        except (struct.error, ValueError) as e:  # struct.error: the header runs past the end
            raise ValueError(f"{path}: cannot read its GGUF header (truncated or corrupt file?): {e}") from None
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, qtype, shape, offset in infos:
            block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape)) // block_elems * block_bytes
            info = self.tensors[name] = TensorInfo(name, qtype, shape, data_start + offset, nbytes)
            if info.offset + nbytes > len(self._buf):
                raise ValueError(
                    f"{path} is truncated: tensor {name} ends at byte {info.offset + nbytes}, the file has "
                    f"{len(self._buf)} (an interrupted download or copy?)"
                )
        self._data = torch.frombuffer(self._buf, dtype=torch.uint8)

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _read_str(self) -> str:
        n = self._unpack("<Q")
        self._pos += n
        return self._buf[self._pos - n : self._pos].decode("utf-8", errors="replace")

    def _read_value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._read_str()
        if vtype != GGUFValueType.ARRAY:
            return self._unpack(_SCALAR_FORMATS[vtype])
        etype, count = GGUFValueType(self._unpack("<I")), self._unpack("<Q")
        if etype == GGUFValueType.STRING:
            array = StringArray(self._pos, count)
            for _ in range(count):
                self._pos += 8 + struct.unpack_from("<Q", self._buf, self._pos)[0]
            return array
        if etype == GGUFValueType.ARRAY:
            raise ValueError("nested GGUF metadata arrays are not supported")
        dtype = np.dtype(_SCALAR_FORMATS[etype])
        values = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos).copy()
        self._pos += count * dtype.itemsize
        return values

    def find_strings(self, array: StringArray, wanted: set[str]) -> dict[str, int]:
        """Index of each string of ``wanted`` found in ``array`` (e.g. token ids by text)."""
        found: dict[str, int] = {}
        targets = {s.encode(): s for s in wanted}
        pos = array.offset
        for i in range(array.count):
            (n,) = struct.unpack_from("<Q", self._buf, pos)
            text = targets.get(self._buf[pos + 8 : pos + 8 + n])
            if text is not None:
                found[text] = i
                if len(found) == len(targets):
                    break
            pos += 8 + n
        return found

    def blocks(self, name: str) -> torch.Tensor:
        """A tensor's stored bytes, a view of the file: [*leading dims, rows, blocks per row,
        bytes per block] uint8 (a 3-D expert stack: [experts, rows, blocks per row, bytes])."""
        info = self.tensors[name]
        raw = self._data[info.offset : info.offset + info.nbytes]
        return raw.view(*info.shape[:-1], -1, GGML_QUANT_SIZES[info.qtype][1])

    def dequantize(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor as a new torch tensor of its (torch-order) shape, in ``dtype``."""
        info = self.tensors[name]
        raw = self._data[info.offset : info.offset + info.nbytes]
        if info.qtype in _PLAIN:
            return raw.view(_PLAIN[info.qtype]).view(info.shape).to(dtype, copy=True)
        if info.qtype not in _BLOCKS_OF_32:
            k = info.shape[-1]
            if kquant.row_bytes(int(info.qtype), k):  # K-quants: natively, rows of blocks as stored
                rows = raw.view(-1, kquant.row_bytes(int(info.qtype), k))
                return kquant.dequantize(int(info.qtype), rows, k).view(info.shape).to(dtype)
            return torch.from_numpy(gguf_dequantize(raw.numpy(), info.qtype)).view(info.shape).to(dtype)
        blocks = raw.view(-1, GGML_QUANT_SIZES[info.qtype][1])
        out = torch.empty(blocks.shape[0], 32, dtype=dtype)
        # In chunks: the temporaries stay in cache, and a low-precision ``out`` is filled
        # from a float32 buffer (exact weights, rounded once).
        buf = None if dtype == torch.float32 else torch.empty(min(_CHUNK, blocks.shape[0]), 32)
        for start in range(0, blocks.shape[0], _CHUNK):
            src, dst = blocks[start : start + _CHUNK], out[start : start + _CHUNK]
            if buf is None:
                dequantize_blocks(info.qtype, src, dst)
            else:
                dequantize_blocks(info.qtype, src, buf[: len(src)])
                dst.copy_(buf[: len(src)])
        return out.view(info.shape)


_PLAIN = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
_CHUNK = 4096  # blocks per dequantize_blocks call
_BLOCKS_OF_32 = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0)
