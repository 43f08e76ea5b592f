"""``pagedllm bench quant``: decode speed of float32, bfloat16, int8 and int4 weights side by side.

Per mode: batch-1 and batch-N decode tokens/s, by wall clock and per second of the process's
CPU time, the weight bytes one decode step reads (per token: divided by the batch) and the
memory bandwidth that implies, and batch-N end-to-end output tokens/s. With ``llama_cpp``
importable and a GGUF model, llama.cpp's batch-1 decode of the same file is measured too, as
the reference. Medians over ``--repeats`` runs; the random prompts are the same for every mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pagedllm.engine.arg_utils import output_file, positive_int

if TYPE_CHECKING:  # torch is imported where used: building the CLI parser stays light
    from torch import nn

# Mode name -> (dtype, quantization, quantize_lm_head; None: as the dtype decides).
MODES: dict[str, tuple[str, str | None, bool | None]] = {
    "auto": ("auto", None, None),  # the default: float32 around w4a8 / w8a8 layers (lm_head too), bf16 K/V
    "fp32": ("float32", "none", False),
    "bf16": ("bfloat16", "none", False),
    "int8": ("bfloat16", "int8", False),
    "int4": ("bfloat16", "int4", False),
    "int8+lm_head": ("bfloat16", "int8", True),
    "int4+lm_head": ("bfloat16", "int4", True),
    "w8a8": ("float32", "w8a8", False),
    "w8a8+lm_head": ("float32", "w8a8", True),
    "w4a8": ("float32", "w4a8", False),
    "w4a8+lm_head": ("float32", "w4a8", True),  # the lm_head as w8a8
}


@dataclass
class Rate:
    """A decode rate by both clocks: wall time, and the process's CPU time (at one thread, the
    time it actually ran: robust to other processes on shared cores)."""

    wall: float  # tokens/s
    cpu: float  # tokens per CPU-second

    def report(self, weight_bytes_per_token: float) -> str:
        gb = weight_bytes_per_token / 1e9
        return f"{self.wall:6.1f} tok/s wall, {self.cpu:6.1f} CPU ({gb * self.wall:5.2f} / {gb * self.cpu:5.2f} GB/s)"


@dataclass
class QuantBenchResult:
    label: str
    weight_bytes_per_step: int
    batch1: Rate
    batch_size: int = 0  # 0: no batched run (llama.cpp)
    batch: Rate | None = None
    batch_output_tok_s: float = 0.0  # end to end, the prompts' prefill included (wall)

    def report(self, reference: QuantBenchResult | None = None) -> str:
        line = (
            f"[{self.label:>17}] weights {self.weight_bytes_per_step / 2**20:6.1f} MiB/step | "
            f"batch 1: {self.batch1.report(self.weight_bytes_per_step)}"
        )
        if reference is not None and reference is not self:
            line += f" = {self.batch1.cpu / reference.batch1.cpu:.2f}x {reference.label} (CPU)"
        if self.batch is not None:
            per_token = self.weight_bytes_per_step / self.batch_size
            line += (
                f" | batch {self.batch_size}: {self.batch.report(per_token)}, {per_token / 2**20:.2f} MiB/token; "
                f"end to end {self.batch_output_tok_s:.1f} output tok/s"
            )
        return line


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every layer's and the logits
    matrix, not the embedding table (a step looks up one row per token) nor the RoPE tables."""
    from pagedllm.layers.rotary import RotaryEmbedding

    skip = {id(t) for m in model.modules() if isinstance(m, RotaryEmbedding) for t in m.buffers()}
    if model.lm_head is not None:
        skip.add(id(model.embed_tokens.weight))
    return sum(t.nbytes for t in (*model.parameters(), *model.buffers()) if id(t) not in skip)


