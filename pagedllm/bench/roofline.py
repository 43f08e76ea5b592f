"""``pagedllm bench roofline``: what this CPU can do, in theory and measured, and how close the kernels come.

Ceilings, each the best of ``--repeats`` runs at the process's thread count:
- the clock: a dependent chain of integer adds on every thread at once (``probe_add_chain``,
  one add per cycle), so it is the clock all the threads sustain together;
- theoretical peaks: physical cores x that clock x multiply-adds per cycle per core for the
  loaded kernels' ISA x 2 ops (``_macs_per_cycle`` states the per-core figures and where they
  come from); SMT siblings share one core's vector units, so threads on siblings add nothing;
- measured peaks: the vector layer's own float32 FMA and int8 dot in registers on every
  thread (``probe_fma_f32``, ``probe_dot_i8``: no memory traffic);
- the w4a8 tiles' ceilings: the same dots with 3 float32 FMAs after every 8
  (``probe_dot_fma_i8``), the multiplies the epilogue takes per accumulator and group of 32 k
  on GGUF Q4_1's blocks (Q4_1 x Q8_1: the two scales' product and two FMAs, one for the
  minimum), and with 2 on Q4_0's (the minimum's FMA gone: ``linear_q4a8``'s ``symmetric``).
  Where dots and float multiplies issue on the same pipes (AMD Zen 4) these run at 8/11 and
  8/10 of the int8 peak, and no w4a8 GEMM can pass them; where apart, at the peak;
- kernels: our packed float32 GEMM (``linear_f32``), w8a8 GEMM (``linear_w8a8``) and w4a8
  GEMM on Q4_1's and on Q4_0's arithmetic (``linear_q4a8``; two ops per multiply-add, the
  activation quantization included) on an M = N = K = ``--size`` shape, PyTorch's
  ``torch.mm`` (oneDNN) on the same shape, each as a fraction of both peaks (w4a8 also of its
  tile's ceiling);
- memory bandwidth, bytes/s: a read-only pass (``torch.sum``) over a float32 tensor much
  larger than the last-level cache. A decode step at batch 1 reads every weight once, so
  bytes per token / bandwidth is its floor.
The load average closes the report, as ``bench step``'s: each figure is taken at its own
moment, so on a busy machine (or vCPUs sharing a core with another tenant) one probe can
catch a slow moment its neighbour did not, and a fraction can pass 100%; where one passes
105% (or the Q4_0 ceiling falls under Q4_1's) a last line says the figures disagree.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

from pagedllm.engine.arg_utils import positive_int
from pagedllm.kernels.isa import cpu_vendor_family

_PROBE_STEPS = 20_000_000  # per thread: ~10 ms at 2 GHz, well above timer and fork/join noise


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=positive_int, default=1536, help="M = N = K of the GEMMs")
    parser.add_argument("--memory-mib", type=positive_int, default=1024, help="size of the tensor read for bandwidth, MiB")
    parser.add_argument("--repeats", type=positive_int, default=5)


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: page faults, packing caches, thread start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def physical_cores(threads: int) -> int:
    """Distinct physical cores among this process's first ``threads`` allowed CPUs (Linux
    topology files; each CPU its own core where they are missing)."""
    cores = set()
    for cpu in sorted(os.sched_getaffinity(0))[:threads]:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        cores.add(siblings.read_text().strip() if siblings.exists() else str(cpu))
    return len(cores)


def _macs_per_cycle(isa: str) -> tuple[int, int] | None:
    """(float32, int8) multiply-adds one core issues per cycle with ``isa``'s kernels; None for scalar.

    Counted in 256-bit FMA pipes per core: two on AMD Zen 2-4 (which run a 512-bit
    instruction over both) and on Intel cores without AVX-512; four (two 512-bit) on Zen 5
    (family 26) and on Intel Xeons with AVX-512. A pipe does 8 float32 FMAs per cycle; in int8,
    32 multiply-adds with VNNI (vpdpbusd) or NEON's sdot, 16 with AVX2, whose vpmaddubsw +
    vpmaddwd pair takes two issues for 32. AArch64: one 256-bit equivalent (two 128-bit pipes).
    """
    if isa == "scalar":
        return None
    vendor, family = cpu_vendor_family()
    if isa.startswith("neon"):
        pipes = 1
    elif isa.startswith("avx512") and (vendor == "GenuineIntel" or (vendor == "AuthenticAMD" and family >= 26)):
        pipes = 4
    else:
        pipes = 2
    int8 = 32 if isa in ("avx512_vnni", "avx512_bf16", "neon_dotprod") else 16
    return 8 * pipes, int8 * pipes


def run(args: argparse.Namespace) -> None:
    import torch

    from pagedllm.kernels import linear as kernels
    from pagedllm.kernels.library import active_isa, native_library

    n, threads, isa = args.size, torch.get_num_threads(), active_isa()
    cores = physical_cores(threads)
    big = torch.ones(args.memory_mib * 2**20 // 4)  # first: a size the machine cannot hold fails before the probes
    print(f"CPU ISA in use: {isa or 'none (PyTorch only)'}; {threads} threads on {cores} physical cores")
    lib = native_library()
    peaks: dict[str, tuple[float, float]] = {}  # kind -> (theoretical, measured) ops/s
    ceilings: dict[int, float] = {}  # float32 FMAs per 8 int8 dots -> the mix's ops/s
    busy = [False]  # a figure past a ceiling measured beside it: the machine was busy during one of them
    if lib is not None:
        clock = _PROBE_STEPS / _best_seconds(lambda: lib.probe_add_chain(_PROBE_STEPS), args.repeats)
        f32_measured = threads * 256 * _PROBE_STEPS / _best_seconds(lambda: lib.probe_fma_f32(_PROBE_STEPS), args.repeats)
        steps8 = _PROBE_STEPS // 2
        i8_measured = threads * 1024 * steps8 / _best_seconds(lambda: lib.probe_dot_i8(steps8), args.repeats)
        print(f"clock, all threads busy (dependent adds)  : {clock / 1e9:8.2f} GHz")
        macs = _macs_per_cycle(isa)
        theory = (0.0, 0.0) if macs is None else (cores * clock * 2 * macs[0], cores * clock * 2 * macs[1])
        peaks = {"f32": (theory[0], f32_measured), "i8": (theory[1], i8_measured)}
        for kind, unit in (("f32", "GFLOP/s float32"), ("i8", "GOP/s int8")):
            t, m = peaks[kind]
            theory_text = f"{t / 1e9:8.1f}" if t else "     n/a"
            print(f"peak {unit:15s} theoretical / in registers: {theory_text} / {m / 1e9:8.1f}")
        for fmas, blocks in ((3, "Q4_1"), (2, "Q4_0")):
            ceilings[fmas] = threads * 1024 * steps8 / _best_seconds(lambda f=fmas: lib.probe_dot_fma_i8(steps8, f), args.repeats)
            label = f"w4a8 tile's ceiling, {blocks} ({fmas} FMAs/8 dots)"
            print(f"{label:42s}: {ceilings[fmas] / 1e9:8.1f} GOP/s int8  "
                  f"({100 * ceilings[fmas] / i8_measured:5.1f}% of the int8 peak, "
                  f"{ceilings[fmas] / f32_measured:.2f}x float32's)")

    def kernel(label: str, kind: str, ops_per_s: float, ceiling: float = 0.0) -> None:
        line = f"{label:32s}: {ops_per_s / 1e9:8.1f} G{'FLOP' if kind == 'f32' else 'OP'}/s"
        if kind in peaks:
            t, m = peaks[kind]
            busy[0] |= any(ops_per_s > 1.05 * c for c in (t, m, ceiling) if c)
            line += f"  ({100 * ops_per_s / m:5.1f}% of measured" + (f", {100 * ops_per_s / t:5.1f}% of theoretical" if t else "")
            line += (f", {100 * ops_per_s / ceiling:5.1f}% of its tile's ceiling)" if ceiling else ")")
        print(line)

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    flops = 2 * n**3
    kernel(f"torch.mm float32 [{n}x{n}x{n}]", "f32", flops / _best_seconds(lambda: torch.mm(x, w.T), args.repeats))
    if lib is not None:
        packed = kernels.linear_pack_f32(w)
        kernel("linear_f32 (native)", "f32", flops / _best_seconds(lambda: kernels.linear_f32(x, packed, None, n), args.repeats))
        packed8 = kernels.linear_pack_w8a8(w)
        kernel("linear_w8a8 (native)", "i8", flops / _best_seconds(lambda: kernels.linear_w8a8(x, packed8, None, n), args.repeats))
        # Random codes and scales: the speed does not depend on the values.
        codes = torch.randint(0, 16, (n, n), dtype=torch.uint8, generator=gen)
        scales = torch.full((n, (n + 31) // 32), 0.01)
        for fmas, blocks in ((3, "Q4_1"), (2, "Q4_0")):
            sym = blocks == "Q4_0"  # packed without its mins, as a Q4_0 layer is
            packed4 = kernels.linear_pack_q4a8(codes, scales, None if sym else -8 * scales)
            seconds = _best_seconds(
                lambda s=sym, p=packed4: kernels.linear_q4a8(x, p, None, n, prompt_from=0, symmetric=s), args.repeats
            )
            kernel(f"linear_q4a8 (native, w4a8, {blocks})", "i8", flops / seconds, ceilings[fmas])
    t = _best_seconds(lambda: big.sum(), args.repeats)
    print(f"memory read ({args.memory_mib} MiB, torch.sum)  : {big.numel() * 4 / t / 1e9:8.1f} GB/s")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    busy[0] |= any(t and m > 1.05 * t for t, m in peaks.values())
    if busy[0] or (ceilings and (ceilings[2] < ceilings[3] or ceilings[3] > 1.05 * peaks["i8"][1])):
        print("these figures disagree (a kernel past its peak, or a ceiling out of order): other work slowed some "
              "probes and not others; run again on an idle machine (load average under the thread count)")
