"""``pagedllm bench structured``: what structured outputs cost.

Three figures: grammar compilation of a typical schema (front-end check, core compile, and a
cache hit); the per-step cost of filling and applying the grammar masks at batch 1 and 32
(matchers walked through real JSON states, random logits); and output tokens/s of
``--num-prompts`` concurrent requests with a JSON schema vs the same requests unconstrained.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.engine.arg_utils import positive_int

# A typical response schema: an array of small records (strings, bounded integers, enums).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 20},
        "role": {"enum": ["engineer", "designer", "manager"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "role", "active"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": PERSON, "minItems": 8, "maxItems": 8}


def _ms(seconds: list[float]) -> str:
    return f"median {statistics.median(seconds) * 1e3:.3f} ms (min {min(seconds) * 1e3:.3f})"


def bench_compile(tokenizer, vocab_size: int, eos: list[int], repeats: int) -> None:
    from pagedllm.structured_output import StructuredOutputsParams, backend
    from pagedllm.structured_output.grammar import compile_check
    from pagedllm.structured_output.manager import StructuredOutputManager

    start = time.perf_counter()
    compiler = backend.Compiler(tokenizer, vocab_size, eos)
    print(f"llguidance tokenizer (once per engine): {(time.perf_counter() - start) * 1e3:.0f} ms")
    checks, in_process, compiles = [], [], []
    for i in range(repeats):
        # A distinct schema each time, so neither the front end's cache nor the core's hits.
        params = StructuredOutputsParams(json=SCHEMA | {"description": f"bench {i}"})
        start = time.perf_counter()
        grammar = backend.check(params)
        checks.append(time.perf_counter() - start)
        start = time.perf_counter()
        compile_check(*StructuredOutputsParams(json=SCHEMA | {"description": f"in process {i}"}).key)
        in_process.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.compile(grammar)
        compiles.append(time.perf_counter() - start)
    print(f"front-end check of the schema (limits, then a grammar worker process): {_ms(checks)}")
    print(f"the worker's compile check run in this process instead: {_ms(in_process)}")
    print(f"engine-core compile (matcher built): {_ms(compiles)}")
    manager = StructuredOutputManager(lambda: tokenizer, vocab_size, eos)
    params = StructuredOutputsParams(json=SCHEMA)
    manager.request_state(params).compiled.result()
    hits = []
    for _ in range(repeats):
        start = time.perf_counter()
        state = manager.request_state(params)
        assert state.is_ready
        hits.append(time.perf_counter() - start)
    print(f"cache hit (same schema again, matcher copied): {_ms(hits)}")


def bench_masks(tokenizer, vocab_size: int, eos: list[int], batch_sizes: list[int], steps: int) -> None:
    from pagedllm.structured_output import StructuredOutputsParams
    from pagedllm.structured_output.bitmask import apply_bitmask, fill_bitmask
    from pagedllm.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(lambda: tokenizer, vocab_size, eos)
    params = StructuredOutputsParams(json=SCHEMA)
    generator = torch.Generator().manual_seed(0)
    for batch in batch_sizes:
        states = [manager.request_state(params) for _ in range(batch)]
        for s in states:
            s.compiled.result()
            assert s.is_ready
        fills, applies = [], []
        for _ in range(steps):
            logits = torch.randn(batch, vocab_size, generator=generator)
            start = time.perf_counter()
            bitmask = fill_bitmask(states, vocab_size)
            fills.append(time.perf_counter() - start)
            start = time.perf_counter()
            apply_bitmask(logits, bitmask, list(range(batch)))
            applies.append(time.perf_counter() - start)
            for s, token in zip(states, logits.argmax(dim=-1).tolist()):  # walk on through the grammar
                if not s.is_terminated:
                    s.accept(token)
        total = [f + a for f, a in zip(fills, applies)]
        print(f"batch {batch:3d}: mask per step {_ms(total)}; fill {_ms(fills)}, apply {_ms(applies)}")


def bench_throughput(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams, StructuredOutputsParams
    from pagedllm.engine.arg_utils import EngineArgs

    llm = LLM(**EngineArgs.from_cli_args(args).kwargs())
    prompts = [
        [{"role": "user", "content": f"List eight people of team {i} as JSON, with name, age, city, role, active."}]
        for i in range(args.num_prompts)
    ]
    structured = StructuredOutputsParams(json=SCHEMA)
    runs = [
        ("unconstrained", SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)),
        ("json schema", SamplingParams(temperature=0.0, max_tokens=args.output_len, structured_outputs=structured)),
    ]
    for _, params in runs:  # warm-up: kernels, the grammar tokenizer and the first compile
        llm.chat(prompts[:1], params, use_tqdm=False)
    rates: dict[str, list[float]] = {label: [] for label, _ in runs}
    for _ in range(args.rounds):  # interleaved, so a busy spell on shared cores hits both alike
        for label, params in runs:
            llm.engine.core.reset_prefix_cache()  # same prompts: neither run may reuse the other's prefill
            start = time.perf_counter()
            outputs = llm.chat(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[label].append(tokens / elapsed)
            print(f"[{label}] {len(prompts)} requests, {tokens} output tokens in {elapsed:.2f} s: "
                  f"{rates[label][-1]:.1f} tok/s")
    best = {label: max(r) for label, r in rates.items()}
    print(f"best of {args.rounds}: constrained / unconstrained output tok/s: "
          f"{best['json schema']:.1f} / {best['unconstrained']:.1f} = {best['json schema'] / best['unconstrained']:.2f}")


def run(args: argparse.Namespace) -> None:
    from pagedllm.models.loader import load_config, load_tokenizer, resolve_model

    resolved = resolve_model(args.model)
    tokenizer = load_tokenizer(resolved)
    config = load_config(resolved)
    bench_compile(tokenizer, config.vocab_size, config.eos_token_ids, args.repeats)
    bench_masks(tokenizer, config.vocab_size, config.eos_token_ids, [1, args.num_prompts], args.steps)
    if not args.skip_throughput:
        bench_throughput(args)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=positive_int, default=32, help="concurrent requests (and the large mask batch)")
    parser.add_argument("--output-len", type=positive_int, default=96, help="max_tokens of every request")
    parser.add_argument("--repeats", type=positive_int, default=20, help="compilations timed")
    parser.add_argument("--steps", type=positive_int, default=60, help="mask steps timed per batch size")
    parser.add_argument("--rounds", type=positive_int, default=2, help="throughput runs of each kind, interleaved; best kept")
    parser.add_argument("--skip-throughput", action="store_true", help="only the compile and mask figures")
