"""Helpers shared by the test modules: sample prompts, the block pool checks, the sampler
tests' rows, hostile grammar inputs, random GGUF blocks and the error bounds of attention in
bfloat16 pairs and over an int8 cache. Subprocesses under test (the server, the command line):
``server_util.py``; the live view's scripted runs: ``live_view_util.py``; tiny models:
``models_util.py``.

Test modules import from here, never from one another.
"""

from __future__ import annotations

import torch

from pagedllm.kernels.attention import INT8_WEIGHT_FLOOR, int8_cache_queries
from pagedllm.layers.sampler import Sampler, SamplerOutput
from pagedllm.layers.sampling_metadata import SamplingMetadata, SamplingRow
from pagedllm.sampling_params import SamplingParams

# Short English prompts of several kinds (facts, code, story, counting, translation), for tests
# that compare the engine against a reference or against itself.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
    "Translate to French: Good morning, my friend.",
]


def _whole(pool) -> bool:
    return pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def pool_is_whole(llm) -> bool:
    """Every block of an ``LLM``'s KV cache pool is free, no reference held."""
    return _whole(llm.engine.core.kv_cache.pool)


def assert_pool_whole(owner) -> None:
    """Every block of the KV cache pool of ``owner`` (a ``Scheduler`` or an ``EngineCore``: what
    has a ``kv_cache``) is free, no reference held."""
    pool = owner.kv_cache.pool
    assert _whole(pool), f"{pool.num_blocks - pool.num_free_blocks} of {pool.num_blocks} blocks held"


# --- the sampler's rows and one sampler call (the test_sampler_* modules) -------------------

def row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: list[int] | None = None,
    seed: int | None = None,
    **params: object,
) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(seed=seed, **params),
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        eos_token_ids=eos or [],
        generator=None if seed is None else torch.Generator().manual_seed(seed),
    )


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    return Sampler()(logits, SamplingMetadata.build(rows))


# --- hostile grammar inputs: n rules, n levels, n properties -------------------------------

def lark_chain(n: int) -> str:
    """The grammar that overflowed llguidance's stack at n = 3000: a chain of n rules."""
    return "start: r0\n" + "\n".join(f'r{i}: r{i + 1} "{i}" | "z"' for i in range(n)) + f'\nr{n}: "end"'


def ref_chain(n: int) -> dict:
    """A JSON schema whose ``$ref``s chain through n definitions."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_arrays(n: int) -> dict:
    """A JSON schema of arrays nested n deep around a string."""
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


def many_properties(n: int) -> dict:
    """A JSON schema of an object with n string properties."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def assert_holds_blocks(layer, parts) -> None:
    """``layer`` runs these GGUF blocks ([(ggml type, [rows, ...] uint8)], fused order) as
    stored: a KQuantLinear holds their panels byte for byte (``kernels.kquant.panels``), a
    Q8A8Linear (a weight all of Q8_0) their packing (``kernels.linear.linear_pack_q8_0``)."""
    import gguf

    from pagedllm.kernels import kquant
    from pagedllm.kernels.linear import linear_pack_q8_0
    from pagedllm.layers.quantization.linear import KQuantLinear, Q8A8Linear

    parts = [(int(qtype), blocks.flatten(1)) for qtype, blocks in parts]
    if isinstance(layer, Q8A8Linear):
        assert [q for q, _ in parts] == [int(gguf.GGMLQuantizationType.Q8_0)]
        codes, d = linear_pack_q8_0(parts[0][1], layer.in_features)
        assert torch.equal(layer.packed, codes) and torch.equal(layer.d, d)
        return
    assert isinstance(layer, KQuantLinear)
    want = kquant.panels(kquant.StoredWeight(parts, layer.in_features))
    assert isinstance(layer.stored, kquant.PanelWeight) and want is not None
    assert [(q, rows) for q, _, rows in layer.stored.parts] == [(q, rows) for q, _, rows in want.parts]
    assert all(torch.equal(got[1], w[1]) for got, w in zip(layer.stored.parts, want.parts, strict=True))


