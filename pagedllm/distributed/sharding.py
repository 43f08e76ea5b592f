"""Which part of each weight a tensor-parallel rank holds (Megatron-LM's split, vLLM's rules).

Column-parallel layers (q/k/v, gate/up, the vocabulary of embedding and lm_head) keep the
rank's rows; row-parallel ones (o_proj, down_proj) keep the columns that multiply the rank's
heads / intermediate features, and their partial outputs are summed over the ranks. Rank r
of N holds query heads [r h / N, (r + 1) h / N); KV heads are split the same way when
N <= kv, and when N exceeds them each rank keeps the one head ``r kv / N`` its queries read
(replicated on N / kv ranks). The vocabulary goes in ceil(V / N) rows per rank, the last
rank's shorter (padded where a collective needs equal shapes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.kernels.linear import QUANT_GROUP

# HF projection -> how it splits: rows of query heads, rows of KV heads, rows of the
# intermediate features, rows of the vocabulary; columns (row-parallel) of query heads or
# intermediate features.
_COLUMN_PARALLEL = {
    "q_proj": "heads", "k_proj": "kv_heads", "v_proj": "kv_heads",
    "gate_proj": "intermediate", "up_proj": "intermediate",
    "embed_tokens": "vocab", "lm_head": "vocab",
}
_ROW_PARALLEL = {"o_proj": "heads", "down_proj": "intermediate"}
# A mixture of experts' projections (``.experts.{e}.gate_proj`` ...) split each expert's own
# width the same way; the router (``mlp.gate``) is replicated.
_EXPERT = ".experts."


@dataclass(frozen=True)
class ModelShard:
    """One rank's share of a model's dimensions (the whole model at size 1).

    Attributes:
        heads_start, num_heads: the rank's query heads.
        kv_heads_start, num_kv_heads: the rank's KV heads (one replicated head when N > kv).
        intermediate_start, intermediate_size: the rank's MLP features.
        moe_intermediate_start, moe_intermediate_size: the rank's features of every expert.
        vocab_start, vocab_rows: the rank's rows of embedding and lm_head (the last rank's fewer).
        vocab_padded: rows every rank's logits are padded to before they are gathered.
        head_dim: elements per head.
    """

    heads_start: int
    num_heads: int
    kv_heads_start: int
    num_kv_heads: int
    intermediate_start: int
    intermediate_size: int
    moe_intermediate_start: int
    moe_intermediate_size: int
    vocab_start: int
    vocab_rows: int
    vocab_padded: int
    head_dim: int

    @classmethod
    def of(cls, config: ModelConfig, tp: TPGroup) -> ModelShard:
        """Rank ``tp.rank``'s share; the sizes are assumed checked (:func:`check_tensor_parallel_size`)."""
        r, n = tp.rank, tp.size
        heads, kv = config.num_heads // n, config.num_kv_heads
        inter, moe_inter = config.intermediate_size // n, config.moe_intermediate_size // n
        vocab = -(-config.vocab_size // n)
        vocab_start = min(r * vocab, config.vocab_size)
        return cls(
            heads_start=r * heads,
            num_heads=heads,
            kv_heads_start=r * kv // n,
            num_kv_heads=max(1, kv // n),
            intermediate_start=r * inter,
            intermediate_size=inter,
            moe_intermediate_start=r * moe_inter,
            moe_intermediate_size=moe_inter,
            vocab_start=vocab_start,
            vocab_rows=min(vocab_start + vocab, config.vocab_size) - vocab_start,
            vocab_padded=vocab,
            head_dim=config.head_dim,
        )

    def _span(self, kind: str) -> tuple[int, int]:
        """[start, stop) in elements of a dimension of ``kind``."""
        if kind == "heads":
            return self.heads_start * self.head_dim, (self.heads_start + self.num_heads) * self.head_dim
        if kind == "kv_heads":
            return self.kv_heads_start * self.head_dim, (self.kv_heads_start + self.num_kv_heads) * self.head_dim
        if kind == "intermediate":
            return self.intermediate_start, self.intermediate_start + self.intermediate_size
        if kind == "moe_intermediate":
            return self.moe_intermediate_start, self.moe_intermediate_start + self.moe_intermediate_size
        return self.vocab_start, self.vocab_start + self.vocab_rows

    def split_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of checkpoint tensor ``name`` (HF names, any prefix) this rank keeps,
        in elements of the float tensor; None where every rank keeps it whole (norms)."""
        module, _, param = name.rpartition(".")
        expert = _EXPERT in module
        module = module.rpartition(".")[2]
        if module in _COLUMN_PARALLEL:
            return (0, *self._span("moe_intermediate" if expert else _COLUMN_PARALLEL[module]))
        if module in _ROW_PARALLEL and param == "weight":
            return (1, *self._span("moe_intermediate" if expert else _ROW_PARALLEL[module]))
        return None


def is_row_parallel(layer: str) -> bool:
    """Whether the linear layer ``layer`` (HF module name, any prefix) splits its inputs over the
    ranks: each rank holds a slice of every row of its weight, and the outputs are summed."""
    return layer.rpartition(".")[2] in _ROW_PARALLEL


def shard_tensor(tensor: torch.Tensor, split: tuple[int, int, int], elements_per_index: int = 1) -> torch.Tensor:
    """A copy of ``tensor``'s part ``split`` (so the whole tensor can be freed).

    Args:
        tensor: a float weight, or GGUF blocks [rows, K / 32, bytes] (``elements_per_index``
            32: a split along dim 1 is in weights, the tensor in blocks).
        split: (dim, start, stop) from :meth:`ModelShard.split_of`.

    Raises:
        ValueError: a split along dim 1 that cuts through a block.
    """
    dim, start, stop = split
    unit = elements_per_index if dim == 1 else 1
    if start % unit or stop % unit:
        raise ValueError(f"the rank's columns [{start}, {stop}) cut through blocks of {unit} weights")
    return tensor.narrow(dim, start // unit, (stop - start) // unit).clone()


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, tp: TPGroup
) -> Iterable[tuple[str, torch.Tensor]]:
    """Each (HF name, tensor) cut to rank ``tp.rank``'s part as it is read; ``weights`` itself at size 1."""
    if tp.size == 1:
        return weights
    return _sharded(weights, ModelShard.of(config, tp))


def _sharded(weights: Iterable[tuple[str, torch.Tensor]], shard: ModelShard) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        split = shard.split_of(name)
        yield name, tensor if split is None else shard_tensor(tensor, split)


def _problem(config: ModelConfig, n: int, quantized: bool) -> str | None:
    """Why ``n`` ranks cannot split ``config``'s model, or None if they can."""
    heads, kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    model = f"{config.name}'s" if config.name else "the model's"
    if heads % n:
        return f"does not divide {model} {heads} attention heads"
    if kv % n and n % kv:
        return f"neither divides nor is a multiple of {model} {kv} KV heads"
    if inter % n:
        return f"does not divide {model} intermediate size {inter}"
    if config.moe_intermediate_size % n:
        return f"does not divide {model} expert intermediate size {config.moe_intermediate_size}"
    # The integer GEMMs quantize activations per group of 32 features, and GGUF blocks hold
    # 32 weights along K: a row-parallel layer's input must split on those boundaries.
    if quantized and n > 1:
        row_parallel = [("attention output", heads // n * config.head_dim), ("MLP down projection", inter // n)]
        if config.num_experts:
            row_parallel.append(("experts' down projection", config.moe_intermediate_size // n))
        for what, k in row_parallel:
            if k % QUANT_GROUP:
                return (
                    f"gives each rank {k} inputs to {model} {what}, not a multiple of the "
                    f"{QUANT_GROUP}-wide quantization groups"
                )
    return None


def check_tensor_parallel_size(model_config: ModelConfig, tp_size: int, quantized: bool) -> None:
    """Raise ValueError unless ``tp_size`` ranks can split the model, naming the sizes that can.

    Conditions: the query heads and the intermediate sizes (dense and expert) divide by the
    size; the KV heads divide by it or divide it (then replicated); with ``quantized`` linear
    layers (int8 / int4 / w8a8 / w4a8, GGUF blocks kept), each rank's input to o_proj and
    down_proj is a multiple of 32, and so is each expert's down_proj input (an int4 group size
    above 32 is checked when the layers are quantized).

    Raises:
        ValueError: e.g. "tensor_parallel_size 2 does not divide SmolLM2's 9 attention heads;
            sizes that work: 1, 3".
    """
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp_size}")
    problem = _problem(model_config, tp_size, quantized)
    if problem is not None:
        valid = [n for n in range(1, model_config.num_heads + 1) if _problem(model_config, n, quantized) is None]
        raise ValueError(f"tensor_parallel_size {tp_size} {problem}; sizes that work: {', '.join(map(str, valid))}")
