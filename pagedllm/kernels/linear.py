"""The GEMMs on packed weights (csrc/linear.cpp): packing a weight once, ``x @ w.T + bias``
on the packed panels, and a packed layer's descriptor for the one-call decoder
(``kernels.decoder``). Four formats, each in panels of ``PANEL`` output columns: float32,
w8a8 (int8 weights per output feature, int8 activations per group of ``QUANT_GROUP`` inputs),
w4a8 (4-bit weights, int8 activations) and q8a8 (GGUF Q8_0: int8 weights with a float16 scale
per group of ``QUANT_GROUP`` inputs, as the file stores them; int8 activations)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.kernels import abi, huge_pages
from pagedllm.kernels.args import matrix, prompt_row, ptr, ptr_or_none, require

PANEL = abi.CONSTANTS["PAGEDLLM_PANEL"]  # output columns per packed panel
QUANT_GROUP = abi.CONSTANTS["PAGEDLLM_QUANT_GROUP"]  # input features per scale, of weights and activations
Q4A8_GROUP_BYTES = abi.CONSTANTS["PAGEDLLM_Q4A8_GROUP_BYTES"]  # per panel and group of a w4a8 weight
Q4A8_SYMMETRIC_GROUP_BYTES = abi.CONSTANTS["PAGEDLLM_Q4A8_SYMMETRIC_GROUP_BYTES"]  # of a symmetric one (no m)
LINEAR_F32, LINEAR_W8A8, LINEAR_Q4A8, LINEAR_Q8A8, LINEAR_Q4A8_SYMMETRIC = (
    abi.CONSTANTS[f"PAGEDLLM_LINEAR_{k}"] for k in ("F32", "W8A8", "Q4A8", "Q8A8", "Q4A8_SYMMETRIC")
)
LINEAR_KINDS = abi.CONSTANTS["PAGEDLLM_LINEAR_KINDS"]  # kinds are 0 .. LINEAR_KINDS - 1
LinearDesc = abi.STRUCTS["LinearDesc"]  # one packed layer (pagedllm_abi.h documents each field)

W8A8Packed = tuple[torch.Tensor, torch.Tensor]  # int8 panels, wscale float32
Q8A8Packed = tuple[torch.Tensor, torch.Tensor]  # int8 panels, d float16 per panel, group and column
Q8_0_BLOCK_BYTES = 2 + QUANT_GROUP  # a GGUF Q8_0 block: float16 d, then QUANT_GROUP int8 codes


def amx_tiles(enable: bool | None = None) -> bool:
    """Whether the prompt rows of ``linear_w8a8``, ``linear_q8a8``, ``linear_q4a8`` and
    ``kquant.linear`` run Intel AMX tiles in bfloat16 (csrc/amx.h), and with them the scores of
    ``attention.paged_prefill_attention`` over a bfloat16 cache: the CPU has AMX-BF16, Linux
    granted its tile state, and neither ``PAGEDLLM_DISABLE_AMX=1`` (read when the library loads)
    nor ``enable=False`` switched them off (``enable=True``: on again).

    Raises:
        RuntimeError: no native library here.
    """
    lib = require()
    return bool(lib.gemm_amx(-1 if enable is None else int(enable)))


def linear_pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float -> its float32 panels for ``linear_f32``: [ceil(N / 32) * 32 * K].

    Raises:
        RuntimeError: no native library here (check ``library.available()``).
        ValueError: weight is not a 2-D CPU tensor.
    """
    lib = require()
    w32 = matrix(weight, "weight").float().contiguous()
    n, k = w32.shape
    packed = huge_pages.empty(-(-n // PANEL) * PANEL * k, torch.float32)
    lib.linear_pack_f32(ptr(w32), ptr(packed), n, k)
    return packed


def linear_pack_w8a8(weight: torch.Tensor, row_max: torch.Tensor | None = None) -> W8A8Packed:
    """weight [N, K] float -> ``linear_w8a8``'s (packed int8 panels, wscale float32): int8 codes
    symmetric per output feature (``wscale`` = a row's max|w| / 127, one per padded row; a row
    whose max is under 1e-30 gets zero codes), padded with zero codes to whole panels and
    groups of 32 input features, each byte in the encoding this library's int8 dot product
    reads (q + 128 on VNNI kernels, q elsewhere): packed panels belong to the library that
    packed them.

    Args:
        row_max: [N] float, each row's scale times 127 instead of its own max|w|: a
            tensor-parallel rank's slice of longer rows takes the whole rows' maxima (never
            below the slice's own), so its codes are those of the unsharded weight.

    Raises:
        RuntimeError: no native library here.
        ValueError: weight is not a 2-D CPU tensor or holds NaN or inf; row_max is not a CPU
            tensor [N], is not finite or is below a row's max|w|.
    """
    lib = require()
    w32 = matrix(weight, "weight").float().contiguous()
    n, k = w32.shape
    own_max = w32.abs().amax(dim=1)  # NaN where a row holds one, inf where it holds inf
    if not bool(torch.isfinite(own_max).all()):
        bad = int((~torch.isfinite(w32)).sum())
        raise ValueError(f"weight: {bad} non-finite values (NaN or inf), which int8 codes cannot hold")
    if row_max is not None:
        if not isinstance(row_max, torch.Tensor) or tuple(row_max.shape) != (n,) or row_max.device.type != "cpu":
            got = f"{list(row_max.shape)} on {row_max.device}" if isinstance(row_max, torch.Tensor) else type(row_max)
            raise ValueError(f"row_max: need a CPU tensor [{n}], got {got}")
        row_max = row_max.float().contiguous()
        if not bool(torch.isfinite(row_max).all()) or bool((row_max < own_max).any()):
            raise ValueError("row_max: non-finite, or below some row's own max|w| (its codes would pass 127)")
    panels, groups = -(-n // PANEL), -(-k // QUANT_GROUP)
    packed = huge_pages.empty(panels * PANEL * groups * QUANT_GROUP, torch.int8)
    wscale = huge_pages.empty(panels * PANEL, torch.float32)
    scale_max = own_max if row_max is None else row_max  # own_max: the kernel need not find it again
    lib.linear_pack_w8a8(ptr(w32), ptr(scale_max), ptr(packed), ptr(wscale), n, k)
    return packed, wscale


def linear_pack_q8_0(blocks: torch.Tensor, in_features: int) -> Q8A8Packed | None:
    """GGUF Q8_0 blocks [N, in_features / 32 * 34] uint8 -> ``linear_q8a8``'s (int8 panels in
    ``linear_pack_w8a8``'s layout and byte encoding, d float16 [ceil(N / 32) * G * 32]), the
    codes and d bit for bit, zero padded; None where this library's int8 dot product cannot take
    a code of -128 (AVX2, AVX-512 without VNNI, NEON, scalar: the K-quant GEMM reads such
    blocks instead) and one occurs. Packed panels belong to the library that packed them.

    Raises:
        RuntimeError: no native library here.
        ValueError: blocks are not uint8 [N, in_features / 32 * 34] on the CPU, or in_features
            is not a positive multiple of 32.
    """
    lib = require()
    groups = in_features // QUANT_GROUP
    if in_features <= 0 or in_features % QUANT_GROUP:
        raise ValueError(f"Q8_0: in_features must be a positive multiple of {QUANT_GROUP}, got {in_features}")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != groups * Q8_0_BLOCK_BYTES:
        raise ValueError(f"Q8_0 blocks: need uint8 [N, {groups * Q8_0_BLOCK_BYTES}], got {blocks.dtype} {list(blocks.shape)}")
    blocks = matrix(blocks, "blocks").contiguous()
    n = blocks.shape[0]
    panels = -(-n // PANEL)
    packed = huge_pages.empty(panels * PANEL * in_features, torch.int8)
    d = huge_pages.empty(panels * groups * PANEL, torch.float16)
    if lib.linear_pack_q8_0(ptr(blocks), ptr(packed), ptr(d), n, in_features) != 0:
        return None
    return packed, d


def linear_pack_q4a8(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """4-bit weights ``w = scales * codes + mins`` per group of 32 input features -> ``linear_q4a8``'s
    panels, uint8 [ceil(N / 32) * ceil(K / 32) * 640], zero padded to whole panels and groups;
    with ``mins`` None, a symmetric weight (every min ``-8 * scales``: GGUF Q4_0's blocks,
    ``q4a8_symmetric``) in 576 bytes per panel and group, without the mins, for ``linear_q4a8``
    with ``symmetric``.

    Args:
        codes: [N, K] uint8 in [0, 15] (higher bits are ignored).
        scales, mins: [N, ceil(K / 32)] float, rounded to float16 (the kernel's precision;
            GGUF Q4_0 / Q4_1 blocks' values are float16 already, so they pass unchanged).

    Raises:
        RuntimeError: no native library here.
        ValueError: shapes or dtypes that do not fit together.
    """
    lib = require()
    n, k = matrix(codes, "codes").shape
    groups = -(-k // QUANT_GROUP)
    if codes.dtype != torch.uint8 or scales.shape != (n, groups) or (mins is not None and mins.shape != (n, groups)):
        raise ValueError(
            f"w4a8 weights: need uint8 codes [N, K] and scales, mins [N, ceil(K / 32)]; got {codes.dtype} "
            f"{list(codes.shape)}, {list(scales.shape)}, {None if mins is None else list(mins.shape)}"
        )
    codes = codes.contiguous()
    d16 = scales.to(torch.float16).contiguous().view(torch.int16)
    m16 = None if mins is None else mins.to(torch.float16).contiguous().view(torch.int16)
    packed = huge_pages.empty(-(-n // PANEL) * groups * _q4a8_group_bytes(mins is None), torch.uint8)
    lib.linear_pack_q4a8(ptr(codes), ptr(d16), ptr_or_none(m16), ptr(packed), n, k)
    return packed


def q4a8_symmetric(scales: torch.Tensor, mins: torch.Tensor) -> bool:
    """Whether every ``mins`` is ``-8 * scales`` in float16, as the packing rounds them (GGUF
    Q4_0's blocks): the weight may then be packed without its mins (``linear_pack_q4a8``'s
    ``mins=None``) and run as ``symmetric``."""
    d16 = scales.to(torch.float16)
    return bool(torch.equal(mins.to(torch.float16), d16 * -8))


def linear_f32(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ w.T + bias`` on ``linear_pack_f32``'s panels: x [M, K] float32 (rows at any
    stride) -> [M, out_features] float32.

    Args:
        bias: float32 padded to whole panels ([ceil(N / 32) * 32]), or None.

    Raises:
        RuntimeError: no native library here.
        ValueError: x, packed or bias do not fit each other.
    """
    x = _rows(x)
    _check_packed(packed, torch.float32, out_features, x.shape[1], bias)
    return _gemm(require().linear_f32, x, (packed,), bias, out_features)


def linear_w8a8(
    x: torch.Tensor, packed: W8A8Packed, bias: torch.Tensor | None, out_features: int, prompt_from: int | None = None
) -> torch.Tensor:
    """``x @ w.T + bias`` with x quantized to int8 per row and group of 32 on the fly: x
    [M, K] float32 (rows at any stride) -> [M, out_features] float32. Rows from ``prompt_from``
    on (None: none) are prompt tokens: where ``amx_tiles()``, x is rounded to bfloat16 for them
    instead and multiplies the weights' codes in AMX's tiles (float32 sums, times the column's
    scale). A row's result never depends on the other rows of the call.

    Args:
        packed: ``linear_pack_w8a8``'s two tensors.
        bias: float32 padded to whole panels ([ceil(N / 32) * 32]), or None.

    Raises:
        RuntimeError: no native library here.
        ValueError: x, packed or bias do not fit each other.
    """
    x = _rows(x)
    _check_w8a8(packed, out_features, x.shape[1], bias)
    return _gemm(require().linear_w8a8, x, packed, bias, out_features, prompt_row(x.shape[0], prompt_from))


def linear_q4a8(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    prompt_from: int | None = None,
    symmetric: bool = False,
) -> torch.Tensor:
    """``x @ w.T + bias`` on ``linear_pack_q4a8``'s panels, x quantized to int8 per row and
    group of 32 on the fly (llama.cpp's Q4_1 x Q8_1 dot product): x [M, K] float32 (rows at
    any stride) -> [M, out_features] float32. Rows from ``prompt_from`` on (None: none) are
    prompt tokens: where ``amx_tiles()``, x and the weights are rounded to bfloat16 for them
    instead, their products summed in float32 (AMX's tiles). A row's result never depends on
    the other rows of the call.

    Args:
        bias: float32 padded to whole panels ([ceil(N / 32) * 32]), or None.
        symmetric: ``packed`` came from ``linear_pack_q4a8`` with ``mins=None`` (every min
            ``-8 * scales``: GGUF Q4_0): the -8 is applied to the integer sums (one float
            operation fewer per group of 32 than the mins' term; other roundings, the same
            value).

    Raises:
        RuntimeError: no native library here.
        ValueError: x, packed or bias do not fit each other.
    """
    x = _rows(x)
    _check_q4a8(packed, out_features, x.shape[1], bias, symmetric)
    return _gemm(
        require().linear_q4a8, x, (packed,), bias, out_features, int(symmetric), prompt_row(x.shape[0], prompt_from)
    )


def linear_q8a8(
    x: torch.Tensor, packed: Q8A8Packed, bias: torch.Tensor | None, out_features: int, prompt_from: int | None = None
) -> torch.Tensor:
    """``x @ w.T + bias`` on ``linear_pack_q8_0``'s panels, x quantized to int8 per row and
    group of 32 on the fly (llama.cpp's Q8_0 x Q8_0 dot product): x [M, K] float32 (rows at
    any stride) -> [M, out_features] float32. Rows from ``prompt_from`` on (None: none) are
    prompt tokens: where ``amx_tiles()``, x and the weights ``d * q`` are rounded to bfloat16 for
    them instead, as ``linear_q4a8``'s. A row's result never depends on the other rows of the call.

    Args:
        bias: float32 padded to whole panels ([ceil(N / 32) * 32]), or None.

    Raises:
        RuntimeError: no native library here.
        ValueError: x, packed or bias do not fit each other.
    """
    x = _rows(x)
    _check_q8a8(packed, out_features, x.shape[1], bias)
    return _gemm(require().linear_q8a8, x, packed, bias, out_features, prompt_row(x.shape[0], prompt_from))


def linear_desc(
    kind: int,
    packed: torch.Tensor | W8A8Packed | Q8A8Packed,
    bias: torch.Tensor | None,
    out_features: int,
    in_features: int,
) -> LinearDesc:
    """The LinearDesc of a packed layer: ``packed`` as ``linear_f32``, ``linear_w8a8``,
    ``linear_q4a8`` (``LINEAR_Q4A8_SYMMETRIC``: with ``symmetric``) or ``linear_q8a8`` take it
    (by ``kind``), checked as they check it. The caller keeps the
    tensors alive as long as the descriptor is used.

    Raises:
        ValueError: packed or bias do not fit [out_features, in_features], or an unknown kind.
    """
    if kind == LINEAR_F32:
        _check_packed(packed, torch.float32, out_features, in_features, bias)
        w, wscale = packed, None
    elif kind == LINEAR_W8A8:
        _check_w8a8(packed, out_features, in_features, bias)
        w, wscale = packed
    elif kind in (LINEAR_Q4A8, LINEAR_Q4A8_SYMMETRIC):
        _check_q4a8(packed, out_features, in_features, bias, kind == LINEAR_Q4A8_SYMMETRIC)
        w, wscale = packed, None
    elif kind == LINEAR_Q8A8:
        _check_q8a8(packed, out_features, in_features, bias)
        w, wscale = packed  # wscale: the float16 d, as the kernel reads it
    else:
        raise ValueError(f"unknown linear kind {kind}")
    return LinearDesc(kind, out_features, in_features, ptr(w), ptr_or_none(wscale), ptr_or_none(bias))


def _gemm(
    kernel: Callable[..., None],
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    bias: torch.Tensor | None,
    out_features: int,
    *extra: int,
) -> torch.Tensor:
    """y [M, out_features] = kernel(x, its packed weight tensors, bias, ..., ``extra``): the call
    every GEMM shares."""
    m, k = x.shape
    y = x.new_empty(m, out_features)
    kernel(ptr(x), x.stride(0), *(ptr(w) for w in weights), ptr_or_none(bias), ptr(y), m, out_features, k, *extra)
    return y


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as the GEMMs read it: 2-D float32 on the CPU, unit column stride."""
    if x.dtype != torch.float32:
        raise ValueError(f"the GEMM needs float32 input, got {x.dtype}")
    matrix(x, "x")
    return x if x.stride(1) == 1 else x.contiguous()


def _check_packed(packed: torch.Tensor, dtype: torch.dtype, n: int, k: int, bias: torch.Tensor | None) -> None:
    """Panels of an [n, k] weight (k padded as the packing pads it), and a panel-padded bias."""
    padded_n = -(-n // PANEL) * PANEL
    if packed.dtype != dtype or packed.numel() != padded_n * k or not packed.is_contiguous():
        raise ValueError(f"packed weight: need {padded_n * k} contiguous {dtype}, got {packed.numel()} {packed.dtype}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (padded_n,) or not bias.is_contiguous()):
        raise ValueError(f"bias: need float32 [{padded_n}] (whole panels), got {bias.dtype} {list(bias.shape)}")


def _check_w8a8(packed: W8A8Packed, n: int, k: int, bias: torch.Tensor | None) -> None:
    """``linear_pack_w8a8``'s codes and scales of an [n, k] weight, and a panel-padded bias."""
    codes, wscale = packed
    _check_packed(codes, torch.int8, n, -(-k // QUANT_GROUP) * QUANT_GROUP, bias)
    rows = -(-n // PANEL) * PANEL
    if (wscale.dtype, wscale.numel(), wscale.is_contiguous()) != (torch.float32, rows, True):
        raise ValueError(f"w8a8 scales: need {rows} contiguous float32, got {wscale.numel()} {wscale.dtype}")


def _q4a8_group_bytes(symmetric: bool) -> int:
    return Q4A8_SYMMETRIC_GROUP_BYTES if symmetric else Q4A8_GROUP_BYTES


def _check_q4a8(packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None, symmetric: bool) -> None:
    """``linear_pack_q4a8``'s panels of an [n, k] weight (without mins where ``symmetric``), and
    a panel-padded bias."""
    # Counted in elements per output column: one panel-group's bytes per 32 columns.
    _check_packed(packed, torch.uint8, n, -(-k // QUANT_GROUP) * _q4a8_group_bytes(symmetric) // PANEL, bias)


def _check_q8a8(packed: Q8A8Packed, n: int, k: int, bias: torch.Tensor | None) -> None:
    """``linear_pack_q8_0``'s codes and d of an [n, k] weight, and a panel-padded bias."""
    codes, d = packed
    _check_packed(codes, torch.int8, n, k, bias)
    size = -(-n // PANEL) * PANEL * (k // QUANT_GROUP)
    if k % QUANT_GROUP or (d.dtype, d.numel(), d.is_contiguous()) != (torch.float16, size, True):
        raise ValueError(f"q8a8 scales: need {size} contiguous float16 (k a multiple of {QUANT_GROUP}), got {d.numel()} {d.dtype}")
