"""``pagedllm bench gemm``: the prefill GEMMs of a decoder layer, int8 and 4-bit against float32.

For each row count M (``--rows``) and each GEMM of one decoder layer of the chosen model
shapes (q/k/v fused, o, gate/up fused, down; ``--shapes``), the time of:
- ``f32``: our packed float32 GEMM (``linear_f32``), the reference every ratio divides;
- ``w8a8``, ``w4a8``: our int8-activation GEMMs (``linear_w8a8``, ``linear_q4a8``: GGUF Q4_1's
  arithmetic), the activations' quantization included; these and the GGUF kinds below as a
  prompt's rows take them, so on a CPU with AMX-BF16 their bfloat16 tiles
  (``PAGEDLLM_DISABLE_AMX=1``: the int8 tiles; the K-quants' ``stored`` layout has none);
- ``q4_0``: ``linear_q4a8`` on GGUF Q4_0's blocks (every m = -8 d, ``symmetric``);
- ``q8a8``: GGUF Q8_0 blocks on w8a8's panels (``linear_q8a8``: the layer an all-Q8_0 weight
  takes, a tied lm_head);
- ``q8_0``, ``q5_0``, ``q4_k``, ``q5_k``, ``q6_k``: the K-quant GEMM on GGUF blocks
  (``kquant.linear``) repacked into panels as the layers run them (``--kquant-layout
  panels``), or as the file stores them (``stored``), where the format takes K (the K-quants:
  K a multiple of 256);
- ``torch``: PyTorch's float32 matmul (oneDNN / MKL);
- ``int_mm``: PyTorch's int8 x int8 -> int32 matmul (``torch._int_mm``, oneDNN on x86): no
  quantization, no scales, so a ceiling for what an int8 GEMM does with its multiply-adds.
Each as G(FL)OP/s (2 M N K per call) and as a multiple of ``f32``; the layer's line adds the
GEMMs' times. Outputs come from reused heap memory (``_heap_outputs``), not pages the kernel
must fault in on every call. Time is the process's CPU time (at one thread, the time it
actually ran: robust to other processes on shared cores), the best of ``--repeats``, the kinds
interleaved in every repeat so that a busy moment hits them alike. Threads: ``--threads``
(default 1).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from pagedllm.engine.arg_utils import choice_list, positive_int, positive_int_list, thread_count

# Layer shapes per model: hidden, intermediate, attention heads, K/V heads, head dim.
MODEL_SHAPES = {
    "smollm2-135m": (576, 1536, 9, 3, 64),
    "qwen2.5-0.5b": (896, 4864, 14, 2, 64),
}
KINDS = ("f32", "w8a8", "w4a8", "q4_0", "q8a8", "q8_0", "q5_0", "q4_k", "q5_k", "q6_k", "torch", "int_mm")


def layer_gemms(model: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of each GEMM of one decoder layer of ``model`` (a key of ``MODEL_SHAPES``)."""
    hidden, inter, heads, kv_heads, head_dim = MODEL_SHAPES[model]
    return [
        ("qkv", (heads + 2 * kv_heads) * head_dim, hidden),
        ("o", hidden, heads * head_dim),
        ("gate_up", 2 * inter, hidden),
        ("down", hidden, inter),
    ]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", type=choice_list(tuple(MODEL_SHAPES)), default="smollm2-135m,qwen2.5-0.5b",
                        help=f"comma list of {', '.join(MODEL_SHAPES)}")
    parser.add_argument("--rows", type=positive_int_list, default="1,16,256,512,1024,2048",
                        help="comma list of M (rows of x)")
    parser.add_argument("--kinds", type=choice_list(KINDS), default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)}")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--threads", type=thread_count, default=1)
    parser.add_argument("--kquant-layout", choices=("panels", "stored"), default="panels",
                        help="GGUF blocks repacked into panels (what the layers run) or as stored")