def _timed_generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(wall s, CPU s) of generating ``max_tokens`` greedy tokens for each prompt."""
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - wall, time.process_time() - cpu


def _decode_rate(llm, prompts: list[list[int]], output_len: int, repeats: int) -> tuple[Rate, float]:
    """The decode rate, from runs of ``output_len`` tokens minus runs of 1 (the prefill and the
    first token cancel out), and the end-to-end output tokens/s; medians over ``repeats``."""
    rates, e2e = [], []
    for _ in range(repeats):
        first = _timed_generate(llm, prompts, 1)
        full = _timed_generate(llm, prompts, output_len)
        tokens = len(prompts) * (output_len - 1)
        rates.append((tokens / (full[0] - first[0]), tokens / (full[1] - first[1])))
        e2e.append(len(prompts) * output_len / full[0])
    return Rate(*(statistics.median(r) for r in zip(*rates))), statistics.median(e2e)


def bench_pagedllm(llm, label: str, prompts: list[list[int]], output_len: int, repeats: int) -> QuantBenchResult:
    _timed_generate(llm, prompts[:1], 4)  # warm-up
    batch1, _ = _decode_rate(llm, prompts[:1], output_len, repeats)
    model = llm.engine.core.executor.runner.model
    result = QuantBenchResult(label, weight_bytes_per_step(model), batch1)
    if len(prompts) > 1:
        result.batch_size = len(prompts)
        result.batch, result.batch_output_tok_s = _decode_rate(llm, prompts, output_len, repeats)
    return result


def bench_llama_cpp(path: str, prompt: list[int], output_len: int, repeats: int) -> QuantBenchResult:
    """llama.cpp's batch-1 greedy decode of the same GGUF file, on as many threads as torch uses."""
    import torch
    from llama_cpp import Llama

    from pagedllm.models.gguf_file import GGUFFile

    f = GGUFFile(path)
    # The token embedding is read one row per token unless it also serves as the output matrix.
    tied = "output.weight" not in f.tensors
    weight_bytes = sum(t.nbytes for name, t in f.tensors.items() if tied or name != "token_embd.weight")
    llm = Llama(model_path=path, n_ctx=len(prompt) + output_len + 8, n_threads=torch.get_num_threads(), verbose=False)
    rates = []
    for _ in range(repeats + 1):  # the first run warms up
        n, wall, cpu = 0, 0.0, 0.0
        for _token in llm.generate(prompt, temp=0.0, reset=True):
            n += 1
            if n == 1:  # after the prefill
                wall, cpu = time.perf_counter(), time.process_time()
            if n == output_len:
                break
        rates.append(((n - 1) / (time.perf_counter() - wall), (n - 1) / (time.process_time() - cpu)))
    return QuantBenchResult("llama.cpp", weight_bytes, Rate(*(statistics.median(r) for r in zip(*rates[1:]))))


def _reference(results: list[QuantBenchResult]) -> QuantBenchResult | None:
    """What speeds are compared to: the bfloat16 run, once measured (the issue's 2x target)."""
    return next((r for r in results if r.label == "bf16"), None)


def mode_kwargs(mode: str) -> dict[str, object]:
    """The ``LLM`` keywords of a mode of ``MODES``: ``quantize_lm_head`` left out where the
    dtype decides it (auto: a keyword given wins over the dtype, so False would run auto's
    lm_head in float32, not as ``LLM(model)`` runs it)."""
    dtype, quantization, lm_head = MODES[mode]
    return {"dtype": dtype, "quantization": quantization} | ({} if lm_head is None else {"quantize_lm_head": lm_head})


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", default="auto,fp32,bf16,int8,int4,int4+lm_head,w8a8", help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--prompt-len", type=positive_int, default=64)
    parser.add_argument("--output-len", type=positive_int, default=64)
    parser.add_argument("--batch-size", type=positive_int, default=32, help="the batched run's requests (1: skip it)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs per measurement; the median is reported")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp reference")
    parser.add_argument("--result-json", type=output_file, default=None, help="write the results to this JSON file")


def run(args: argparse.Namespace) -> None:
    import torch

    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.quantization_config import QuantizationConfig
    from pagedllm.models.loader import resolve_model

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        what = f"unknown modes {unknown}" if unknown else "no mode given"
        raise ValueError(f"{what}; choose from {', '.join(MODES)}")
    # No prefix caching: each run must prefill its prompts for the 1-token runs to cancel it.
    kwargs = EngineArgs.from_cli_args(args).kwargs() | {"enable_prefix_caching": False}
    gen = torch.Generator().manual_seed(args.seed)
    results: list[QuantBenchResult] = []
    prompts: list[list[int]] = []
    for mode in modes:
        _, quantization, lm_head = MODES[mode]
        llm = LLM(**(kwargs | mode_kwargs(mode)))
        if not prompts:  # random tokens, the same for every mode
            vocab = llm.engine.core.model_config.vocab_size
            ids = torch.randint(0, vocab, (args.batch_size, args.prompt_len), generator=gen)
            prompts = ids.tolist()
        quant = QuantizationConfig.parse(quantization, args.quantization_group_size, bool(lm_head))
        label = mode if quant is None else quant.describe()
        results.append(bench_pagedllm(llm, label, prompts, args.output_len, args.repeats))
        print(results[-1].report(_reference(results)), flush=True)
        del llm
    resolved = resolve_model(args.model)
    if not args.no_llama_cpp and resolved.kind == "gguf":
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama.cpp reference skipped: llama_cpp (llama-cpp-python) is not importable")
        else:
            results.append(bench_llama_cpp(str(resolved.path), prompts[0], args.output_len, args.repeats))
            print(results[-1].report(_reference(results)), flush=True)
    print(f"threads {torch.get_num_threads()}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
