"""``pagedllm bench ...`` subcommands."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from pagedllm.bench import throughput
    from pagedllm.entrypoints.cli import add_engine_args

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    tp = bench_sub.add_parser("throughput", help="offline throughput through LLM.generate")
    add_engine_args(tp)
    throughput.add_args(tp)
    tp.set_defaults(func=throughput.run)
