"""``pagedllm bench step``: where a decode step's time goes, part by part.

One ``LLM`` in this process, one rank. Per batch size B: B random prompts of ``--context``
tokens, prefilled once (1 output token: the prefill figures below), which leaves them in the
prefix cache; then generated again with 1 and with ``--steps`` + 1 greedy output tokens, both
finding the prompts cached, so the B requests decode together and the little prefill left (the
last block) cancels in the difference. (Uncached, the difference of two B x context prefills
is mostly their noise at long contexts.) Per decode step, from that difference, medians over
``--repeats``:
- the engine's step, wall clock;
- the model's native call (``decode_layers``), timed part by part inside the kernel library
  (``DecoderDesc.profile``: the norms, q/k/v GEMM, RoPE, K/V write, attention, o GEMM,
  gate/up GEMM, gated activation, down GEMM, mixture-of-experts blocks);
- the thread team's jobs per step (``team_jobs``) times what handing out one empty job costs
  on this machine (``probe_team_handoff``): the fork/join share, part of the parts above;
- the logits (``compute_logits``) and the sampler, each wall clock around its call;
- the rest of the step: the Python around the native call (scheduling, the step's inputs,
  outputs and detokenization).
At batch 1 it adds the weight bytes a step reads over its time: the GB/s to set beside
``bench roofline``'s measured bandwidth. The run with 1 output token is the prompts' prefill
(in steps of ``--max-num-batched-tokens``): its time, prompt tokens/s and parts are printed too,
what a first token waits for. Models the one-call decoder does not cover report no
parts.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from collections.abc import Callable

from pagedllm.engine.arg_utils import positive_int, positive_int_list

_PARTS = ("norms", "qkv GEMM", "RoPE", "K/V write", "attention", "o GEMM", "gate/up GEMM", "activation",
          "down GEMM", "MoE")
_HANDOFF_JOBS = 20_000


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=positive_int_list, default=[1, 16])
    parser.add_argument("--context", type=positive_int, default=256, help="prompt tokens per request")
    parser.add_argument("--steps", type=positive_int, default=64, help="decode steps timed per run")
    parser.add_argument("--repeats", type=positive_int, default=3)


class _Timer:
    """Wall seconds spent inside a wrapped callable, summed."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def _snapshot(profile, lib, timers: dict[str, _Timer]) -> list[float]:
    """Seconds per part, team jobs, seconds per timed Python call, now."""
    parts = [ns / 1e9 for ns in profile] if profile is not None else [0.0] * len(_PARTS)
    return [*parts, float(lib.team_jobs()), *(t.seconds for t in timers.values())]


def _report(title: str, rows: list[list[float]], handoff: float) -> float:
    """Print the medians of rows [wall seconds, parts..., team jobs, logits, sampler] part by part;
    return the median wall seconds."""
    median = [statistics.median(column) for column in zip(*rows)]
    wall, parts = median[0], median[1 : 1 + len(_PARTS)]
    jobs, (logits, sampler) = median[1 + len(_PARTS)], median[2 + len(_PARTS) :]
    native = sum(parts)
    print(f"\n{title}: {wall * 1e3:.2f} ms")
    for name, seconds in zip(_PARTS, parts):
        if seconds > 0:
            print(f"  {name:<13} {seconds * 1e3:8.3f} ms  {100 * seconds / wall:5.1f}%")
    print(f"  {'native call':<13} {native * 1e3:8.3f} ms  {100 * native / wall:5.1f}%  "
          f"({jobs:.0f} team jobs: ~{jobs * handoff * 1e3:.2f} ms of hand-offs inside)")
    print(f"  {'logits':<13} {logits * 1e3:8.3f} ms  {100 * logits / wall:5.1f}%")
    print(f"  {'sampler':<13} {sampler * 1e3:8.3f} ms  {100 * sampler / wall:5.1f}%")
    rest = wall - native - logits - sampler
    print(f"  {'the rest':<13} {rest * 1e3:8.3f} ms  {100 * rest / wall:5.1f}%  (Python around the call)")
    return wall


def run(args: argparse.Namespace) -> None:
    import torch

    from pagedllm import LLM, SamplingParams
    from pagedllm.bench.quant import weight_bytes_per_step
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.kernels import abi, library

    if not library.available():
        raise SystemExit("bench step times the native kernels: none load here")
    lib = library.native_library()
    kwargs = EngineArgs.from_cli_args(args).kwargs() | {"enable_prefix_caching": True}
    if kwargs.get("tensor_parallel_size", 1) != 1:
        raise SystemExit("bench step runs one rank (--tensor-parallel-size 1)")
    llm = LLM(**kwargs)
    runner = llm.engine.core.executor.runner
    model = runner.model
    vocab = llm.engine.core.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def generate(prompts: list[list[int]], n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    generate([[1, 2, 3]], 2)  # builds the one-call decoder
    decoder = model.native_decoder or None
    profile = None
    if decoder is not None:
        profile = (ctypes.c_int64 * abi.CONSTANTS["PAGEDLLM_PROFILE_PARTS"])()
        decoder.desc.profile = ctypes.addressof(profile)
    timers = {"logits": _Timer(), "sampler": _Timer()}
    model.compute_logits = timers["logits"].wrap(model.compute_logits)
    runner.sampler.forward = timers["sampler"].wrap(runner.sampler.forward)

    threads = torch.get_num_threads()
    start = time.perf_counter()
    lib.probe_team_handoff(_HANDOFF_JOBS)
    handoff = (time.perf_counter() - start) / _HANDOFF_JOBS
    weights = weight_bytes_per_step(model)
    print(f"threads {threads}; one team job handed out and joined: {handoff * 1e6:.1f} us; "
          f"weights read per step {weights / 2**20:.1f} MiB; one-call decoder: {'yes' if decoder else 'no'}")
    for batch in args.batch_sizes:
        generate(torch.randint(0, vocab, (batch, args.context), generator=gen).tolist(), 2)  # warm
        prefills, decodes = [], []
        for _ in range(args.repeats):
            prompts = torch.randint(0, vocab, (batch, args.context), generator=gen).tolist()  # not cached yet
            before = _snapshot(profile, lib, timers)
            prefill = generate(prompts, 1)
            cached = _snapshot(profile, lib, timers)
            first = generate(prompts, 1)
            middle = _snapshot(profile, lib, timers)
            full = generate(prompts, args.steps + 1)
            after = _snapshot(profile, lib, timers)
            prefills.append([prefill, *(b - a for a, b in zip(before, cached))])
            per_step = [((c - b) - (b - a)) / args.steps for a, b, c in zip(cached, middle, after)]
            decodes.append([(full - first) / args.steps, *per_step])
        prefill = _report(f"batch {batch}, prefill of {batch} x {args.context} prompt tokens", prefills, handoff)
        print(f"  prompt tokens/s {batch * args.context / prefill:.0f}")
        step = _report(f"batch {batch}, context {args.context}, one decode step", decodes, handoff)
        print(f"  {batch / step:.1f} tok/s")
        if batch == 1:
            print(f"  weights read at {weights / step / 1e9:.1f} GB/s")
    print(f"\nload average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    llm.shutdown()
