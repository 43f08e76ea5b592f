"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral, the Llama-family network (``llama.py``:
Qwen3-MoE with its q/k head norms, Mixtral with its sliding window when set) whose MoE layers
(``ModelConfig.is_moe_layer``) hold a ``FusedMoE`` block in place of the dense MLP.

Checkpoint names are taken in each form they are stored in, and handed to the Llama loader
as one expert's 2-D projections each (``layers.{i}.mlp.experts.{e}.{gate,up,down}_proj``):
- Qwen3-MoE's ``mlp.experts.{e}.{gate,up,down}_proj`` and router ``mlp.gate``, as they are;
- Mixtral's ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down) and
  ``block_sparse_moe.gate``;
- 3-D stacks of all experts: transformers' own ``mlp.experts.gate_up_proj`` [E, 2 I, H] and
  ``mlp.experts.down_proj`` [E, H, I], and GGUF's ``ffn_{gate,up,down}_exps`` (named
  ``mlp.experts.{gate,up,down}_proj.weight`` by ``gguf_loader``), split into their experts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import SINGLE, TPGroup
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.models.llama import LlamaForCausalLM

_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.weight$")
_MIXTRAL_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}
_STACKED = re.compile(r"\.mlp\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?$")


def expert_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with every expert's projection under its own 2-D name (see the
    module docstring); other tensors pass through, Mixtral's ``block_sparse_moe`` renamed ``mlp``.

    Raises:
        ValueError: a 3-D expert stack that is not 3-D, or a fused gate/up of odd rows.
    """
    for name, tensor in weights:
        if mixtral := _MIXTRAL_EXPERT.search(name):
            expert, proj = mixtral.groups()
            yield name[: mixtral.start()] + f".mlp.experts.{expert}.{_MIXTRAL_PROJ[proj]}.weight", tensor
            continue
        name = name.replace(".block_sparse_moe.", ".mlp.")
        stacked = _STACKED.search(name)
        if stacked is None:
            yield name, tensor
            continue
        prefix, proj = name[: stacked.start()], stacked.group(1)
        if tensor.dim() != 3 or (proj == "gate_up_proj" and tensor.shape[1] % 2):
            raise ValueError(f"{name}: expected a 3-D stack of experts, got {list(tensor.shape)}")
        for e, matrix in enumerate(tensor.unbind(0)):
            if proj == "gate_up_proj":
                gate, up = matrix.chunk(2)
                yield f"{prefix}.mlp.experts.{e}.gate_proj.weight", gate
                yield f"{prefix}.mlp.experts.{e}.up_proj.weight", up
            else:
                yield f"{prefix}.mlp.experts.{e}.{proj}.weight", matrix


class MoEForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` with a ``FusedMoE`` block as the MLP of each MoE layer (the
    others keep the dense MLP of ``intermediate_size``); arguments as Llama's."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, tp: TPGroup = SINGLE,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__(config, dtype, tp, max_model_len)
        for i, layer in enumerate(self.layers):
            if config.is_moe_layer(i):
                layer.mlp = FusedMoE(
                    config.hidden_size, self.shard.moe_intermediate_size, config.num_experts,
                    config.num_experts_per_tok, config.norm_topk_prob, dtype, tp,
                )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As Llama's, every expert's projections under their own names first (``expert_tensors``)."""
        super().load_weights(expert_tensors(weights))
