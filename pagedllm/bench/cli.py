"""``pagedllm bench ...`` subcommands."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from pagedllm.bench import kv_memory, perplexity, quant, roofline, serve, spec, structured, throughput
    from pagedllm.entrypoints.cli import add_engine_args

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    tp = bench_sub.add_parser("throughput", help="offline throughput through LLM.generate")
    add_engine_args(tp)
    throughput.add_args(tp)
    tp.set_defaults(func=throughput.run)

    sp = bench_sub.add_parser("spec", help="decode tokens/s with speculative decoding off vs on")
    add_engine_args(sp)
    spec.add_args(sp)
    sp.set_defaults(func=spec.run)

    so = bench_sub.add_parser(
        "structured", help="structured outputs: grammar compile time, per-step mask cost, constrained vs free tok/s"
    )
    add_engine_args(so)
    structured.add_args(so)
    so.set_defaults(func=structured.run)

    ppl = bench_sub.add_parser("perplexity", help="sliding-window perplexity of a text (prompt logprobs)")
    add_engine_args(ppl)
    perplexity.add_args(ppl)
    ppl.set_defaults(func=perplexity.run)

    qb = bench_sub.add_parser(
        "quant", help="decode tokens/s of fp32, bf16, int8 and int4 weights side by side (--modes overrides "
        "--dtype, --quantization and --quantize-lm-head)"
    )
    add_engine_args(qb)
    quant.add_args(qb)
    qb.set_defaults(func=quant.run)

    kv = bench_sub.add_parser("kv-memory", help="KV blocks held per long request, sliding-window release on vs off")
    kv_memory.add_args(kv)
    kv.set_defaults(func=kv_memory.run)

    rf = bench_sub.add_parser("roofline", help="this CPU's float32 FLOP/s, int8 OP/s and memory bandwidth, measured")
    roofline.add_args(rf)
    rf.set_defaults(func=roofline.run)

    sv = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server")
    serve.add_bench_serve_args(sv)
    sv.set_defaults(func=serve.run_bench_serve)
