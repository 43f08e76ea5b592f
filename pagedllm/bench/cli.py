"""``pagedllm bench ...`` subcommands: one row per benchmark."""

from __future__ import annotations

import argparse

# name, help, module, whether it builds an engine (takes the engine flags).
_BENCHES = (
    ("throughput", "offline throughput through LLM.generate", "throughput", True),
    ("spec", "decode tokens/s with speculative decoding off vs on", "spec", True),
    ("structured", "structured outputs: grammar compile time, per-step mask cost, constrained vs free tok/s",
     "structured", True),
    ("lora", "decode tokens/s with 0, 1, 4, 16 LoRA adapters in a batch, and one at batch 1, against the base",
     "lora", True),
    ("perplexity", "sliding-window perplexity of a text (prompt logprobs)", "perplexity", True),
    ("quant", "decode tokens/s of fp32, bf16, int8 and int4 weights side by side (--modes overrides --dtype, "
     "--quantization and --quantize-lm-head)", "quant", True),
    ("long-context", "prefill tok/s, TTFT and decode tok/s at batch 1 and 8 as the context grows, per KV dtype",
     "long_context", True),
    ("step", "where a decode step's time goes: the native call part by part, the team's hand-offs, logits, "
     "sampler and the Python around them", "step", True),
    ("kv-memory", "KV blocks held per long request, sliding-window release on vs off", "kv_memory", False),
    ("roofline", "this CPU's float32 FLOP/s, int8 OP/s and memory bandwidth, measured", "roofline", False),
    ("gemm", "a decoder layer's prefill GEMMs: float32, w8a8, w4a8, K-quants and PyTorch's float32 and int8 matmul",
     "gemm", False),
    ("attention", "the decode or prefill attention kernel alone at long contexts: ms, GFLOP/s (decode: K/V GB/s) "
     "per cache dtype", "attention", False),
    ("serve", "load-test an OpenAI-compatible server", "serve", False),
    ("detokenize", "the incremental detokenizer, microseconds per token", "detokenize", False),
)


def add_bench_commands(bench: argparse.ArgumentParser, only: str | None = None) -> None:
    """The subcommands of ``bench``; each module has ``add_args(parser)`` and ``run(args)``.
    Every one gets its flags, or with ``only`` only that one: the others are not imported."""
    import importlib

    from pagedllm.engine.arg_utils import EngineArgs

    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, help_text, module_name, engine in _BENCHES:
        parser = bench_sub.add_parser(name, help=help_text, description=help_text, usage="%(prog)s [options]")
        if only is not None and name != only:
            continue
        module = importlib.import_module(f"pagedllm.bench.{module_name}")
        if engine:
            EngineArgs.add_cli_args(parser)
        module.add_args(parser)
        parser.set_defaults(func=module.run, command_parser=parser)
