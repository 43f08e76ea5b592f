"""Gemma 3 text decoder (Gemma Team 2025) over flattened tokens and a paged KV cache.

Differences from Llama, each as in transformers' ``modeling_gemma3``:
- embeddings scaled by sqrt(hidden) (the scale cast to the model's dtype first), lm_head tied;
- RMSNorm multiplies by ``1 + weight``: :meth:`Gemma3ForCausalLM.load_weights` takes
  transformers' weights and stores ``1 + weight`` once, so the norms are plain RMSNorms;
- four norms per block: before and after attention, before and after the MLP;
- RMSNorm over each query and key head before RoPE (Llama's attention with ``qk_norm``, as Qwen3's);
- GELU-tanh gated MLP;
- queries scaled by ``query_pre_attn_scalar ** -0.5``;
- ``layer_types``: sliding-window layers attend to the last ``sliding_window`` positions
  and use their own RoPE base (``rope_local_theta``), unscaled; the others are global, with
  the checkpoint's RoPE scaling (``rope_scaling``: linear, factor 8, on the 4B and larger).

Tensor parallelism as in ``llama.py``; Gemma 3's one KV head is replicated on every rank,
and the logits are soft-capped on rank 0 after the gather.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import SINGLE, TPGroup
from pagedllm.distributed.sharding import ModelShard, shard_weights
from pagedllm.layers.activation import GeluTanhAndMul
from pagedllm.layers.attention import KVCache
from pagedllm.layers.attention_metadata import AttentionMetadata
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.llama import LlamaAttention
from pagedllm.models.weights import PACKED_MODULES_MAPPING, load_fused


class Gemma3MLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))`` (the rank's gate rows, then its up rows)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, shard: ModelShard, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * shard.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(shard.intermediate_size, config.hidden_size, bias=False, dtype=dtype)
        self.act = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; the activation in place in the gate half."""
        return self.tp.all_reduce(self.down_proj(self.act(self.gate_up_proj(x))))


class Gemma3DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ffw_norm(mlp(pre_ffw_norm(x)));
    the residual adds are fused into the input and pre-feedforward norms."""

    NATIVE_NORMS: ClassVar[dict[str, str]] = {
        "input_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
        "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm",
        "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
    }

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, shard: ModelShard, tp: TPGroup) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.is_sliding = config.layer_window(layer) > 0
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = LlamaAttention(config, layer, dtype, shard, tp, qk_norm=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = Gemma3MLP(config, dtype, shard, tp)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this block's normalized MLP output, residual stream before it)."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, attn_metadata)
        x, _ = self.post_attention_layernorm(x)
        x, residual = self.pre_feedforward_layernorm(x, residual)
        x, _ = self.post_feedforward_layernorm(self.mlp(x))
        return x, residual


class Gemma3ForCausalLM(CausalLM):
    """The Gemma 3 text decoder plus the (tied) lm_head (``CausalLM`` runs the step and the
    soft-capped logits).

    Args:
        config: hyper-parameters (``architecture`` "gemma3"), with ``layer_types``,
            ``sliding_window``, ``rope_local_theta`` and ``query_pre_attn_scalar``.
        dtype: dtype of weights and activations.
        tp: the tensor-parallel group: the module holds rank ``tp.rank``'s shard.
        max_model_len: the engine's longest request (``layers.rotary.rope_frequencies``).
    """

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = PACKED_MODULES_MAPPING
    NATIVE_GELU: ClassVar[bool] = True  # GeGLU

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, tp: TPGroup = SINGLE,
        max_model_len: int | None = None,
    ) -> None:
        if config.attn_logit_softcapping:
            raise ValueError("attention logit softcapping (Gemma 2) is not supported")
        if not config.tie_word_embeddings:
            raise ValueError("Gemma 3 ties its lm_head to the embeddings; this checkpoint has its own")
        super().__init__(config, dtype, tp)
        # transformers multiplies by the scale cast to the weights' dtype (25.25 in bfloat16).
        self.register_buffer(
            "embed_scale", torch.tensor(config.hidden_size**0.5, device="cpu").to(dtype), persistent=False
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, dtype, self.shard, tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = None  # tied: quantize_model and the spec-decode code look for it
        self.rotary_emb = RotaryEmbedding(
            config.rotary_dim, config.max_position_embeddings, config.rope_theta, dtype, config.rope_scaling,
            max_model_len,
        )
        if any(layer.is_sliding for layer in self.layers):
            local_base = config.rope_local_theta or config.rope_theta
            self.rotary_emb_local = RotaryEmbedding(
                config.rotary_dim, config.max_position_embeddings, local_base, dtype
            )
        self.requires_grad_(False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings scaled by sqrt(hidden_size) (in the model's dtype)."""
        return self.embed_tokens(input_ids) * self.embed_scale

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace all parameters with tensors named and valued as in transformers' Gemma3.

        Cuts each tensor to the rank's part as it is read, fuses q/k/v and gate/up; every
        ``*norm.weight`` becomes ``1 + weight`` (added in float32, then cast once). A missing
        or unexpected name raises.
        """
        load_fused(self, shard_weights(self._renamed(weights), self.config, self.tp), self.dtype)

    @staticmethod
    def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.").removeprefix("language_model.")
            if name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight":
                continue  # recomputed / tied to embed_tokens
            if name.endswith("norm.weight"):
                tensor = tensor.float() + 1
            yield name, tensor
