"""``pagedllm bench serve``: load-test any OpenAI-compatible server (pagedllm, vLLM, llama.cpp).

Every request streams ``/v1/completions`` with ``ignore_eos`` (so each produces its planned
output length, where the server honours it); each chunk is timestamped on arrival. Prompts go
as token ids (exact lengths on any server of the same model) or, for servers that take only
strings, as their decoded text. Reports TTFT, TPOT, ITL and end-to-end latency (mean,
median, p99), request throughput and output / total token throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.parse
from dataclasses import dataclass, field

import httpx
import numpy as np
from tqdm import tqdm

from pagedllm.bench.datasets import BenchRequest, parse_range, prefix_repetition_requests, random_requests
from pagedllm.config import DEFAULT_MODEL
from pagedllm.engine.arg_utils import non_negative_int, output_file, positive_float, positive_int


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between chunks that carried tokens


def _base_url(text: str) -> str:
    """argparse type: an http:// or https:// URL with a host (checked before any request is built)."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL with a host, got {text!r}")
    return text


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", type=_base_url, required=True, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name the server serves")
    parser.add_argument("--tokenizer", default=None, help="model whose tokenizer builds prompts (default: --model)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--dataset", choices=["random", "prefix-repetition"], default="random")
    parser.add_argument("--prompt-format", choices=["token-ids", "text"], default="token-ids",
                        help="send prompts as token ids (exact lengths) or decoded text")
    parser.add_argument("--num-prompts", type=positive_int, default=200)
    parser.add_argument("--input-len-range", type=parse_range, default="128:512", help="LO:HI prompt tokens (random)")
    parser.add_argument("--output-len-range", type=parse_range, default="32:128", help="LO:HI output tokens")
    parser.add_argument(
        "--prefix-len", type=non_negative_int, default=256, help="shared prefix tokens (prefix-repetition)"
    )
    parser.add_argument(
        "--suffix-len", type=non_negative_int, default=64, help="per-request suffix tokens (prefix-repetition)"
    )
    parser.add_argument("--num-prefixes", type=positive_int, default=4, help="distinct prefixes (prefix-repetition)")
    parser.add_argument("--request-rate", type=positive_float, default=float("inf"),
                        help="requests/s arriving (default: all at once)")
    parser.add_argument("--max-concurrency", type=positive_int, default=None,
                        help="most requests in flight; arrivals beyond wait (with --request-rate too, as vLLM's)")
    parser.add_argument("--burstiness", type=positive_float, default=1.0,
                        help="gamma shape of inter-arrival times: 1 = Poisson, <1 burstier, >1 steadier")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--result-json", type=output_file, default=None, help="write the metrics here")


def run(args: argparse.Namespace) -> None:
    """Build the requests, run them against the server, print (and maybe save) the metrics;
    exit with status 1 when no request succeeded (no server there, a wrong model name or key),
    as a report of zeros is no measurement."""
    from pagedllm.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(args.tokenizer or args.model))
    special, vocab = set(tokenizer.all_special_ids), len(tokenizer)
    if args.dataset == "random":
        requests = random_requests(args.num_prompts, args.input_len_range, args.output_len_range, vocab,
                                   special, args.seed)
    else:
        requests = prefix_repetition_requests(args.num_prompts, args.prefix_len, args.suffix_len, args.num_prefixes,
                                              args.output_len_range, vocab, special, args.seed)
    prompts = [r.prompt_token_ids if args.prompt_format == "token-ids" else tokenizer.decode(r.prompt_token_ids)
               for r in requests]
    results, duration = asyncio.run(_benchmark(args, requests, prompts))
    metrics = summarize(results, duration)
    print(format_report(metrics, args))
    if args.result_json:
        config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
        with open(args.result_json, "w") as f:
            json.dump({"config": config, "metrics": metrics}, f, indent=2, default=str)
    if not metrics["completed"]:
        sys.exit(f"error: none of the {metrics['failed']} requests succeeded (their errors are above)")


async def _benchmark(
    args: argparse.Namespace, requests: list[BenchRequest], prompts: list[list[int] | str]
) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or len(requests)
    semaphore = asyncio.Semaphore(limit)
    bar = tqdm(total=len(requests), desc="requests", dynamic_ncols=True)
    url = args.base_url.rstrip("/") + "/v1/completions"
    async with httpx.AsyncClient(headers=headers, timeout=None,
                                 limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit)) as client:

        async def one(request: BenchRequest, prompt: list[int] | str) -> RequestResult:
            async with semaphore:
                result = await send_request(client, url, args.model, prompt, request)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(requests), args.request_rate, args.burstiness, args.seed):
            tasks.append(asyncio.create_task(one(requests[i], prompts[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return results, duration


async def _arrivals(num: int, rate: float, burstiness: float, seed: int):
    """Yield 0..num-1 at ``rate`` per second, gamma-distributed gaps (mean 1/rate, shape ``burstiness``)."""
    rng = np.random.default_rng(seed)
    for i in range(num):
        yield i
        if rate != float("inf"):
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


async def send_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int] | str, request: BenchRequest
) -> RequestResult:
    """Stream one completion; timestamp every chunk that carries text."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(prompt_tokens=len(request.prompt_token_ids))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                now = time.perf_counter()
                if data.get("choices") and data["choices"][0].get("text"):
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks += 1
                    last = now
                if data.get("usage"):
                    result.prompt_tokens = data["usage"]["prompt_tokens"]
                    result.output_tokens = data["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = last - start
    result.output_tokens = result.output_tokens or chunks  # servers without usage: one token per chunk
    result.success = chunks > 0
    if not result.success:
        result.error = "no tokens received"
    return result


def _stats(values: list[float], name: str) -> dict[str, float]:
    ms = np.asarray(values or [0.0]) * 1000
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict[str, float]:
    """The benchmark's figures from per-request results (latencies over successful requests)."""
    ok = [r for r in results if r.success]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        **_stats([r.ttft for r in ok], "ttft"),
        **_stats(tpot, "tpot"),
        **_stats([gap for r in ok for gap in r.itl], "itl"),
        **_stats([r.e2e for r in ok], "e2e"),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def _load(args: argparse.Namespace) -> str:
    """The arrival rate, the concurrency cap, or both (an unlimited rate is left out beside a cap)."""
    rate, cap = f"{args.request_rate} req/s", f"max concurrency {args.max_concurrency}"
    if not args.max_concurrency:
        return rate
    return cap if args.request_rate == float("inf") else f"{rate}, {cap}"


def format_report(m: dict, args: argparse.Namespace) -> str:
    rows = [
        ("Base URL", args.base_url),
        ("Dataset", args.dataset),
        ("Load", _load(args)),
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Benchmark duration (s)", f"{m['duration_s']:.2f}"),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total generated tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{m['total_token_throughput']:.2f}"),
    ]
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E latency")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {title} (ms)", f"{m[f'{stat}_{name}_ms']:.2f}"))
    lines = ["=" * 20 + " Serving Benchmark Result " + "=" * 20]
    lines += [f"{k:<40}{v:>26}" for k, v in rows]
    lines += [f"error: {e}" for e in m["errors"]]
    return "\n".join(lines)
