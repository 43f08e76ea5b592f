"""The one seam between PyTorch tensors and the native kernels: every call into the library.

One typed function per kernel. Each checks what the C code cannot: CPU tensors, dtypes,
strides and shapes. A case the kernel does not cover (another dtype, a non-CPU tensor,
no library) returns None / False and the caller runs PyTorch; a call that breaks the
kernel's contract in a way only our own code could (mismatched shapes, index tensors that
are not int64) raises ValueError, since passing it on would read or write out of bounds.
The library is ``library.native_library()``: this process's ISA, or ``use_isa``'s in tests.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedllm.kernels import abi
from pagedllm.kernels.library import native_library

PANEL = abi.CONSTANTS["PAGEDLLM_PANEL"]  # output columns per packed panel
W8A8_GROUP = abi.CONSTANTS["PAGEDLLM_QUANT_GROUP"]  # input features per scale, of weights and activations
Q4A8_GROUP_BYTES = abi.CONSTANTS["PAGEDLLM_Q4A8_GROUP_BYTES"]  # per panel and group of a w4a8 weight
_CACHE_DTYPES = (torch.float32, torch.bfloat16)
LINEAR_F32, LINEAR_W8A8, LINEAR_Q4A8 = (abi.CONSTANTS[f"PAGEDLLM_LINEAR_{k}"] for k in ("F32", "W8A8", "Q4A8"))
# The structs passed to decode_layers (pagedllm_abi.h documents each field): LinearDesc is one
# packed linear layer (``linear_desc``), LayerDesc one decoder layer, DecoderDesc the model.
LinearDesc, LayerDesc, DecoderDesc, _StepGroup = (
    abi.STRUCTS[name] for name in ("LinearDesc", "LayerDesc", "DecoderDesc", "StepGroup")
)


def available() -> bool:
    """Whether the native kernels run in this process."""
    return native_library() is not None


def linear_w8a8_available() -> bool:
    """Whether this library has the w8a8 GEMM (its ``linear_w8a8_available`` export)."""
    lib = native_library()
    return lib is not None and bool(lib.linear_w8a8_available())


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor | None:
    """Decode attention read in place through block tables; None if the kernel cannot run.

    Args:
        q: [B, num_heads, head_dim], float (the kernel computes in float32); head_dim 64, 128 or 256.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32 or bfloat16, contiguous.
        block_tables: [B, max_blocks] int64, contiguous; seq_lens: [B] int64 (keys per request).
        window: > 0: attend only to the last ``window`` keys; 0: all keys.

    Returns:
        [B, num_heads, head_dim] in q's dtype.

    Raises:
        ValueError: shapes or index dtypes that do not fit together.
    """
    lib = native_library()
    if lib is None or not _on_cpu(q, k_cache, v_cache) or k_cache.dtype not in _CACHE_DTYPES:
        return None
    b, hq, d = q.shape
    if d not in _head_dims(lib):
        return None
    _check_cache(k_cache, v_cache, hq, d)
    _check_index(block_tables, "block_tables", (b, block_tables.shape[-1]))
    _check_index(seq_lens, "seq_lens", (b,))
    q32 = q.float().contiguous()
    out = torch.empty_like(q32)
    kernel = lib.paged_decode_attention_bf16 if k_cache.dtype == torch.bfloat16 else lib.paged_decode_attention_f32
    status = kernel(
        _ptr(q32), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), block_tables.shape[1], _ptr(seq_lens),
        _ptr(out), b, hq, k_cache.shape[2], d, k_cache.shape[1], scale, window,
    )
    return out.to(q.dtype) if status == 0 else None


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    spans: torch.Tensor,
    scale: float,
    window: int,
    out: torch.Tensor,
) -> bool:
    """Causal attention of every prefill request's query rows over its paged context, into
    ``out``; False (nothing written) where the kernel cannot run.

    Args:
        q: [T, num_heads, head_dim] float32, heads contiguous (rows at any stride).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32 or
            bfloat16, contiguous, already holding this step's K/V.
        block_tables: [R, max_blocks] int64, contiguous: each prefill request's blocks.
        spans: [3, R] int64, contiguous: per request its first query row, query count and keys.
        window: > 0: a query at position p sees keys p - window + 1 .. p; 0: all before it.
        out: [T, num_heads * head_dim] float32, contiguous; the prefill rows are written.

    Raises:
        ValueError: shapes or index dtypes that do not fit together.
    """
    lib = native_library()
    t, hq, d = q.shape
    if (
        lib is None or not _on_cpu(q, k_cache, v_cache, out) or q.dtype != torch.float32
        or k_cache.dtype not in _CACHE_DTYPES or q.stride(2) != 1 or q.stride(1) != d or not out.is_contiguous()
    ):
        return False
    _check_cache(k_cache, v_cache, hq, d)
    r = block_tables.shape[0]
    _check_index(block_tables, "block_tables", (r, block_tables.shape[-1]))
    _check_index(spans, "spans", (3, r))
    if out.shape != (t, hq * d) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 [{t}, {hq * d}], got {out.dtype} {list(out.shape)}")
    status = lib.paged_prefill_attention(
        int(k_cache.dtype == torch.bfloat16), _ptr(q), q.stride(0), _ptr(k_cache), _ptr(v_cache),
        _ptr(block_tables), block_tables.shape[1], _ptr(spans[0]), _ptr(spans[1]), _ptr(spans[2]),
        _ptr(out), r, hq, k_cache.shape[2], d, k_cache.shape[1], scale, window,
    )
    return status == 0


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """``k_cache`` / ``v_cache`` slot ``slot_mapping[t]`` = row t of k / v, converted to the
    cache's dtype in one pass; False (nothing written) where the kernel cannot run.

    Args:
        k, v: [T, num_kv_heads, head_dim] float32, heads contiguous, one row stride for both.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32 or bfloat16, contiguous.
        slot_mapping: [T] int64, each < num_blocks * block_size.

    Raises:
        ValueError: shapes or index dtypes that do not fit together.
    """
    lib = native_library()
    t, hkv, d = k.shape
    if (
        lib is None or not _on_cpu(k, v, k_cache, v_cache) or k.dtype != torch.float32 or v.dtype != torch.float32
        or k_cache.dtype not in _CACHE_DTYPES or k.stride(0) != v.stride(0)
        or k.stride(1) != d or v.stride(1) != d or k.stride(2) != 1 or v.stride(2) != 1
    ):
        return False
    if v.shape != k.shape or k_cache.shape[2:] != (hkv, d):
        raise ValueError(f"k, v {list(k.shape)}, {list(v.shape)} do not fit the cache {list(k_cache.shape)}")
    _check_cache(k_cache, v_cache, hkv, d)
    _check_index(slot_mapping, "slot_mapping", (t,))
    lib.write_kv_cache(
        int(k_cache.dtype == torch.bfloat16), _ptr(k), _ptr(v), k.stride(0), _ptr(k_cache), _ptr(v_cache),
        _ptr(slot_mapping), t, hkv * d,
    )
    return True


def add_rms_norm(x: torch.Tensor | None, stream: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``stream += x`` in place (x None: stream as it is), then RMSNorm of ``stream`` by
    ``weight``: the normalized [..., H] float32, or None (stream untouched) where the kernel
    cannot run.

    Args:
        x: [..., H] float32, contiguous, stream's shape; or None.
        stream: [..., H] float32, contiguous: the residual stream.
        weight: [H] float32; eps: added to the mean square.

    Raises:
        ValueError: x's shape differs from stream's, or weight is not [H].
    """
    lib = native_library()
    tensors = [stream, weight] if x is None else [x, stream, weight]
    if lib is None or not _on_cpu(*tensors) or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        return None
    h = stream.shape[-1]
    if (x is not None and x.shape != stream.shape) or weight.shape != (h,):
        x_shape = None if x is None else list(x.shape)
        raise ValueError(f"add_rms_norm: x {x_shape}, stream {list(stream.shape)}, weight {list(weight.shape)}")
    out = torch.empty_like(stream)
    lib.add_rms_norm(None if x is None else _ptr(x), _ptr(stream), _ptr(weight), _ptr(out), stream.numel() // h, h, eps)
    return out


def rotary_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate ``x`` in place by cos and signed sin (``RotaryEmbedding.forward``'s layout);
    False (x untouched) where the kernel cannot run.

    Args:
        x: [T, heads, D] float32, heads contiguous (rows at any stride).
        cos, sin: [T, 1, D] float32, the two halves of one [T, 2, D] buffer's rows (sin right
            after cos): the layout the kernel reads; anything else returns False.

    Raises:
        ValueError: cos's rows do not match x's.
    """
    lib = native_library()
    t, heads, d = x.shape
    if (
        lib is None or not _on_cpu(x, cos, sin) or x.dtype != torch.float32 or cos.dtype != torch.float32
        or x.stride(2) != 1 or x.stride(1) != d or cos.stride(0) != 2 * d or cos.stride(-1) != 1
        or sin.data_ptr() != cos.data_ptr() + d * cos.element_size()
    ):
        return False
    if cos.shape != (t, 1, d) or sin.shape != cos.shape:
        raise ValueError(f"rotary: cos/sin {list(cos.shape)}, {list(sin.shape)} for x {list(x.shape)}")
    lib.rotary_inplace(_ptr(x), x.stride(0), _ptr(cos), t, heads, d)
    return True


def silu_and_mul(gate_up: torch.Tensor) -> bool:
    """``gate = silu(gate) * up`` in place, gate_up: [T, 2 * I] float32 (gate first, rows at
    any stride); False (untouched) where the kernel cannot run."""
    return _act_and_mul("silu_and_mul", gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> bool:
    """``gate = gelu_tanh(gate) * up`` in place (GELU's tanh approximation), as
    ``silu_and_mul``; False (untouched) where the kernel cannot run."""
    return _act_and_mul("gelu_tanh_and_mul", gate_up)


def _act_and_mul(kernel: str, gate_up: torch.Tensor) -> bool:
    lib = native_library()
    if lib is None or not _on_cpu(gate_up) or gate_up.dtype != torch.float32 or gate_up.stride(1) != 1:
        return False
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"{kernel} needs [T, 2 * I], got {list(gate_up.shape)}")
    getattr(lib, kernel)(_ptr(gate_up), gate_up.stride(0), gate_up.shape[0], gate_up.shape[1] // 2)
    return True


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """LongTensor[S]: the first index of each row's maximum of logits [S, V] float32,
    contiguous, as ``argmax`` gives it; None where the kernel cannot run."""
    lib = native_library()
    if lib is None or not _on_cpu(logits) or logits.dtype != torch.float32 or not logits.is_contiguous():
        return None
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows needs [S, V], got {list(logits.shape)}")
    out = torch.empty(logits.shape[0], dtype=torch.long)
    lib.argmax_rows(_ptr(logits), logits.shape[0], logits.shape[1], _ptr(out))
    return out


def linear_pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float -> its float32 panels for ``linear_f32``: [ceil(N / 32) * 32 * K].

    Raises:
        RuntimeError: no native library here (check ``available()``).
        ValueError: weight is not a 2-D CPU tensor.
    """
    lib = _require()
    w32 = _matrix(weight, "weight").float().contiguous()
    n, k = w32.shape
    packed = torch.empty(-(-n // PANEL) * PANEL * k)
    lib.linear_pack_f32(_ptr(w32), _ptr(packed), n, k)
    return packed


def linear_f32(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ w.T + bias`` on ``linear_pack_f32``'s panels: x [M, K] float32 (rows at any
    stride) -> [M, out_features] float32.

    Args:
        bias: float32 padded to whole panels ([ceil(N / 32) * 32]), or None.

    Raises:
        RuntimeError: no native library here.
        ValueError: x, packed or bias do not fit each other.
    """
    lib = _require()
    x = _rows(x, torch.float32)
    m, k = x.shape
    _check_packed(packed, torch.float32, out_features, k, bias)
    y = x.new_empty(m, out_features)
    lib.linear_f32(_ptr(x), x.stride(0), _ptr(packed), _ptr_or_none(bias), _ptr(y), m, out_features, k)
    return y


def linear_pack_w8a8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> ``linear_w8a8``'s (packed int8 panels, wscale float32, wsum128 int32):
    int8 codes symmetric per group of 32 input features, zero padded to whole panels and groups.

    Raises:
        RuntimeError: no w8a8 GEMM here (check ``linear_w8a8_available()``).
        ValueError: weight is not a 2-D CPU tensor.
    """
    lib = _require()
    w32 = _matrix(weight, "weight").float().contiguous()
    n, k = w32.shape
    panels, groups = -(-n // PANEL), -(-k // W8A8_GROUP)
    packed = torch.empty(panels * PANEL * groups * W8A8_GROUP, dtype=torch.int8)
    wscale = torch.empty(panels * groups * PANEL)
    wsum128 = torch.empty(panels * groups * PANEL, dtype=torch.int32)
    if lib.linear_pack_w8a8(_ptr(w32), _ptr(packed), _ptr(wscale), _ptr(wsum128), n, k) != 0:
        raise RuntimeError("this build of the native kernels has no w8a8 GEMM")
    return packed, wscale, wsum128


def linear_w8a8(
    x: torch.Tensor,
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """``x @ w.T + bias`` with x quantized to int8 per row and group of 32 on the fly: x
    [M, K] float32 (rows at any stride) -> [M, out_features] float32.

    Args:
        packed: ``linear_pack_w8a8``'s three tensors.
        bias: float32 padded to whole panels ([ceil(N / 32) * 32]), or None.

    Raises:
        RuntimeError: no w8a8 GEMM here.
        ValueError: x, packed or bias do not fit each other.
    """
    lib = _require()
    x = _rows(x, torch.float32)
    m, k = x.shape
    codes, wscale, wsum128 = packed
    _check_w8a8(packed, out_features, k, bias)
    y = x.new_empty(m, out_features)
    status = lib.linear_w8a8(
        _ptr(x), x.stride(0), _ptr(codes), _ptr(wscale), _ptr(wsum128), _ptr_or_none(bias), _ptr(y), m, out_features, k
    )
    if status != 0:
        raise RuntimeError("this build of the native kernels has no w8a8 GEMM")
    return y


def linear_pack_q4a8(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """4-bit weights ``w = scales * codes + mins`` per group of 32 input features -> ``linear_q4a8``'s
    panels, uint8 [ceil(N / 32) * ceil(K / 32) * 640], zero padded to whole panels and groups.

    Args:
        codes: [N, K] uint8 in [0, 15] (higher bits are ignored).
        scales, mins: [N, ceil(K / 32)] float, rounded to float16 (the kernel's precision;
            GGUF Q4_0 / Q4_1 blocks' values are float16 already, so they pass unchanged).

    Raises:
        RuntimeError: no native library here.
        ValueError: shapes or dtypes that do not fit together.
    """
    lib = _require()
    n, k = _matrix(codes, "codes").shape
    groups = -(-k // W8A8_GROUP)
    if codes.dtype != torch.uint8 or scales.shape != (n, groups) or mins.shape != (n, groups):
        raise ValueError(
            f"w4a8 weights: need uint8 codes [N, K] and scales, mins [N, ceil(K / 32)]; got {codes.dtype} "
            f"{list(codes.shape)}, {list(scales.shape)}, {list(mins.shape)}"
        )
    codes = codes.contiguous()
    d16, m16 = (t.to(torch.float16).contiguous().view(torch.int16) for t in (scales, mins))
    packed = torch.empty(-(-n // PANEL) * groups * Q4A8_GROUP_BYTES, dtype=torch.uint8)
    lib.linear_pack_q4a8(_ptr(codes), _ptr(d16), _ptr(m16), _ptr(packed), n, k)
    return packed


def linear_q4a8(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ w.T + bias`` on ``linear_pack_q4a8``'s panels, x quantized to int8 per row and
    group of 32 on the fly (llama.cpp's Q4_1 x Q8_1 dot product): x [M, K] float32 (rows at
    any stride) -> [M, out_features] float32.

    Args:
        bias: float32 padded to whole panels ([ceil(N / 32) * 32]), or None.

    Raises:
        RuntimeError: no native library here.
        ValueError: x, packed or bias do not fit each other.
    """
    lib = _require()
    x = _rows(x, torch.float32)
    m, k = x.shape
    _check_q4a8(packed, out_features, k, bias)
    y = x.new_empty(m, out_features)
    lib.linear_q4a8(_ptr(x), x.stride(0), _ptr(packed), _ptr_or_none(bias), _ptr(y), m, out_features, k)
    return y


def linear_desc(
    kind: int,
    packed: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    bias: torch.Tensor | None,
    out_features: int,
    in_features: int,
) -> LinearDesc:
    """The LinearDesc of a packed layer: ``packed`` as ``linear_f32``, ``linear_w8a8`` or
    ``linear_q4a8`` take it (by ``kind``), checked as they check it. The caller keeps the
    tensors alive as long as the descriptor is used.

    Raises:
        ValueError: packed or bias do not fit [out_features, in_features], or an unknown kind.
    """
    if kind == LINEAR_F32:
        _check_packed(packed, torch.float32, out_features, in_features, bias)
        w, wscale, wsum128 = packed, None, None
    elif kind == LINEAR_W8A8:
        _check_w8a8(packed, out_features, in_features, bias)
        w, wscale, wsum128 = packed
    elif kind == LINEAR_Q4A8:
        _check_q4a8(packed, out_features, in_features, bias)
        w, wscale, wsum128 = packed, None, None
    else:
        raise ValueError(f"unknown linear kind {kind}")
    return LinearDesc(
        kind, out_features, in_features, _ptr(w), _ptr_or_none(wscale), _ptr_or_none(wsum128), _ptr_or_none(bias)
    )


def decode_attention_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the native decode attention has a kernel for these head counts and size (False
    without a library)."""
    lib = native_library()
    if lib is None:
        return False
    group, rest = divmod(num_heads, num_kv_heads)
    return head_dim in _head_dims(lib) and rest == 0 and group <= lib.pagedllm_limits().contents.max_group


@functools.cache
def _head_dims(lib: ctypes.CDLL) -> tuple[int, ...]:
    """The head sizes ``lib``'s attention kernels take (its ``pagedllm_limits()``)."""
    limits = lib.pagedllm_limits().contents
    return tuple(limits.head_dims[: limits.num_head_dims])


def decode_layers(
    decoder: DecoderDesc,
    stream: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    slot_mappings: list[torch.Tensor],
    block_tables: list[torch.Tensor],
    seq_lens: torch.Tensor,
) -> torch.Tensor | None:
    """Every layer of a decoder and its final norm, for B decode tokens, in one native call
    (csrc/decoder.cpp); None (nothing written) where it cannot run.

    Args:
        decoder: the model's weights, sizes and K/V caches (``models/native_decoder.py``).
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
        ValueError: shapes or dtypes that do not fit the decoder.
    """
    lib = native_library()
    if lib is None or not _on_cpu(stream, *cos_sin):
        return None
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
        _check_index(slots, "slot_mapping", (b,))
        _check_index(tables, "block_tables", (b, tables.shape[-1]))
        group.slots, group.block_tables, group.max_blocks = _ptr(slots), _ptr(tables), tables.shape[1]
    _check_index(seq_lens, "seq_lens", (b,))
    out = torch.empty_like(stream)
    tables = (ctypes.c_void_p * 2)(_ptr(cos_sin[0]), _ptr(cos_sin[1]))
    status = lib.decode_layers(ctypes.byref(decoder), _ptr(stream), tables, groups, _ptr(seq_lens), b, _ptr(out))
    return out if status == 0 else None


def _require() -> ctypes.CDLL:
    lib = native_library()
    if lib is None:
        raise RuntimeError("no native kernels here (pagedllm/csrc did not build, or PAGEDLLM_DISABLE_NATIVE=1)")
    return lib


def _on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _ptr_or_none(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _matrix(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() != 2 or not _on_cpu(t):
        raise ValueError(f"{name} must be a 2-D CPU tensor, got {list(t.shape)} on {t.device}")
    return t


def _rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the GEMMs read it: 2-D, on the CPU, in ``dtype``, unit column stride."""
    if x.dtype != dtype:
        raise ValueError(f"the GEMM needs {dtype} input, got {x.dtype}")
    _matrix(x, "x")
    return x if x.stride(1) == 1 else x.contiguous()


def _check_packed(packed: torch.Tensor, dtype: torch.dtype, n: int, k: int, bias: torch.Tensor | None) -> None:
    """Panels of an [n, k] weight (k padded as the packing pads it), and a panel-padded bias."""
    padded_n = -(-n // PANEL) * PANEL
    if packed.dtype != dtype or packed.numel() != padded_n * k or not packed.is_contiguous():
        raise ValueError(f"packed weight: need {padded_n * k} contiguous {dtype}, got {packed.numel()} {packed.dtype}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (padded_n,) or not bias.is_contiguous()):
        raise ValueError(f"bias: need float32 [{padded_n}] (whole panels), got {bias.dtype} {list(bias.shape)}")


def _check_w8a8(
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor], n: int, k: int, bias: torch.Tensor | None
) -> None:
    """``linear_pack_w8a8``'s codes, scales and sums of an [n, k] weight, and a panel-padded bias."""
    codes, wscale, wsum128 = packed
    _check_packed(codes, torch.int8, n, -(-k // W8A8_GROUP) * W8A8_GROUP, bias)
    groups = -(-n // PANEL) * PANEL * -(-k // W8A8_GROUP)
    if (wscale.dtype, wsum128.dtype, wscale.numel(), wsum128.numel()) != (torch.float32, torch.int32, groups, groups):
        raise ValueError(
            f"w8a8 scales: need {groups} float32 and int32, "
            f"got {wscale.numel()} {wscale.dtype}, {wsum128.numel()} {wsum128.dtype}"
        )


def _check_q4a8(packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None) -> None:
    """``linear_pack_q4a8``'s panels of an [n, k] weight, and a panel-padded bias."""
    # Counted in elements per output column: one panel-group's bytes per 32 columns.
    _check_packed(packed, torch.uint8, n, -(-k // W8A8_GROUP) * Q4A8_GROUP_BYTES // PANEL, bias)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, head_dim: int) -> None:
    """K and V caches alike, contiguous, of head_dim, with a KV head count dividing num_heads."""
    if (
        k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype
        or not k_cache.is_contiguous() or not v_cache.is_contiguous()
        or k_cache.shape[3] != head_dim or num_heads % k_cache.shape[2]
    ):
        raise ValueError(
            f"kv cache: need two contiguous [blocks, block_size, kv_heads | {num_heads}, {head_dim}] of one dtype, "
            f"got {list(k_cache.shape)} {k_cache.dtype}, {list(v_cache.shape)} {v_cache.dtype}"
        )


def _check_index(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.int64 or tuple(t.shape) != shape or not t.is_contiguous() or not _on_cpu(t):
        raise ValueError(f"{name}: need contiguous int64 {list(shape)} on the CPU, got {t.dtype} {list(t.shape)}")
