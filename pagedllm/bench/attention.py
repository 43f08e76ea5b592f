"""``pagedllm bench attention``: the attention kernels alone at long contexts.

For each model shape (``--shapes``: query heads, K/V heads and head size of a real model),
context length (``--context-lens``), batch size (``--batch-sizes``) and K/V cache dtype
(``--kv-cache-dtypes``), one call of the kernel of ``--phase``:
- ``decode``: ``kernels.attention.paged_decode_attention``, every request's one query
  attending to that many keys;
- ``prefill``: ``kernels.attention.paged_prefill_attention``, every request prefilling a
  prompt of that many tokens (each query attends causally to the keys up to its own).
Each request's keys lie in blocks placed at random in the pool (as a long-running server's
pool ends up; ``--block-order sequential``: consecutive, as a fresh pool hands them out), the
cache holding random rows (the speed does not depend on the values). Printed per call:
milliseconds, the multiply-adds of q.K and p.V (2 x heads x head size per query and key it
sees) as GFLOP/s, and for decode the K/V bytes read per millisecond (GB/s). Time is the
process's CPU time at one thread (the time it actually ran: robust to other processes on
shared cores) and wall-clock time at more (where CPU time would count the team's waits), the
best of ``--repeats``, the dtypes interleaved in every repeat so that a busy moment hits them
alike. Threads: ``--threads`` (default 1); blocks of ``--block-size`` tokens (default: the
engine's).
"""

from __future__ import annotations

import argparse
import time

from pagedllm.bench.gemm import MODEL_SHAPES
from pagedllm.engine.arg_utils import kv_block_size, positive_int, positive_int_list, thread_count

_DTYPES = ("bfloat16", "int8", "fp8", "float32")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                        help="decode: one query per request; prefill: a whole prompt per request, causal")
    parser.add_argument("--shapes", default="smollm2-135m,qwen2.5-0.5b", help=f"comma list of {', '.join(MODEL_SHAPES)}")
    parser.add_argument("--context-lens", type=positive_int_list, default="4096,16384",
                        help="comma list of keys per request")
    parser.add_argument("--batch-sizes", type=positive_int_list, default="1,8", help="comma list of requests per call")
    parser.add_argument("--kv-cache-dtypes", default="bfloat16,int8", help=f"comma list of {', '.join(_DTYPES)}")
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--threads", type=thread_count, default=1)
    parser.add_argument(
        "--block-size", type=kv_block_size, default=None, help="tokens per KV block (default: the engine's)"
    )
    parser.add_argument("--block-order", choices=("random", "sequential"), default="random",
                        help="where a request's blocks lie in the pool: random (a long-running server's) or consecutive")


def _case(
    model: str, context: int, batch: int, block_size: int, sequential: bool, dtypes: list[str], prefill: bool, gen
) -> tuple[dict, int, dict[str, int]]:
    """(dtype -> fn() running one attention call, multiply-adds x 2 per call, dtype -> K/V
    bytes read per call by decode) for ``batch`` requests of ``context`` keys in ``model``'s
    shape; ``prefill``: each request's ``context`` queries attend causally."""
    import torch

    from pagedllm.core.kv_cache_config import kv_row_width
    from pagedllm.kernels.attention import paged_decode_attention, paged_prefill_attention

    _, _, heads, kv_heads, head_dim = MODEL_SHAPES[model]
    blocks_per_request = -(-context // block_size)
    num_blocks = batch * blocks_per_request
    order = torch.arange(num_blocks) if sequential else torch.randperm(num_blocks, generator=gen)
    tables = order.view(batch, blocks_per_request)
    seq_lens = torch.full((batch,), context, dtype=torch.int64)
    queries = batch * context if prefill else batch
    q = torch.randn(queries, heads, head_dim, generator=gen)
    spans = torch.stack([torch.arange(batch) * context, seq_lens, seq_lens]).contiguous()
    out = torch.empty(queries, heads * head_dim)
    fns, bytes_read = {}, {}
    for name in dtypes:
        dtype = torch.float8_e4m3fn if name == "fp8" else getattr(torch, name)
        row = kv_row_width(head_dim, dtype)
        shape = (num_blocks, block_size, kv_heads, row)
        if dtype in (torch.int8, torch.float8_e4m3fn):  # codes, then a positive float16 scale per row
            caches = [torch.randint(-100, 100, shape, dtype=torch.int8, generator=gen) for _ in range(2)]
            for c in caches:
                c[..., head_dim:].view(torch.float16).copy_(torch.rand(*shape[:3], 1, generator=gen) * 0.01 + 0.001)
            caches = [c.view(dtype) for c in caches]
        else:
            caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]
        if prefill:
            fns[name] = lambda k=caches[0], v=caches[1]: paged_prefill_attention(
                q, k, v, tables, spans, head_dim**-0.5, 0, out
            )
        else:
            fns[name] = lambda k=caches[0], v=caches[1]: paged_decode_attention(
                q, k, v, tables, seq_lens, head_dim**-0.5
            )
        bytes_read[name] = 2 * batch * context * kv_heads * row * caches[0].element_size()
    pairs = batch * context * (context + 1) // 2 if prefill else batch * context  # (query, key) pairs
    return fns, 2 * 2 * heads * head_dim * pairs, bytes_read


def run(args: argparse.Namespace) -> None:
    import os

    import torch

    from pagedllm.config import EngineConfig
    from pagedllm.kernels.library import active_isa

    torch.set_num_threads(args.threads)
    block_size = args.block_size or EngineConfig.block_size
    clock = time.process_time if args.threads == 1 else time.perf_counter
    dtypes = [s.strip() for s in args.kv_cache_dtypes.split(",") if s.strip()]
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [d for d in dtypes if d not in _DTYPES] + [s for s in shapes if s not in MODEL_SHAPES]
    if unknown:
        raise ValueError(f"unknown dtypes or shapes {unknown}; dtypes: {', '.join(_DTYPES)}; shapes: {', '.join(MODEL_SHAPES)}")
    prefill = args.phase == "prefill"
    print(f"{args.phase} attention; CPU ISA in use: {active_isa() or 'none'}; {args.threads} thread(s); "
          f"blocks of {block_size} tokens ({args.block_order}); "
          f"{'process CPU' if args.threads == 1 else 'wall-clock'} time, best of {args.repeats}")
    print(f"per dtype: ms per call,{'' if prefill else ' K/V GB/s read,'} GFLOP/s of q.K and p.V")
    gen = torch.Generator().manual_seed(0)
    for model in shapes:
        for context in args.context_lens:
            for batch in args.batch_sizes:
                sequential = args.block_order == "sequential"
                fns, flops, bytes_read = _case(model, context, batch, block_size, sequential, dtypes, prefill, gen)
                best = dict.fromkeys(fns, float("inf"))
                for round_ in range(args.repeats + 1):  # round 0 warms up
                    for name, fn in fns.items():
                        start = clock()
                        fn()
                        if round_:
                            best[name] = min(best[name], clock() - start)
                cells = [
                    f"{name} {t * 1e3:8.3f} ms{'' if prefill else f' {bytes_read[name] / t / 1e9:5.1f} GB/s'} "
                    f"{flops / t / 1e9:5.1f} GFLOP/s"
                    for name, t in best.items()
                ]
                print(f"{model:13s} ctx {context:6d} batch {batch:3d}  " + "  |  ".join(cells), flush=True)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
