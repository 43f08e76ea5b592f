"""The rank processes of the tensor-parallel model tests: load a shard, run fixed steps, save
rank 0's logits. Kept apart from the test module so a spawned rank imports torch and pagedllm
only, not pytest and transformers."""

from __future__ import annotations

import multiprocessing
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.config import ModelConfig
from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.core.kv_cache_groups import kv_cache_groups
from pagedllm.distributed.parallel_state import (
    SINGLE, TPGroup, destroy_tensor_parallel, free_port, init_tensor_parallel,
)
from pagedllm.kernels import library
from pagedllm.layers.linear import pack_linears
from pagedllm.quantization_config import QuantizationConfig
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.loader import load_model, resolve_model, set_key_scales
from pagedllm.worker.kv_cache import allocate_kv_caches, build_attention_metadata

BLOCK_SIZE = 4
SEQ_LENS = (11, 14)
# (request, first token, end) per step, decodes first as the metadata requires: prefills,
# a decode next to a prefill chunk, decodes of both, then a decode next to a two-token
# request at an offset (as a speculative verification step is). A request's prompt is what
# it computes before its first one-token step (here 6 and 11 tokens): prompt chunks come last
# and their rows take the prompt kernels (``CausalLM.forward``'s ``prompt_from``).
STEPS = [
    [(0, 0, 6), (1, 0, 4)],
    [(0, 6, 7), (1, 4, 11)],
    [(0, 7, 8), (1, 11, 12)],
    [(0, 8, 9), (1, 12, 13)],
    [(1, 13, 14), (0, 9, 11)],
]


@dataclass(frozen=True)
class Case:
    """A model to run: a checkpoint for ``load_model`` (``path``, with ``quant`` the
    QuantizationConfig arguments), or ``state``: a torch.save'd (ModelConfig, HF state dict)
    of a Gemma 3 model loaded with ``load_weights``."""

    name: str
    path: str = ""
    quant: tuple | None = None
    state: str = ""


def load(case: Case, tp: TPGroup) -> tuple[torch.nn.Module, ModelConfig]:
    """Rank ``tp.rank``'s shard of the case's model, in float32."""
    if case.state:
        config, state = torch.load(case.state, weights_only=False)  # a ModelConfig and tensors
        model = Gemma3ForCausalLM(config, torch.float32, tp)
        model.load_weights(state.items())
        set_key_scales(model)  # as load_model does
        if library.available():
            pack_linears(model)  # as load_model does for float32
        return model.eval(), config
    quant = None if case.quant is None else QuantizationConfig(*case.quant)
    return load_model(resolve_model(case.path), torch.float32, quant, tp)


@torch.inference_mode()
def run_steps(
    model: torch.nn.Module,
    config: ModelConfig,
    tp: TPGroup,
    kv_dtype: torch.dtype = torch.float32,
    seq_lens: tuple[int, ...] = SEQ_LENS,
    steps: list[list[tuple[int, int, int]]] = STEPS,
) -> torch.Tensor | None:
    """Logits [tokens of all ``steps``, vocab] of requests of ``seq_lens`` random tokens through
    a paged KV cache (of ``kv_dtype``) holding the rank's KV heads (rank 0; None on the others),
    each step's prompt chunks (``STEPS``) named to the model."""
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in seq_lens]
    groups = kv_cache_groups(config)
    per_request = -(-max(seq_lens) // BLOCK_SIZE)
    num_blocks = len(seq_lens) * len(groups) * per_request
    kv_caches = allocate_kv_caches(KVCacheConfig.for_model(config, num_blocks, BLOCK_SIZE, kv_dtype, tp.size))
    # Blocks in reverse order: each request's table in each group is scattered over the pool.
    order = list(range(num_blocks))[::-1]
    tables = [
        [order[(r * len(groups) + g) * per_request :][:per_request] for g in range(len(groups))]
        for r in range(len(seq_lens))
    ]
    prompt_lens = [min([a for step in steps for q, a, b in step if q == r and b - a == 1], default=n)
                   for r, n in enumerate(seq_lens)]
    out = []
    for step in steps:
        prompt = [a < prompt_lens[r] for r, a, _ in step]
        assert prompt == sorted(prompt), "prompt chunks come last"
        prompt_from = sum(b - a for (_, a, b), p in zip(step, prompt) if not p)
        ids = [t for r, a, b in step for t in seqs[r][a:b]]
        positions = [p for _, a, b in step for p in range(a, b)]
        meta = build_attention_metadata(
            groups, config.num_layers, [b - a for _, a, b in step], [b for _, _, b in step],
            [tables[r] for r, _, _ in step], BLOCK_SIZE,
        )
        hidden = model(torch.tensor(ids), torch.tensor(positions), kv_caches, meta, prompt_from)
        out.append(model.compute_logits(hidden))
    return None if out[0] is None else torch.cat(out)


def reference(cases: list[Case]) -> dict[str, torch.Tensor]:
    """Each case's logits unsharded, in this process."""
    return {case.name: run_steps(*load(case, SINGLE), SINGLE) for case in cases}


def _rank_main(rank: int, size: int, init_method: str, cases: list[Case], out: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, init_method, timeout_s=120)
    try:
        results: dict[str, torch.Tensor | str] = {}
        for case in cases:
            try:
                logits = run_steps(*load(case, tp), tp)
            except Exception:  # noqa: BLE001 (a case's failure is its test's, not the group's)
                results[case.name] = traceback.format_exc()
                raise
            if logits is not None:
                results[case.name] = logits
    finally:
        if rank == 0:
            torch.save(results, out)
        destroy_tensor_parallel(tp)


def run_group(cases: list[Case], size: int, out: Path, timeout_s: float = 240) -> dict[str, torch.Tensor | str]:
    """Run every case on ``size`` spawned ranks joined over gloo; rank 0's logits by case
    name (a traceback instead, for a case that raised on rank 0)."""
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(r, size, f"tcp://127.0.0.1:{port}", cases, str(out)))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if not out.exists():
        raise RuntimeError(f"rank 0 saved no results; exit codes {[p.exitcode for p in procs]}")
    return torch.load(out)
