"""Paged attention on CPU: K/V live in fixed-size blocks, read through each request's block table.

PagedAttention: Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention", §4. A step's tokens are flattened (no padding to the longest
request); new K/V are written into the cache through the slot mapping, then each query
attends over its request's cached context.

Two paths, chosen per request, each a native kernel reading K/V in place through the block
tables (``csrc/``) or PyTorch (``PagedAttention`` picks once):
- decode (rows past the prompt: a decode's one token, a speculative verification's last known
  token and drafts, a recomputed run of outputs): every such row is a query of its own over the
  keys up to its position, all in one call, so that a row attends exactly as a decode step at
  its position would. PyTorch batches them into one SDPA call over their gathered blocks,
  padded to the longest context and masked, grouped-query heads folded into the query-length
  axis (K/V never repeated per head).
- prefill (a prompt's chunks, of any length): all such requests in one call, causal with the
  chunk's offset into its context. PyTorch: one SDPA call per request.

An 8-bit cache (int8, float8_e4m3fn; rows of codes and a scale, ``core/kv_cache_config.py``)
is quantized once, when this step's K/V are written, and read as stored on both paths: the
PyTorch one dequantizes the rows it gathers (and reads a first chunk's K/V from the cache,
as the kernels do, rather than the step's unquantized ones). Over an int8 cache both paths
compute what the kernels do (``_int8_attention_torch``): the queries and the softmax weights
as codes too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.core.kv_cache_config import QUANTIZED_KV_DTYPES
from pagedllm.kernels import attention as kernels
from pagedllm.layers.attention_metadata import AttentionMetadata
from pagedllm.layers.custom_op import CustomOp

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, row] (kv_row_width)


class PagedAttention(CustomOp):
    """Attention of a step's queries over their requests' paged K/V, for one layer.

    Args:
        num_heads, num_kv_heads, head_dim: the layer's (rank's) query and K/V heads.
        scale: softmax scale, usually head_dim ** -0.5.
        window: sliding-window layers: a query at position p attends to keys at positions
            p - window + 1 .. p (transformers' ``sliding_window``); 0: the whole causal context.

    The native kernels are picked where they take the head counts and size; decode requests
    run natively where the decode kernel takes them too (grouped-query heads up to its
    limit). Per call, explicitly: a K/V cache of a dtype the kernels do not read (float16)
    runs PyTorch; activations other than float32 (a model cast after it was built) write K/V
    and run prefill in PyTorch, as do k and v rows at different strides the write, and blocks
    larger than ``kernels.MAX_PREFILL_BLOCK`` the prefill.

    Call: ``attn(q, k, v, kv_cache, meta)``.
        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (this step's tokens).
        kv_cache: (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, row], in
            q's dtype or bfloat16 (read back in q's dtype), or 8-bit (row: head_dim codes and
            the scale, ``core.kv_cache_config.kv_row_width``).
        meta: the step's metadata (slot mapping, decode batch, prefill list).
        Returns [T, num_heads * head_dim], same dtype as q.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int = 0) -> None:
        super().__init__(kernels.prefill_attention_supported(num_heads, num_kv_heads, head_dim))
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.window = window
        self.native_decode = self.uses_native and kernels.decode_attention_supported(num_heads, num_kv_heads, head_dim)

    def forward_native(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        _write_kv_torch(k, v, kv_cache, meta.slot_mapping)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if meta.num_decodes:
            self._decode_torch(q, kv_cache, meta, out)
        _prefill_torch(q, k, v, kv_cache, meta, self.scale, self.window, out)
        return out

    def forward_cpu(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        if k_cache.dtype not in kernels.CACHE_DTYPES:
            return self.forward_native(q, k, v, kv_cache, meta)
        f32 = q.dtype == torch.float32  # the write and prefill kernels take float32 activations
        # The write reads k and v rows at one stride: the fused qkv's rows in place, not k
        # rows copied out by the q/k head norms.
        if f32 and k.stride(0) == v.stride(0):
            kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            _write_kv_torch(k, v, kv_cache, meta.slot_mapping)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        b = meta.num_decodes
        if b and self.native_decode:
            o = kernels.paged_decode_attention(
                q[:b], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale, self.window
            )
            out[:b] = o.view(b, -1)
        elif b:
            self._decode_torch(q, kv_cache, meta, out)
        if not meta.prefills:
            return out
        if f32 and k_cache.shape[1] <= kernels.MAX_PREFILL_BLOCK:
            kernels.paged_prefill_attention(
                q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_spans, self.scale, self.window, out
            )
        else:
            _prefill_torch(q, k, v, kv_cache, meta, self.scale, self.window, out)
        return out

    def _decode_torch(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, out: torch.Tensor) -> None:
        b = meta.num_decodes
        o = _decode_attention_torch(q[:b], kv_cache[0], kv_cache[1], meta, self.scale, self.window)
        out[:b] = o.view(b, -1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, heads={self.num_heads}/{self.num_kv_heads}x{self.head_dim}, window={self.window}"


def _write_kv_torch(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V ([T, num_kv_heads, head_dim]) into their cache slots (in the
    cache's dtype; 8-bit: quantized rows, as the native write stores them)."""
    for x, cache in zip((k, v), kv_cache):
        if cache.dtype in QUANTIZED_KV_DTYPES:  # index_copy_ lacks float8: bytes are copied
            rows = _quantize_rows(x, cache.dtype)
            cache.view(torch.uint8).view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, rows)
        else:
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x.to(cache.dtype))


def _quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, H, D] as 8-bit cache rows [T, H, D + 2] (as uint8 bytes): per row, scale = max|x| /
    the largest code (127; e4m3: 448) rounded up to float16, codes = x * (1 / scale) rounded to
    nearest even (e4m3 saturated), then the scale's bytes; the native write's arithmetic, step
    for step."""
    limit = 127.0 if dtype == torch.int8 else 448.0
    x = x.float()
    wanted = (x.abs().amax(-1, keepdim=True) * (1.0 / limit)).clamp(max=65504.0)
    scale = wanted.to(torch.float16)
    scale = torch.where(scale.float() < wanted, (scale.view(torch.int16) + 1).view(torch.float16), scale)
    y = x * torch.where(scale > 0, 1.0 / scale.float(), 0.0)
    codes = y.round().to(torch.int8) if dtype == torch.int8 else y.clamp(-limit, limit).to(dtype)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], -1)


def _cache_values(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., row] as values [..., head_dim] in ``dtype`` (8-bit: codes x scale)."""
    if rows.dtype not in QUANTIZED_KV_DTYPES:
        return rows.to(dtype)
    scale = rows[..., head_dim:].contiguous().view(torch.float16).float()
    return (rows[..., :head_dim].float() * scale).to(dtype)


def _prefill_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    out: torch.Tensor,
) -> None:
    """Each prefill request's rows of ``out``: one SDPA call per request; over an int8 cache, as
    the kernel computes it (``_int8_attention_torch``)."""
    k_cache, v_cache = kv_cache
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k.shape[1]
    block_size = k_cache.shape[1]
    as_stored = k_cache.dtype in QUANTIZED_KV_DTYPES  # a first chunk reads its K/V from the cache too
    for i, p in enumerate(meta.prefills):
        rows = slice(p.query_start, p.query_start + p.query_len)
        query = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        first_query = p.seq_len - p.query_len
        key_start = 0
        chunked = first_query > 0  # a later chunk or a cache hit: causal with an offset
        gather = chunked or as_stored
        mask = None
        if chunked and not (window and p.seq_len > window):
            mask = meta.window_masks.get((i, 0))
            if mask is None:
                q_pos = torch.arange(first_query, p.seq_len)[:, None]
                mask = meta.window_masks[(i, 0)] = torch.arange(p.seq_len)[None, :] <= q_pos
        if window and p.seq_len > window:
            # Keys before the first query's window are never read (their blocks may be gone).
            key_start = max(0, first_query - window + 1)
            mask = meta.window_masks.get((i, window))
            if mask is None:
                q_pos = torch.arange(first_query, p.seq_len)[:, None]
                k_pos = torch.arange(key_start, p.seq_len)[None, :]
                mask = meta.window_masks[(i, window)] = (k_pos <= q_pos) & (k_pos > q_pos - window)
            if not gather:
                keys, values = k[rows], v[rows]
            else:
                first_block = key_start // block_size
                span = slice(key_start - first_block * block_size, p.seq_len - first_block * block_size)
                keys = _cache_values(k_cache[p.block_ids[first_block:]].flatten(0, 1)[span], head_dim, q.dtype)
                values = v_cache[p.block_ids[first_block:]].flatten(0, 1)[span]
        elif not gather:  # whole context is this chunk: use it directly, no gather
            keys, values = k[rows], v[rows]
        else:
            keys = _cache_values(k_cache[p.block_ids].flatten(0, 1)[: p.seq_len], head_dim, q.dtype)
            values = v_cache[p.block_ids].flatten(0, 1)[: p.seq_len]
        keys = keys.transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
        values = values.transpose(0, 1).unsqueeze(0)  # as stored where gathered
        if k_cache.dtype == torch.int8:  # the G heads of a KV head ride the query axis
            if mask is None:
                mask = torch.ones(p.query_len, p.query_len, dtype=torch.bool).tril()
            o = _int8_attention_torch(
                query.unflatten(1, (-1, group)).flatten(2, 3), keys, values, mask.repeat(group, 1), scale, key_start
            )
            out[rows] = o.view(num_heads, p.query_len, head_dim).transpose(0, 1).reshape(p.query_len, -1).to(q.dtype)
            continue
        values = _cache_values(values, head_dim, q.dtype)
        o = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[rows] = o[0].transpose(0, 1).reshape(p.query_len, num_heads * head_dim)


def _decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Decode attention in PyTorch (no native kernel): gather blocks, pad, mask. [b, H, D] out."""
    b, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    tables = meta.decode_block_tables
    # [b, L, Hkv, D] -> [b, Hkv, L, D]; the G query heads of a KV head ride the query axis.
    keys = _cache_values(k_cache[tables].flatten(1, 2).transpose(1, 2), head_dim, q.dtype)
    values = _cache_values(v_cache[tables].flatten(1, 2).transpose(1, 2), head_dim, q.dtype)
    query = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
    # The padding mask (keys past each request's length), built on first use by this fallback only.
    mask = meta.window_masks.get((-1, window))
    if mask is None:
        key_pos = torch.arange(keys.shape[2])
        lens = meta.decode_seq_lens[:, None, None, None]
        mask = key_pos < lens
        if window:
            mask &= key_pos >= lens - window
        meta.window_masks[(-1, window)] = mask
    if k_cache.dtype == torch.int8:
        v_rows = v_cache[tables].flatten(1, 2).transpose(1, 2)
        return _int8_attention_torch(query, keys, v_rows, mask, scale).reshape(b, num_heads, head_dim)
    o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    return o.reshape(b, num_heads, head_dim)


def _int8_attention_torch(
    query: torch.Tensor,
    keys: torch.Tensor,
    v_rows: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    first_key: int = 0,
) -> torch.Tensor:
    """Attention over an int8 cache as the kernels compute it (csrc/paged_attention.cpp and
    prefill_attention.cpp): queries [..., Q, D] scored as int8 codes
    (``kernels.int8_cache_queries``) against keys [..., L, D] (values, at positions first_key
    + index); per query and tile of 16 positions from a multiple of 16, the softmax weights
    times the value rows' scales as codes in [0, 127] (times the tile's largest / 127; 0 where
    it is at most ``kernels.INT8_WEIGHT_FLOOR``) against the value codes of v_rows [..., L,
    D + 2]. mask [..., Q, L] (broadcast): the keys attended, at least one per query. [..., Q, D]
    float32 out."""
    head_dim = query.shape[-1]
    scores = torch.einsum("...qd,...ld->...ql", kernels.int8_cache_queries(query, scale), keys.float()) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    v_scales = v_rows[..., head_dim:].contiguous().view(torch.float16).float()  # [..., L, 1]
    w = e * v_scales.transpose(-1, -2)
    lead = first_key % 16
    tiles = F.pad(w, (lead, (-(lead + w.shape[-1])) % 16)).unflatten(-1, (-1, 16))
    top = tiles.amax(-1, keepdim=True)
    live = top > kernels.INT8_WEIGHT_FLOOR
    inv = torch.where(live, top.new_tensor(127.0) / top, 0.0)  # one division, as the kernel's
    codes = (tiles * inv).round()  # inv is 0 where the tile is not live
    w = (codes * (top / 127.0)).flatten(-2)[..., lead : lead + w.shape[-1]]
    return torch.einsum("...ql,...ld->...qd", w, v_rows[..., :head_dim].float()) / e.sum(-1, keepdim=True)
