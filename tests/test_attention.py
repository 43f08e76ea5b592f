"""Paged attention against dense causal attention on the same K/V."""

import random

import pytest
import torch
from tests.native_isa import ISAS, on_isa
from tests.utils import assert_int8_attention, bfloat16_pair_bound

from pagedllm.kernels import library
from pagedllm.kernels.attention import (
    attention_in_bfloat16_pairs,
    paged_decode_attention,
    paged_prefill_attention,
)
from pagedllm.layers.attention import PagedAttention
from pagedllm.layers.attention_metadata import AttentionMetadata


def _dense(q, k, v, scale, window=0):
    """q: [n, H, D] at the last n positions of k/v [L, Hkv, D]; window > 0: sliding window."""
    n, h, _ = q.shape
    group = h // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    L = k.shape[0]
    q_pos = torch.arange(L - n, L)
    k_pos = torch.arange(L)[None, None, :]
    masked = k_pos > q_pos[None, :, None]
    if window:
        masked |= k_pos <= q_pos[None, :, None] - window
    scores = scores.masked_fill(masked, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)


def test_native_kernel_builds():
    assert library.native_library() is not None


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("backend", [*ISAS, "torch"])
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
def test_mixed_decode_and_chunked_prefill_match_dense(backend, dtype, cache_dtype, window):
    """window 5: a sliding-window layer; requests shorter and longer than the window; a
    bfloat16 cache under float32 activations (dtype auto). backend: an ISA's kernels, or
    PyTorch (``forward_native``)."""
    if backend == "torch":
        _check_against_dense(dtype, cache_dtype, window, native=False)
    else:
        with on_isa(backend):
            _check_against_dense(dtype, cache_dtype, window, native=True)


