"""``pagedllm bench long-context``: prefill, time to first token and decode speed as context grows.

For each KV cache dtype (``--kv-cache-dtypes``, default the engine's ``--kv-cache-dtype``)
one engine is built with ``max_model_len`` = the longest context + ``--output-len`` (or the
``--max-model-len`` given), and at each context length L of ``--context-lens`` that fits it (a
longer one, past the model's context or that flag, is reported as skipped):
- prefill: one prompt of L random token ids and ``max_tokens=N`` (``--output-len``); TTFT is
  the request's first-token time minus its arrival time, and prefill tokens/s is L / TTFT;
- decode at batch 1: the same run's (N - 1) tokens over its last-token time minus its
  first-token time (one long prefill per context, not three);
- decode at each other batch size b of ``--batch-sizes``: b prompts of L tokens each, prefilled
  once (``max_tokens=1``), which leaves their blocks in the prefix cache; then timed with
  ``max_tokens=1`` (T1) and ``max_tokens=N`` (TN), both finding the prompts cached, so the b
  requests decode together with L tokens of context each: decode tokens/s is b (N - 1) /
  (TN - T1). (Without the cache, chunked prefill has each request decode beside the next
  one's prompt chunks, never b at once, and the difference of two runs of b x L prompt tokens
  is mostly their noise.) The single prompts above are random and never hit the cache.
A (L, b) whose K/V does not fit the pool (``--kv-cache-memory``) is reported as skipped, not
run (it would preempt and measure recomputation instead). Medians over ``--repeats``, after one
short warm-up request.

With a GGUF model and ``llama_cpp`` (llama-cpp-python) importable, llama.cpp runs the same file
and prompts after the engines (unless ``--no-llama-cpp``): K/V cache ``q8_0``, flash attention
on, as many threads as torch uses, batch 1 only (one sequence); its TTFT is the time from the
call to the first token, its decode tokens/s (N - 1) over the time from the first token to the
N-th.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from pagedllm.engine.arg_utils import positive_int, positive_int_list


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context-lens", type=positive_int_list, default="1024,4096,8192,16384",
                        help="comma-separated prompt lengths, tokens; those past the model's context (or "
                             "--max-model-len) with --output-len are skipped")
    parser.add_argument("--batch-sizes", type=positive_int_list, default="1,8",
                        help="comma-separated decode batch sizes")
    parser.add_argument("--output-len", type=positive_int, default=32, help="tokens decoded per request in the decode runs")
    parser.add_argument(
        "--kv-cache-dtypes", default=None,
        help="comma-separated KV cache dtypes to compare (default: the --kv-cache-dtype flag's value)",
    )
    parser.add_argument("--repeats", type=positive_int, default=1)
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp reference (GGUF models)")


@dataclass
class LongContextRow:
    kv_dtype: str
    context: int
    prefill_tok_s: float
    ttft_s: float
    decode_tok_s: dict[int, float | None]  # batch size -> tokens/s, None where the pool cannot hold it; absent: not run

    def report(self) -> str:
        decode = ", ".join(
            f"b={b}: {'skipped (pool too small)' if r is None else f'{r:.1f} tok/s'}" for b, r in self.decode_tok_s.items()
        )
        return (
            f"[kv {self.kv_dtype}] context {self.context:6d}: prefill {self.prefill_tok_s:8.1f} tok/s, "
            f"TTFT {self.ttft_s:7.3f} s; decode {decode}"
        )


# ggml_type of llama.cpp's 8-bit blocks (32 int8 codes and a float16 scale), its type_k/type_v.
GGML_TYPE_Q8_0 = 8


def bench_llama_cpp(path: str, contexts: list[int], args: argparse.Namespace, prompts) -> list[LongContextRow]:
    """llama.cpp on the GGUF at ``path``: per context L, one prompt of L tokens (``prompts(L)``)
    decoded for ``--output-len`` tokens at batch 1, q8_0 K/V and flash attention."""
    import torch
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=max(contexts) + args.output_len + 8, n_threads=torch.get_num_threads(),
                type_k=GGML_TYPE_Q8_0, type_v=GGML_TYPE_Q8_0, flash_attn=True, verbose=False)
    llm.generate([1, 2, 3], temp=0.0, reset=True).__next__()  # warm
    rows = []
    for context in contexts:
        ttfts, rates = [], []
        for i in range(args.repeats):
            n, start = 0, time.perf_counter()
            for _token in llm.generate(prompts(context, i), temp=0.0, reset=True):
                n += 1
                if n == 1:
                    first = time.perf_counter()
                if n == args.output_len:
                    break
            ttfts.append(first - start)
            rates.append((n - 1) / max(time.perf_counter() - first, 1e-9))
        ttft = statistics.median(ttfts)
        rows.append(LongContextRow("llama.cpp q8_0", context, context / ttft, ttft, {1: statistics.median(rates)}))
        print(rows[-1].report(), flush=True)
    return rows


def _prompts(llm, count: int, length: int, seed: int) -> list[list[int]]:
    from pagedllm.bench.datasets import random_requests

    tokenizer = llm.get_tokenizer()
    vocab, special = llm.engine.core.model_config.vocab_size, set(tokenizer.all_special_ids)
    return [r.prompt_token_ids for r in random_requests(count, (length, length), (1, 1), vocab, special, seed)]


def _seconds(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def _measure(llm, kv_dtype: str, context: int, args: argparse.Namespace) -> LongContextRow:
    kv = llm.engine.core.kv_config
    capacity = kv.num_blocks * kv.block_size
    ttfts, single = [], []
    for i in range(args.repeats):
        _, outputs = _seconds(llm, _prompts(llm, 1, context, args.seed + i), args.output_len)
        times = outputs[0].metrics
        ttfts.append(times["first_token_time"] - times["arrival_time"])
        single.append((args.output_len - 1) / max(times["last_token_time"] - times["first_token_time"], 1e-9))
    ttft = statistics.median(ttfts)
    decode: dict[int, float | None] = {}
    for b in args.batch_sizes:
        if b * (context + args.output_len + kv.block_size) > capacity:
            decode[b] = None
            continue
        if b == 1:
            decode[b] = statistics.median(single)
            continue
        rates = []
        for i in range(args.repeats):
            prompts = _prompts(llm, b, context, args.seed + 1000 * b + i)
            _seconds(llm, prompts, 1)  # the prompts' blocks into the prefix cache
            t1, _ = _seconds(llm, prompts, 1)
            tn, outputs = _seconds(llm, prompts, args.output_len)
            if min(o.num_cached_tokens for o in outputs) < context - kv.block_size:
                raise RuntimeError(f"batch {b} at {context} tokens: the prompts left the prefix cache; raise --kv-cache-memory")
            rates.append(b * (args.output_len - 1) / max(tn - t1, 1e-9))
        decode[b] = statistics.median(rates)
    return LongContextRow(kv_dtype, context, context / ttft, ttft, decode)


def run(args: argparse.Namespace) -> None:
    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.models.loader import load_config, resolve_model

    resolved = resolve_model(args.model)
    limit = args.max_model_len or load_config(resolved).max_position_embeddings
    what = "--max-model-len" if args.max_model_len else "the model's context"
    contexts = [c for c in args.context_lens if c + args.output_len <= limit]
    for context in args.context_lens:
        if context not in contexts:
            print(f"context {context} skipped: with --output-len {args.output_len} it is past {what} ({limit} tokens)")
    if not contexts:
        raise ValueError(f"--context-lens: every length with --output-len {args.output_len} is past {what} "
                         f"({limit} tokens)")
    base = EngineArgs.from_cli_args(args).kwargs()
    dtypes = args.kv_cache_dtypes.split(",") if args.kv_cache_dtypes else [base.get("kv_cache_dtype", "auto")]
    prefill_prompts: dict[tuple[int, int], list[int]] = {}  # (context, repeat) -> the prefill runs' prompt
    for kv_dtype in dtypes:
        kwargs = base | {
            "kv_cache_dtype": kv_dtype,
            "max_model_len": args.max_model_len or max(contexts) + args.output_len,
            "enable_prefix_caching": True,  # the batch-b decode runs find their prompts cached
        }
        llm = LLM(**kwargs)
        kv = llm.engine.core.kv_config
        print(
            f"[kv {kv_dtype}] {kv.num_blocks} blocks of {kv.block_size} tokens "
            f"({kv.num_blocks * kv.block_size} token slots, {kv.bytes_per_block} bytes per block)"
        )
        try:
            _seconds(llm, _prompts(llm, 1, 64, args.seed), 2)  # warm: threads, packing, first allocations
            for context in contexts:
                print(_measure(llm, kv_dtype, context, args).report(), flush=True)
            for context in contexts:
                for i in range(args.repeats):
                    prefill_prompts[context, i] = _prompts(llm, 1, context, args.seed + i)[0]
        finally:
            llm.shutdown()
    if args.no_llama_cpp or resolved.kind != "gguf":
        return
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama.cpp reference skipped: llama_cpp (llama-cpp-python) is not importable")
        return
    bench_llama_cpp(str(resolved.path), contexts, args, lambda context, i: prefill_prompts[context, i])
