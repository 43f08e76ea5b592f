"""``pagedllm bench throughput``: offline throughput of pagedllm, or of HF ``generate`` as the naive baseline."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

from pagedllm.bench.datasets import BenchRequest, parse_range, prefix_repetition_requests, random_requests
from pagedllm.engine.arg_utils import kv_cache_dtype, non_negative_int, output_file, positive_int


@dataclass
class BenchResult:
    backend: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list, repr=False)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def report(self) -> str:
        line = (
            f"[{self.backend}] {self.num_requests} requests in {self.elapsed_s:.2f} s: "
            f"{self.requests_per_s:.2f} req/s, {self.output_tokens_per_s:.1f} output tok/s, "
            f"{self.total_tokens_per_s:.1f} total tok/s"
        )
        if self.ttft_s:
            line += f", TTFT mean {statistics.mean(self.ttft_s):.3f} s, median {statistics.median(self.ttft_s):.3f} s"
        return line


def sampling(args: argparse.Namespace, output_len: int, index: int):
    """Request ``index``'s SamplingParams: ``output_len`` tokens (``ignore_eos``), greedy at
    temperature 0, else at ``--temperature`` / ``--top-p`` / ``--top-k`` with seed ``--seed`` +
    ``index``, so two runs draw the same tokens from the same logits.

    Raises:
        ValueError: a sampling flag out of its range.
    """
    from pagedllm import SamplingParams

    return SamplingParams(
        max_tokens=output_len, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed + index if args.temperature > 0 else None, ignore_eos=True,
    )


def run_pagedllm(requests: list[BenchRequest], llm, args: argparse.Namespace, label: str = "pagedllm") -> BenchResult:
    params = [sampling(args, r.output_len, i) for i, r in enumerate(requests)]
    prompts = [r.prompt_token_ids for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outputs]
    return BenchResult(label, len(requests), elapsed, sum(len(p) for p in prompts), out_tokens, ttft)


def collectives_report(llm, result: BenchResult) -> str | None:
    """Rank 0's time and bytes in the tensor-parallel collectives over a run; None at one rank.

    One step message per step gives the step count; bytes per token per layer
    are the all-reduce payload over (prompt + output tokens) x layers.
    """
    tp = llm.engine.core.executor.runner.tp
    if tp.size == 1:
        return None
    s, layers = tp.stats, llm.engine.core.model_config.num_layers
    steps = max(s.calls.get("step", 0), 1)
    tokens = result.prompt_tokens + result.output_tokens
    per_op = ", ".join(
        f"{op} {s.calls[op]} calls {1000 * s.seconds[op] / steps:.2f} ms/step" for op in sorted(s.calls)
    )
    return (
        f"[collectives, rank 0 of {tp.size}] {steps} steps; {per_op}; all-reduce payload "
        f"{s.bytes.get('all_reduce', 0) / tokens / layers:.0f} B per token per layer; "
        f"{100 * sum(s.seconds.values()) / result.elapsed_s:.1f}% of the run"
    )


def run_hf(args: argparse.Namespace, requests: list[BenchRequest]) -> BenchResult:
    """Transformers ``generate`` in static, left-padded batches, sorted by nothing (arrival order)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.config import parse_dtype
    from pagedllm.models.loader import resolve_model

    resolved = resolve_model(args.model)
    kwargs = {"gguf_file": resolved.gguf_file} if resolved.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(resolved.hf_dir, dtype=parse_dtype(args.dtype), **kwargs)
    model.eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    start = time.perf_counter()
    out_tokens = 0
    with torch.inference_mode():
        for i in range(0, len(requests), args.hf_batch_size):
            batch = requests[i : i + args.hf_batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for j, r in enumerate(batch):
                ids[j, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
                mask[j, width - len(r.prompt_token_ids) :] = 1
            new = max(r.output_len for r in batch)
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                do_sample=args.temperature > 0, pad_token_id=pad,
                **({"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k or None}
                   if args.temperature > 0 else {}),
            )
            out_tokens += sum(r.output_len for r in batch)  # only the tokens each request asked for
    elapsed = time.perf_counter() - start
    return BenchResult("hf", len(requests), elapsed, sum(len(r.prompt_token_ids) for r in requests), out_tokens)


def _pool_report(llm, requests: list[BenchRequest]) -> str:
    """The engine's KV pool against the workload: blocks, how many of its longest requests
    (prompt + output) it holds at once, and the preemptions the run took."""
    core = llm.engine.core
    kv = core.kv_config
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    at_once = kv.num_blocks // -(-longest // kv.block_size)
    return (f"[kv {kv.dtype}] {kv.num_blocks} blocks of {kv.block_size} tokens ({kv.bytes_per_block} bytes each): "
            f"{at_once} requests of {longest} tokens at once; {core.scheduler.num_preemptions} preemptions")


def make_requests(args: argparse.Namespace, llm) -> list[BenchRequest]:
    tokenizer = llm.get_tokenizer()
    vocab, special = llm.engine.core.model_config.vocab_size, set(tokenizer.all_special_ids)
    if args.dataset == "prefix-repetition":
        return prefix_repetition_requests(
            args.num_prompts, args.prefix_len, args.suffix_len, args.num_prefixes, args.output_len_range, vocab, special,
            args.seed,
        )
    return random_requests(args.num_prompts, args.input_len_range, args.output_len_range, vocab, special, args.seed)


def run(args: argparse.Namespace) -> None:
    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs

    sampling(args, 1, 0)  # a sampling flag out of range fails before the model loads
    if args.compare_kv_cache_dtype is not None and args.compare != "kv-cache-dtype":
        raise ValueError("--compare-kv-cache-dtype is the second run of --compare kv-cache-dtype, which is not given")
    kwargs = EngineArgs.from_cli_args(args).kwargs() | {"trace": args.trace}
    if args.compare == "prefix-caching":
        kwargs["enable_prefix_caching"] = True
    llm = LLM(**kwargs)
    requests = make_requests(args, llm)
    results, comm = [], None
    if args.backend == "pagedllm" or args.compare:
        label = ("pagedllm, prefix caching on" if args.compare == "prefix-caching"
                 else f"pagedllm, kv {llm.engine.core.kv_config.dtype}" if args.compare == "kv-cache-dtype"
                 else "pagedllm")
        results.append(run_pagedllm(requests, llm, args, label))
        comm = collectives_report(llm, results[-1])
    if args.compare == "prefix-caching":
        llm.shutdown()
        llm = LLM(**(kwargs | {"enable_prefix_caching": False}))
        results.append(run_pagedllm(requests, llm, args, "pagedllm, prefix caching off"))
    if args.compare == "kv-cache-dtype":
        print(_pool_report(llm, requests))
        llm.shutdown()
        llm = LLM(**(kwargs | {"kv_cache_dtype": args.compare_kv_cache_dtype or "int8"}))
        results.append(run_pagedllm(requests, llm, args, f"pagedllm, kv {llm.engine.core.kv_config.dtype}"))
        print(_pool_report(llm, requests))
    llm.shutdown()
    if args.backend == "hf" or args.compare == "hf":
        results.append(run_hf(args, requests))
    for r in results:
        print(r.report())
    if comm is not None:
        print(comm)
    if len(results) == 2:
        # The changed engine over the first one's for kv-cache-dtype; ours over the baseline's otherwise.
        new, old = results[::-1] if args.compare == "kv-cache-dtype" else results
        print(f"output tokens/s, {new.backend} / {old.backend}: {new.output_tokens_per_s / old.output_tokens_per_s:.2f}x")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump([asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in results], f, indent=2)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", choices=["random", "prefix-repetition"], default="random")
    parser.add_argument("--num-prompts", type=positive_int, default=256)
    parser.add_argument(
        "--prefix-len", type=non_negative_int, default=512, help="prefix-repetition: shared prefix tokens"
    )
    parser.add_argument("--suffix-len", type=non_negative_int, default=128, help="prefix-repetition: own suffix tokens")
    parser.add_argument("--num-prefixes", type=positive_int, default=10, help="prefix-repetition: distinct prefixes")
    parser.add_argument("--input-len-range", type=parse_range, default="32:512", help="LO:HI prompt tokens")
    parser.add_argument("--output-len-range", type=parse_range, default="32:256", help="LO:HI output tokens")
    parser.add_argument("--backend", choices=["pagedllm", "hf"], default="pagedllm")
    parser.add_argument(
        "--temperature", type=float, default=0.0,
        help="sampling temperature of every request (0: greedy); above 0 each request is seeded (--seed + its index)",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="top-p of every request (1: off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k of every request (0: off)")
    parser.add_argument(
        "--compare", choices=["hf", "prefix-caching", "kv-cache-dtype"], default=None,
        help="hf: also run transformers generate; prefix-caching: run with caching on, then off; kv-cache-dtype: "
        "run with --kv-cache-dtype, then --compare-kv-cache-dtype, in the same --kv-cache-memory (each pool's "
        "blocks, requests held at once and preemptions printed); print the ratio",
    )
    parser.add_argument("--compare-kv-cache-dtype", type=kv_cache_dtype, default=None,
                        help="with --compare kv-cache-dtype: the second run's KV dtype (default: int8)")
    parser.add_argument("--hf-batch-size", type=positive_int, default=16, help="static batch size of the hf backend")
    parser.add_argument("--result-json", type=output_file, default=None)
    parser.add_argument(
        "--trace", type=output_file, default=None,
        help="record the engine's steps (the live view) and write them to this file as Chrome Trace Event JSON",
    )
