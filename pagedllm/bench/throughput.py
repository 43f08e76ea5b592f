"""``pagedllm bench throughput``: offline throughput of pagedllm, or of HF ``generate`` as the naive baseline."""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class BenchResult:
    backend: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int

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
        return (
            f"[{self.backend}] {self.num_requests} requests in {self.elapsed_s:.2f} s: "
            f"{self.requests_per_s:.2f} req/s, {self.output_tokens_per_s:.1f} output tok/s, "
            f"{self.total_tokens_per_s:.1f} total tok/s"
        )


def parse_range(text: str) -> tuple[int, int]:
    """"32:512" -> (32, 512); "128" -> (128, 128)."""
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 0 < lo_i <= hi_i:
        raise ValueError(f"range must be LO:HI with 0 < LO <= HI, got {text!r}")
    return lo_i, hi_i


def random_requests(
    num: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int, special_ids: set[int], seed: int
) -> list[BenchRequest]:
    """Prompts of random non-special token ids, lengths uniform in the given ranges."""
    rng = random.Random(seed)
    ids = [t for t in range(vocab_size) if t not in special_ids]
    return [
        BenchRequest([rng.choice(ids) for _ in range(rng.randint(*input_range))], rng.randint(*output_range))
        for _ in range(num)
    ]


def run_pagedllm(args: argparse.Namespace, requests: list[BenchRequest], llm) -> BenchResult:
    from pagedllm import SamplingParams

    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in requests]
    prompts = [r.prompt_token_ids for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return BenchResult("pagedllm", len(requests), elapsed, sum(len(p) for p in prompts), out_tokens)


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
                do_sample=False, pad_token_id=pad,
            )
            out_tokens += sum(r.output_len for r in batch)  # only the tokens each request asked for
    elapsed = time.perf_counter() - start
    return BenchResult("hf", len(requests), elapsed, sum(len(r.prompt_token_ids) for r in requests), out_tokens)


def run(args: argparse.Namespace) -> None:
    from pagedllm import LLM
    from pagedllm.entrypoints.cli import engine_kwargs

    llm = LLM(**engine_kwargs(args))
    tokenizer = llm.get_tokenizer()
    requests = random_requests(
        args.num_prompts,
        parse_range(args.input_len_range),
        parse_range(args.output_len_range),
        llm.engine.core.model_config.vocab_size,
        set(tokenizer.all_special_ids),
        args.seed,
    )
    results = []
    if args.backend == "pagedllm" or args.compare:
        results.append(run_pagedllm(args, requests, llm))
    if args.backend == "hf" or args.compare == "hf":
        results.append(run_hf(args, requests))
    for r in results:
        print(r.report())
    if len(results) == 2:
        print(f"pagedllm / hf output tokens/s: {results[0].output_tokens_per_s / results[1].output_tokens_per_s:.2f}x")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump([asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in results], f, indent=2)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len-range", default="32:512", help="LO:HI prompt tokens")
    parser.add_argument("--output-len-range", default="32:256", help="LO:HI output tokens")
    parser.add_argument("--backend", choices=["pagedllm", "hf"], default="pagedllm")
    parser.add_argument("--compare", choices=["hf"], default=None, help="also run this backend and print the ratio")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the hf backend")
    parser.add_argument("--result-json", default=None)
