"""``pagedllm bench lora``: decode tokens/s with LoRA adapters in the batch against the base alone.

Random PEFT adapters of rank ``--rank`` on every q/k/v/o and gate/up/down projection are
written to a temporary folder for the model; a batch of ``--batch-size`` requests then
decodes with 0, 1, 4, ... distinct adapters among them (``--adapter-counts``; the requests
take them in turn), and one request decodes alone with and without an adapter. The decode
rate is from runs of ``--output-len`` tokens minus runs of 1 (prefill and first token
cancel out), medians over ``--repeats``, by wall clock and per CPU-second of the process;
each repeat measures every case in turn, so that a ratio to the base compares runs of the
same moment on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from pagedllm.engine.arg_utils import non_negative_int_list, output_file, positive_int


def write_random_adapter(path: Path, config, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder of rank ``rank`` on every projection of ``config``'s model (random A
    and B; alpha = 2 rank)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    sizes = {
        "self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i),
    }
    tensors = {}
    for layer in range(config.num_layers):
        for name, (out, inp) in sizes.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    targets = sorted({n.split(".")[1] for n in sizes})
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets})
    )
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def _timed(llm, prompts: list[list[int]], loras: list, max_tokens: int) -> tuple[float, float]:
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - wall, time.process_time() - cpu


def decode_rates(
    llm, cases: list[tuple[list[list[int]], list]], output_len: int, repeats: int
) -> list[tuple[float, float]]:
    """Per case (prompts, their adapters): (wall tok/s, tok per CPU-second) of decode, medians
    over ``repeats`` rounds that each measure every case in turn."""
    for prompts, loras in cases:
        _timed(llm, prompts, loras, 2)  # warm-up: adapters read, kernels touched
    rates: list[list[tuple[float, float]]] = [[] for _ in cases]
    for _ in range(repeats):
        for (prompts, loras), out in zip(cases, rates, strict=True):
            first = _timed(llm, prompts, loras, 1)
            full = _timed(llm, prompts, loras, output_len)
            tokens = len(prompts) * (output_len - 1)
            out.append((tokens / (full[0] - first[0]), tokens / (full[1] - first[1])))
    return [tuple(statistics.median(r) for r in zip(*case)) for case in rates]  # type: ignore[misc]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rank", type=positive_int, default=16, help="the adapters' rank")
    parser.add_argument("--adapter-counts", type=non_negative_int_list, default="0,1,4,16",
                        help="distinct adapters in the batch, comma list (0 first: the others' reference)")
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--prompt-len", type=positive_int, default=32)
    parser.add_argument("--output-len", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs per measurement; the median is reported")
    parser.add_argument("--result-json", type=output_file, default=None, help="write the results to this JSON file")


def run(args: argparse.Namespace) -> None:
    import torch

    from pagedllm import LLM, LoRARequest
    from pagedllm.engine.arg_utils import EngineArgs

    most = max(max(args.adapter_counts), 1)
    kwargs = EngineArgs.from_cli_args(args).kwargs() | {
        "enable_prefix_caching": False, "enable_lora": True, "max_loras": most, "max_cpu_loras": most,
        "max_lora_rank": args.rank,
    }
    llm = LLM(**kwargs)
    config = llm.engine.core.model_config
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, config.vocab_size, (args.batch_size, args.prompt_len), generator=gen).tolist()
    results = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-lora-") as tmp:
        adapters = [
            LoRARequest(f"a{k}", k + 1, str(write_random_adapter(Path(tmp) / f"a{k}", config, args.rank, k)))
            for k in range(most)
        ]

        cases = [(f"batch {len(prompts)}, {count} adapters", prompts,
                  [adapters[j % count] if count else None for j in range(len(prompts))])
                 for count in args.adapter_counts]
        cases += [("batch 1, base", prompts[:1], [None]), ("batch 1, one adapter", prompts[:1], [adapters[0]])]
        rates = decode_rates(llm, [(batch, loras) for _, batch, loras in cases], args.output_len, args.repeats)
        reference = None
        for (label, batch, loras), (wall, cpu) in zip(cases, rates, strict=True):
            if not any(loras):  # the base: what the next cases are measured against
                reference = (wall, cpu)
            ratio = "" if reference is None or not any(loras) else (
                f" = {wall / reference[0]:.2f}x base (wall), {cpu / reference[1]:.2f}x (CPU)"
            )
            print(f"[{label:>26}] {wall:7.1f} tok/s wall, {cpu:7.1f} tok/CPU-s{ratio}", flush=True)
            results.append({"label": label, "batch": len(batch), "wall": wall, "cpu": cpu})
    llm.shutdown()
    print(f"rank {args.rank}, threads {torch.get_num_threads()}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(results, f, indent=2)
