"""``pagedllm bench roofline``: what this CPU can do, measured, to set the engine's figures against.

Three ceilings, each the best of ``--repeats`` runs at the process's thread count:
- float32 FLOP/s: our packed float32 GEMM (``linear_f32``) on a compute-bound shape, and
  PyTorch's ``torch.mm`` (oneDNN/MKL) on the same shape for comparison;
- int8 OP/s: our w8a8 GEMM (``linear_w8a8``: two ops per multiply-add, the on-the-fly
  activation quantization included);
- memory bandwidth, bytes/s: a read-only pass (``torch.sum``) over a float32 tensor much
  larger than the last-level cache.
A decode step at batch 1 reads every weight once, so bytes per token / bandwidth is its floor.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=1536, help="M = N = K of the GEMMs")
    parser.add_argument("--memory-mib", type=int, default=1024, help="size of the tensor read for bandwidth, MiB")
    parser.add_argument("--repeats", type=int, default=5)


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: page faults, packing caches, thread start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(args: argparse.Namespace) -> None:
    import torch

    from pagedllm.kernels import ops
    from pagedllm.kernels.library import active_isa

    n = args.size
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    flops = 2 * n**3
    print(f"CPU ISA in use: {active_isa() or 'none (PyTorch only)'}; {torch.get_num_threads()} threads")
    print(f"torch.mm float32 [{n}x{n}x{n}]: {flops / _best_seconds(lambda: torch.mm(x, w.T), args.repeats) / 1e9:8.1f} GFLOP/s")
    if ops.available():
        packed = ops.linear_pack_f32(w)
        t = _best_seconds(lambda: ops.linear_f32(x, packed, None, n), args.repeats)
        print(f"linear_f32 (native)             : {flops / t / 1e9:8.1f} GFLOP/s")
        if ops.linear_w8a8_available():
            packed8 = ops.linear_pack_w8a8(w)
            t = _best_seconds(lambda: ops.linear_w8a8(x, packed8, None, n), args.repeats)
            print(f"linear_w8a8 (native)            : {flops / t / 1e9:8.1f} GOP/s (int8)")
    big = torch.ones(args.memory_mib * 2**20 // 4)
    t = _best_seconds(lambda: big.sum(), args.repeats)
    print(f"memory read ({args.memory_mib} MiB, torch.sum)  : {big.numel() * 4 / t / 1e9:8.1f} GB/s")