def random_gguf_blocks(qtype, n: int, k: int, seed: int = 0, scale: float = 1.0):
    """[n, row bytes] uint8 GGUF blocks of ggml type ``qtype`` (Q8_0, Q5_0, Q4_K, Q5_K, Q6_K)
    for rows of k weights: random codes, scales and mins (every bit pattern), finite float16
    d (and a positive dmin) of a small model's magnitude times ``scale`` (the same codes for
    any ``scale`` of one seed)."""
    import gguf
    import torch

    q = gguf.GGMLQuantizationType
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // elems, size), dtype=torch.uint8, generator=gen)

    def half(scale: float) -> torch.Tensor:
        return (torch.randn(n, k // elems, 1, generator=gen) * scale).half().view(torch.uint8)

    if qtype in (q.Q4_K, q.Q5_K):
        blocks[..., 0:2] = half(1e-3 * scale)
        blocks[..., 2:4] = half(1e-3 * scale).view(torch.float16).abs().view(torch.uint8)
    elif qtype == q.Q6_K:
        blocks[..., 208:210] = half(1e-3 * scale)
    else:
        blocks[..., 0:2] = half(1e-2 * scale)
    return blocks.view(n, -1)


def bfloat16_pair_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Twice the largest error of attention in bfloat16 pairs (``kernels.attention.
    attention_in_bfloat16_pairs``) against float32 over the same K/V, per output element
    ([n, H * D]) of queries q [n, H, D] over keys and values [L, Hkv, D]: each score's q and k
    rounded to bfloat16 (relative 2^-9 each) move it by at most delta = 2^-8 scale sum_d
    |q_d k_d|, which moves the normalized weights by a factor within e^(+-2 delta); the weights
    and the values rounded (2^-9 each) move the output by at most 2^-8 max |v| more."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1).abs(), v.repeat_interleave(group, dim=1).abs()
    delta = 2**-8 * scale * torch.einsum("qhd,khd->qhk", q.abs(), kk).amax(-1, keepdim=True)  # [n, H, 1]
    vmax = vv.amax(0)[None]  # [1, H, D]
    return (2 * (torch.exp(2 * delta) - 1 + 2**-8) * vmax).reshape(q.shape[0], -1)


def assert_int8_attention(got, q, k, v_rows, first, scale, window=0):
    """``got`` [n, H * D] is attention over an int8 cache as the kernels compute it, decode and
    prefill alike: q [n, H, D] at the last n of positions first .. first + L - 1 of k [L, Hkv, D]
    (the keys' values) and v_rows [L, Hkv, D + 2] (the value rows as stored), causal, window > 0:
    a query at p sees keys p - window + 1 .. p. The kernels score each query as int8 codes
    (``int8_cache_queries``) and, per query head and tile of 16 positions (from a multiple of
    16), take the softmax weights times the value rows' scales as codes in [0, 127] against the
    value codes, times the tile's code scale, divided by the weights' sum. Every element lies
    within half a weight code per key of float32 attention on those queries (+ 1e-4), and all
    but a few (query, head) rows equal that computation to 1e-4: a code at a rounding tie goes
    either way with the last bit of the kernel's exp (a row's output moves by a code step)."""
    n, h, d = q.shape
    length = k.shape[0]
    ref, bound = torch.empty(n, h, d), torch.empty(n, h, d)
    for i in range(n):
        end = length - n + i + 1  # keys [lo, end) of k
        lo = max(0, end - window) if window else 0
        ref[i], bound[i] = _int8_one_query(q[i : i + 1], k[lo:end], v_rows[lo:end], first + lo, scale)
    values = v_rows[..., :d].float() * v_rows[..., d:].contiguous().view(torch.float16).float()
    group = h // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", int8_cache_queries(q, scale), kk) * scale
    q_pos, k_pos = torch.arange(length - n, length)[None, :, None], torch.arange(length)[None, None, :]
    masked = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else torch.zeros((), dtype=torch.bool))
    dense = torch.einsum("hqk,khd->qhd", scores.masked_fill(masked, float("-inf")).softmax(-1), vv)
    got = got.reshape(n, h, d)
    assert ((got - dense).abs() <= bound * (1 + 1e-3) + 1e-4).all()
    off = ((got - ref).abs() > 1e-4).any(-1)
    # A few: 2%, and one row at least: a decode test has 7-14 rows, and which sits on a tie
    # differs between CPU kinds (an Intel Xeon with AMX: 1 of 14 in the scalar kernels' test).
    few = max(1, int(0.02 * off.numel()))
    assert int(off.sum()) <= few, f"{int(off.sum())} of {off.numel()} (query, head) rows differ"


def _int8_one_query(q, k, v_rows, first, scale):
    """The kernels' attention of one query [1, H, D] over all of k / v_rows, at positions first
    on (``assert_int8_attention``), and the bound of its weight codes' rounding: half a code
    step per key, times |value|, over the weights' sum. Two [H, D]."""
    h, d = q.shape[1], q.shape[2]
    group = h // k.shape[1]
    codes = v_rows[..., :d].float().repeat_interleave(group, 1)  # [L, H, D]
    v_scales = v_rows[..., d:].contiguous().view(torch.float16).float()[..., 0].repeat_interleave(group, 1)  # [L, H]
    scores = torch.einsum("hd,khd->hk", int8_cache_queries(q, scale)[0], k.repeat_interleave(group, 1)) * scale
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    w = e * v_scales.T  # [H, L]
    tiles = (first + torch.arange(k.shape[0])) // 16
    out, bound = torch.zeros(h, d), torch.zeros(h, d)
    for t in tiles.unique():
        keys = tiles == t
        wt = w[:, keys]
        mx = wt.amax(-1, keepdim=True)
        live = mx > INT8_WEIGHT_FLOOR
        wc = (wt * torch.where(live, mx.new_tensor(127.0) / mx, 0.0)).round()
        out += torch.einsum("hk,khd->hd", wc, codes[keys]) * (mx / 127.0)
        bound += (mx / 254.0) * codes[keys].abs().sum(0)
    total = e.sum(-1, keepdim=True)
    return out / total, bound / total