def _check_against_dense(dtype: torch.dtype, cache_dtype: torch.dtype, window: int, native: bool) -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    block_size, num_blocks, hkv, h, d = 4, 64, 2, 6, 64
    k_cache = torch.zeros(num_blocks, block_size, hkv, d)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)
    # (context already cached, new tokens this step): decodes first, then prefill chunks.
    reqs = [(5, 1), (0, 1), (11, 1), (0, 7), (6, 5), (3, 1 + 3), (9, 2), (0, 37), (20, 19)]  # several 16-lane tiles
    full_k, full_v, tables = [], [], []
    for cached, new in reqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        kk, vv = torch.randn(total, hkv, d), torch.randn(total, hkv, d)
        for pos in range(cached):  # what earlier steps wrote
            k_cache[table[pos // block_size], pos % block_size] = kk[pos]
            v_cache[table[pos // block_size], pos % block_size] = vv[pos]
        full_k.append(kk), full_v.append(vv), tables.append(table)
    query_lens = [new for _, new in reqs]
    seq_lens = [c + n for c, n in reqs]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    q = torch.randn(sum(query_lens), h, d)
    k = torch.cat([kk[c:] for kk, (c, _) in zip(full_k, reqs)])
    v = torch.cat([vv[c:] for vv, (c, _) in zip(full_v, reqs)])
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    attn = PagedAttention(h, hkv, d, d**-0.5, window)
    assert attn.uses_native or not native
    out = (attn if native else attn.forward_native)(q, k, v, (k_cache, v_cache), meta)
    assert out.dtype == dtype
    out = out.float()
    tol = 1e-5 if cache_dtype == torch.float32 else 3e-2
    start = 0
    for (cached, new), kk, vv in zip(reqs, full_k, full_v):
        ref = _dense(q[start : start + new].float(), kk.to(cache_dtype).float(), vv.to(cache_dtype).float(), d**-0.5, window)
        torch.testing.assert_close(out[start : start + new], ref, atol=tol, rtol=tol)
        start += new


def _cache_rows(values: torch.Tensor, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache rows of ``dtype`` for values [..., D] and the float32 values they hold: float rows
    rounded, 8-bit rows random codes (every finite fp8 code possible) and per-row scales."""
    if dtype in (torch.float32, torch.bfloat16):
        rows = values.to(dtype)
        return rows, rows.float()
    d = values.shape[-1]
    codes = (values * 40).clamp(-127, 127).round().to(torch.int8) if dtype == torch.int8 else (values * 60).to(dtype)
    scales = (torch.rand(*values.shape[:-1], 1, generator=gen) * 0.1 + 0.01).to(torch.float16)
    rows = torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)], -1).view(dtype)
    return rows, rows[..., :d].float() * scales.float()


@pytest.mark.parametrize("window", [0, 1500])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn],
                         ids=["f32", "bf16", "int8", "fp8"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("h,hkv,d", [(6, 2, 64), (2, 2, 64), (14, 2, 64), (8, 1, 64), (4, 1, 256), (6, 2, 128)],
                         ids=["g3", "g1", "g7", "g8", "g4-d256", "g3-d128"])
def test_long_contexts_attended_in_pieces_match_dense(isa, cache_dtype, window, h, hkv, d):
    """Decode over contexts the kernel splits into pieces (from 256 keys, an even number of
    about equal pieces of up to 1024 keys): lengths either side of where the number of pieces
    changes (1, 2, 4), pieces not a whole number of tiles, 1 to 8 query heads per KV head (the
    value sum's register blocks differ with the group), head sizes 64 to 256, a window whose
    start falls inside a piece and whose earlier blocks are holes (NaN: never read). An int8
    cache's products are of integer codes: its reference quantizes as the kernel does."""
    gen = torch.Generator().manual_seed(1)
    block_size = 16
    seq_lens = [1, 255, 256, 1025, 2048, 2049, 3001]
    blocks = [-(-s // block_size) for s in seq_lens]
    total = sum(blocks)
    order = torch.randperm(total + 1, generator=gen)  # the last block: holes' target
    hole = int(order[-1])
    values_k = torch.randn(total + 1, block_size, hkv, d, generator=gen)
    values_v = torch.randn(total + 1, block_size, hkv, d, generator=gen)
    k_cache, k_held = _cache_rows(values_k, cache_dtype, gen)
    v_cache, v_held = _cache_rows(values_v, cache_dtype, gen)
    for cache in (k_cache, v_cache):
        cache.view(torch.uint8)[hole] = 0xFF  # NaN in every float32, bfloat16 and scale
    tables, start = [], 0
    for s, n in zip(seq_lens, blocks):
        table = order[start : start + n].clone()
        start += n
        if window:
            first = max(0, s - window)
            table[: first // block_size] = hole
        tables.append(torch.cat([table, torch.full((max(blocks) - n,), hole)]))
    q = torch.randn(len(seq_lens), h, d, generator=gen)
    with on_isa(isa):
        out = paged_decode_attention(q, k_cache, v_cache, torch.stack(tables), torch.tensor(seq_lens), d**-0.5, window)
        pairs = attention_in_bfloat16_pairs(cache_dtype, block_size, decode=True)
    for i, s in enumerate(seq_lens):
        first = max(0, s - window) if window else 0
        rows = [int(tables[i][p // block_size]) * block_size + p % block_size for p in range(first, s)]
        k = k_held.flatten(0, 1)[rows]
        v = v_held.flatten(0, 1)[rows]
        if cache_dtype == torch.int8:
            assert_int8_attention(out[i : i + 1], q[i : i + 1], k, v_cache.flatten(0, 1)[rows], first, d**-0.5)
            continue
        ref = _dense(q[i : i + 1], k, v, d**-0.5)
        if pairs:
            assert ((out[i : i + 1].reshape(1, -1) - ref).abs() <= bfloat16_pair_bound(q[i : i + 1], k, v, d**-0.5) + 1e-4).all()
            continue
        tol = 1e-5 if cache_dtype == torch.float32 else 1e-4
        torch.testing.assert_close(out[i : i + 1].reshape(1, -1), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
@pytest.mark.parametrize("isa", ISAS)
def test_a_request_attends_the_same_alone_and_in_a_batch(isa, cache_dtype):
    """The kernel splits its work by head when a batch has fewer (request, piece) pairs than
    threads and by pair otherwise (every head of a pair together); a request's output is the
    same bit for bit either way, alone or batched with others, short or in pieces."""
    gen = torch.Generator().manual_seed(3)
    block_size, d, h, hkv = 16, 64, 6, 3
    seq_lens = [300, 2500, 40, 1100]
    blocks = [-(-s // block_size) for s in seq_lens]
    order = torch.randperm(sum(blocks), generator=gen)
    k_cache, _ = _cache_rows(torch.randn(sum(blocks), block_size, hkv, d, generator=gen), cache_dtype, gen)
    v_cache, _ = _cache_rows(torch.randn(sum(blocks), block_size, hkv, d, generator=gen), cache_dtype, gen)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int64)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[start : start + n]
        start += n
    q = torch.randn(len(seq_lens), h, d, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with on_isa(isa):
            batched = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens), d**-0.5, 0)
            for i, s in enumerate(seq_lens):
                alone = paged_decode_attention(q[i : i + 1], k_cache, v_cache, tables[i : i + 1], torch.tensor([s]),
                                               d**-0.5, 0)
                assert torch.equal(alone, batched[i : i + 1]), f"request {i} ({s} keys)"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("window", [0, 23])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["f32", "bf16", "int8"])
@pytest.mark.parametrize("isa", ISAS)
def test_rows_past_the_prompt_attend_as_decode_steps_at_their_positions(isa, cache_dtype, window):
    """A speculative verification's rows (its last known token and drafts) and a recomputed run
    of outputs take the decode kernel one query per row, beside plain decodes and before a prompt
    chunk: each row's output is bit for bit what a decode step at its position computes over the
    same cache (the two kernels sum in other orders, so anything else could flip a greedy
    near-tie between a run with speculation and one without), whatever the context (one piece
    or several) and the window."""
    gen = torch.Generator().manual_seed(5)
    block_size, d, h, hkv = 16, 64, 6, 2
    # (keys cached before the step, rows this step): a decode, a verification of 4 drafts, a
    # long one in pieces, a recomputed run of 3 outputs; then a prompt chunk.
    reqs = [(40, 1), (299, 5), (1030, 3), (17, 3), (8, 12)]
    seq_lens = [c + n for c, n in reqs]
    blocks = [-(-s // block_size) for s in seq_lens]
    order = torch.randperm(sum(blocks), generator=gen).tolist()
    tables, start = [], 0
    for n in blocks:
        tables.append(order[start : start + n])
        start += n
    k_cache, _ = _cache_rows(torch.randn(sum(blocks), block_size, hkv, d, generator=gen), cache_dtype, gen)
    v_cache, _ = _cache_rows(torch.randn(sum(blocks), block_size, hkv, d, generator=gen), cache_dtype, gen)
    meta = AttentionMetadata.build([n for _, n in reqs], seq_lens, tables, block_size, num_decode_requests=4)
    rows = sum(n for _, n in reqs)
    assert meta.num_decodes == rows - 12 and meta.prefills[0].query_start == rows - 12
    assert meta.decode_seq_lens.tolist() == [s - n + 1 + i for (_, n), s in zip(reqs[:4], seq_lens) for i in range(n)]
    q = torch.randn(meta.num_decodes, h, d, generator=gen)
    with on_isa(isa):
        steps = paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                       d**-0.5, window)
        row = 0
        for (_, n), s, table in zip(reqs[:4], seq_lens, tables):
            for i in range(n):  # the decode step at this row's position, alone
                keys = s - n + 1 + i
                alone = paged_decode_attention(q[row : row + 1], k_cache, v_cache,
                                               torch.tensor([table[: -(-keys // block_size)]]),
                                               torch.tensor([keys]), d**-0.5, window)
                assert torch.equal(alone, steps[row : row + 1]), (keys, i)
                row += 1


@pytest.mark.parametrize("window", [0, 23])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
@pytest.mark.parametrize("isa", ISAS)
def test_a_prompt_attends_the_same_in_one_call_and_in_chunks(isa, cache_dtype, window):
    """Prefill groups consecutive 16-lane query tiles into one work item that shares each
    widened block of keys; every row's output is still its own arithmetic, bit for bit the same
    whatever tiles lie beside it: the prompt at once, or in chunks that shift its rows' lanes
    and groupings (with a window, the tiles of an item start at different blocks)."""
    gen = torch.Generator().manual_seed(4)
    block_size, d, h, hkv, n = 16, 64, 9, 3, 150
    blocks = -(-n // block_size)
    k_cache, _ = _cache_rows(torch.randn(blocks, block_size, hkv, d, generator=gen), cache_dtype, gen)
    v_cache, _ = _cache_rows(torch.randn(blocks, block_size, hkv, d, generator=gen), cache_dtype, gen)
    table = torch.randperm(blocks, generator=gen).view(1, blocks)
    q = torch.randn(n, h, d, generator=gen)

    def prefill(first: int, count: int) -> torch.Tensor:
        out = torch.empty(count, h * d)
        spans = torch.tensor([[0], [count], [first + count]], dtype=torch.int64)
        paged_prefill_attention(q[first : first + count], k_cache, v_cache, table, spans, d**-0.5, window, out)
        return out

    with on_isa(isa):
        whole = prefill(0, n)
        first = 0
        for count in (1, 7, 40, 5, 97):
            assert torch.equal(prefill(first, count), whole[first : first + count]), f"rows {first}..{first + count}"
            first += count


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("block_size", [8, 16, 64])
@pytest.mark.parametrize("h,hkv", [(4, 4), (6, 2), (14, 2)], ids=["g1", "g3", "g7"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("isa", ISAS)
def test_prefill_over_an_int8_cache_multiplies_codes_as_the_reference(isa, d, h, hkv, block_size, window):
    """Prefill over an int8 cache computes what decode does, query by query
    (``tests.utils.assert_int8_attention``: integer products of the queries' and the keys'
    codes, the softmax weights as codes per tile of 16 positions against the value codes), the
    same on every ISA: a whole prompt beside a later chunk (its queries at an offset into the
    context), blocks in random order (of 8: a tile spans two), several 16-lane tiles per KV
    head, a window that starts inside a block."""
    gen = torch.Generator().manual_seed(5)
    scale = d**-0.5
    reqs = [(0, 45), (90, 60)]  # (context already cached, new tokens)
    blocks = [-(-(c + n) // block_size) for c, n in reqs]
    order = torch.randperm(sum(blocks), generator=gen)
    k_cache, k_held = _cache_rows(torch.randn(sum(blocks), block_size, hkv, d, generator=gen), torch.int8, gen)
    v_cache, _ = _cache_rows(torch.randn(sum(blocks), block_size, hkv, d, generator=gen), torch.int8, gen)
    tables = torch.zeros(len(reqs), max(blocks), dtype=torch.int64)
    tables[0, : blocks[0]], tables[1, : blocks[1]] = order[: blocks[0]], order[blocks[0] :]
    q = torch.randn(sum(n for _, n in reqs), h, d, generator=gen)
    spans = torch.tensor([[0, reqs[0][1]], [n for _, n in reqs], [c + n for c, n in reqs]], dtype=torch.int64)
    out = torch.empty(q.shape[0], h * d)
    with on_isa(isa):
        paged_prefill_attention(q, k_cache, v_cache, tables, spans, scale, window, out)
    start = 0
    for i, (cached, new) in enumerate(reqs):
        rows = [int(tables[i][p // block_size]) * block_size + p % block_size for p in range(cached + new)]
        k, v_rows = k_held.flatten(0, 1)[rows], v_cache.flatten(0, 1)[rows]
        assert_int8_attention(out[start : start + new], q[start : start + new], k, v_rows, 0, scale, window)
        start += new


def test_bench_attention_prefill_counts_causal_pairs():
    """``bench attention --phase prefill``: each request's prompt of L tokens attends causally,
    L (L + 1) / 2 (query, key) pairs; the call runs."""
    from pagedllm.bench.attention import _case
    from pagedllm.bench.gemm import MODEL_SHAPES

    _, _, heads, _, head_dim = MODEL_SHAPES["smollm2-135m"]
    fns, flops, _ = _case("smollm2-135m", 20, 2, 16, False, ["bfloat16"], True, torch.Generator().manual_seed(0))
    assert flops == 2 * 2 * heads * head_dim * 2 * (20 * 21 // 2)
    fns["bfloat16"]()


def _amx_here() -> bool:
    from pagedllm.kernels import linear

    return library.available() and library.active_isa() == "avx512_bf16" and linear.amx_tiles()


@pytest.mark.skipif(not _amx_here(), reason="no AMX tiles here")
def test_prefill_scores_on_amx_tiles_stay_within_the_pair_bound():
    """Where AMX runs, a bfloat16 cache's prefill scores come from the tile unit (the same
    bfloat16 pairs summed in another order); with the tiles on and off, a prompt's causal
    attention lies within bfloat16_pair_bound of float32 attention over the same K/V."""
    from pagedllm.kernels import linear

    gen = torch.Generator().manual_seed(7)
    block_size, d, h, hkv, n = 16, 64, 9, 3, 100
    blocks = -(-n // block_size)
    k = torch.randn(blocks * block_size, hkv, d, generator=gen).bfloat16()
    v = torch.randn(blocks * block_size, hkv, d, generator=gen).bfloat16()
    k_cache, v_cache = (x.view(blocks, block_size, hkv, d) for x in (k, v))
    table = torch.arange(blocks).view(1, blocks)
    q = torch.randn(n, h, d, generator=gen)
    scale = d**-0.5
    kf, vf = (x[:n].float().repeat_interleave(h // hkv, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, kf) * scale
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf).reshape(n, h * d)
    bound = bfloat16_pair_bound(q, k[:n].float(), v[:n].float(), scale)
    spans = torch.tensor([[0], [n], [n]], dtype=torch.int64)
    try:
        for on in (True, False):
            linear.amx_tiles(on)
            out = torch.empty(n, h * d)
            paged_prefill_attention(q, k_cache, v_cache, table, spans, scale, 0, out)
            assert bool(((out - ref).abs() <= bound).all()), f"AMX tiles {'on' if on else 'off'}"
    finally:
        linear.amx_tiles(True)