def _kernels(kinds: list[str], n: int, k: int, panels: bool = True) -> dict[str, Callable[[object], object]]:
    """kind -> fn(x) computing x @ w.T for a random [n, k] weight in that kind's format (GGUF
    blocks in panels, or as stored); kinds whose format does not take k are left out."""
    import torch

    from pagedllm.kernels import kquant
    from pagedllm.kernels import linear as lin

    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    fns: dict[str, Callable[[object], object]] = {}
    for kind in kinds:
        if kind == "f32":
            packed = lin.linear_pack_f32(w)
            fns[kind] = lambda x, p=packed: lin.linear_f32(x, p, None, n)
        elif kind == "w8a8":
            packed8 = lin.linear_pack_w8a8(w)
            fns[kind] = lambda x, p=packed8: lin.linear_w8a8(x, p, None, n, prompt_from=0)
        elif kind in ("w4a8", "q4_0"):  # random codes and scales: the speed does not depend on the values
            groups = -(-k // lin.QUANT_GROUP)
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
            scale = torch.full((n, groups), 0.01)
            sym = kind == "q4_0"  # packed without its mins, as a Q4_0 layer is
            packed4 = lin.linear_pack_q4a8(codes, scale, None if sym else -8 * scale)
            fns[kind] = lambda x, p=packed4, s=sym: lin.linear_q4a8(x, p, None, n, prompt_from=0, symmetric=s)
        elif kind in ("q8a8", "q8_0", "q5_0", "q4_k", "q5_k", "q6_k"):
            qtype = kquant.abi.CONSTANTS[f"PAGEDLLM_GGML_{'Q8_0' if kind == 'q8a8' else kind.upper()}"]
            size = kquant.row_bytes(qtype, k)
            if size:  # random blocks: the speed does not depend on the values
                blocks = torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=gen)
                if kind in ("q8a8", "q8_0"):  # codes in [-127, 127], as quantizers write them (-128 takes a slower path)
                    codes = blocks.view(n, -1, 34)[..., 2:]
                    codes.masked_fill_(codes == 0x80, 0x81)
                if kind == "q8a8":
                    packed_q8 = lin.linear_pack_q8_0(blocks, k)
                    fns[kind] = lambda x, p=packed_q8: lin.linear_q8a8(x, p, None, n, prompt_from=0)
                else:
                    stored = kquant.StoredWeight([(qtype, blocks)], k)
                    weight = (kquant.panels(stored) if panels else None) or stored
                    fns[kind] = lambda x, wt=weight: kquant.linear(x, wt, prompt_from=0)
        elif kind == "torch":
            fns[kind] = lambda x, wt=w.T.contiguous(): torch.mm(x, wt)
        elif kind == "int_mm":
            w8 = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=gen)
            fns[kind] = lambda x, wt=w8: torch._int_mm(x.to(torch.int8), wt)
    return fns


def _heap_outputs() -> bool:
    """Serve large allocations from glibc's heap, kept after a free, instead of mapping fresh
    pages per allocation (glibc does so above its mmap threshold, 32 MiB at most by default):
    each call's output would otherwise be faulted in page by page inside the timed call (Qwen's
    gate/up at 1024 rows: a 38 MiB output, ~9,700 faults, about 40% of the GEMM's time), a cost
    of the allocator that the engine's long-context prefill does not show (docs/benchmarks.md).
    False where the C library has no ``mallopt`` (not glibc)."""
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, (1 << 31) - 1))


def run(args: argparse.Namespace) -> None:
    import os

    import torch

    from pagedllm.kernels.library import active_isa

    torch.set_num_threads(args.threads)
    kinds = list(args.kinds)
    if "f32" not in kinds:
        kinds.insert(0, "f32")
    heap = _heap_outputs()
    print(f"CPU ISA in use: {active_isa() or 'none'}; {args.threads} thread(s); process CPU time, "
          f"best of {args.repeats}; outputs {'from the heap' if heap else 'as the allocator gives them'}")
    print("G(FL)OP/s, and (x f32): our float32 GEMM's time over the kind's")
    for model in args.shapes:
        gemms = [(name, n, k, _kernels(kinds, n, k, args.kquant_layout == "panels")) for name, n, k in layer_gemms(model)]
        for m in args.rows:
            gen = torch.Generator().manual_seed(m)
            totals = dict.fromkeys(kinds, 0.0)
            flops_total = 0
            for name, n, k, fns in gemms:
                x = torch.randn(m, k, generator=gen)
                xi = x.clamp(-127, 127).to(torch.int8)  # int_mm's int8 input, converted outside the timing
                inputs = {kind: (xi if kind == "int_mm" else x) for kind in fns}
                best = _interleaved(fns, inputs, args.repeats)
                flops = 2 * m * n * k
                flops_total += flops
                for kind in kinds:
                    totals[kind] += best.get(kind, float("nan"))
                print(_line(f"{model} M={m:<5d} {name:8s} [{n}x{k}]", kinds, best, flops))
            print(_line(f"{model} M={m:<5d} layer", kinds, totals, flops_total))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _interleaved(fns: dict[str, Callable], inputs: dict[str, object], repeats: int) -> dict[str, float]:
    """kind -> its best CPU seconds over ``repeats`` rounds, every kind once per round (after
    one warm-up round); a kind that raises (int_mm refuses some shapes) is dropped."""
    best: dict[str, float] = {}
    live = dict(fns)
    for round_ in range(repeats + 1):
        for kind, fn in list(live.items()):
            start = time.process_time()
            try:
                fn(inputs[kind])
            except RuntimeError:
                del live[kind]
                continue
            if round_:
                best[kind] = min(best.get(kind, float("inf")), time.process_time() - start)
    return best


def _line(label: str, kinds: list[str], seconds: dict[str, float], flops: int) -> str:
    base = seconds.get("f32", float("nan"))
    cells = []
    for kind in kinds:
        t = seconds.get(kind, float("nan"))
        if t != t:  # not measured: the format does not take this K, or int_mm refused
            cells.append(f"{kind} {'-':>6s}        ")
        else:
            cells.append(f"{kind} {flops / t / 1e9:6.1f} ({base / t:4.2f}x)")
    return f"{label:44s} " + "  ".join(cells)
