"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3, Mistral, Phi-3) over flattened
tokens and a paged KV cache.

The variants are the same network driven by ``ModelConfig``:
- Qwen2: a bias on the q/k/v projections (``attention_bias``) and, for some checkpoints, an
  untied lm_head (``tie_word_embeddings``);
- Qwen3: no bias, an RMSNorm over each query and key head before RoPE (``qk_norm``), and a
  ``head_dim`` that need not be hidden / heads;
- Mistral, Phi-3: a sliding window on every layer when the checkpoint sets one
  (``layer_types``, ``sliding_window``); Phi-3 checkpoints store q/k/v and gate/up fused,
  split by :meth:`LlamaForCausalLM.load_weights` (``weights.unfuse``).

The projections are fused at load time: q/k/v into one ``qkv_proj``, gate/up into one
``gate_up_proj``, so a layer runs 4 matmuls instead of 7.

Tensor parallelism (Megatron-LM): ``qkv_proj`` and ``gate_up_proj`` hold the rank's heads /
features (column-parallel), ``o_proj`` and ``down_proj`` the matching inputs (row-parallel,
each followed by one all-reduce), embedding and lm_head the rank's vocabulary rows
(``distributed/sharding.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import SINGLE, TPGroup
from pagedllm.distributed.sharding import ModelShard, shard_weights
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import KVCache, PagedAttention
from pagedllm.layers.attention_metadata import AttentionMetadata
from pagedllm.layers.key_scales import applies, key_scales, qk_factors
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary import ApplyRotary, RotaryEmbedding
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.weights import PACKED_MODULES_MAPPING, load_fused, unfuse


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with RoPE, reading/writing the paged KV cache (the rank's heads).

    Args:
        layer: the layer's index, for its window (``config.layer_window``; 0: full attention).
        qk_norm: an RMSNorm over each query and key head before RoPE (``q_norm``, ``k_norm``,
            weights [head_dim]); else both are None.

    Queries are scaled by ``config.query_pre_attn_scalar ** -0.5``, or ``head_dim ** -0.5``.
    """

    def __init__(
        self, config: ModelConfig, layer: int, dtype: torch.dtype, shard: ModelShard, tp: TPGroup, qk_norm: bool
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim, self.rotary_dim = config.head_dim, config.rotary_dim
        self.q_size = shard.num_heads * config.head_dim
        self.qk_size = self.q_size + shard.num_kv_heads * config.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.window = config.layer_window(layer)
        self.qkv_proj = nn.Linear(
            config.hidden_size,
            self.qk_size + shard.num_kv_heads * config.head_dim,
            bias=config.attention_bias,
            dtype=dtype,
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.rotary = ApplyRotary()
        # An int8 cache's query and key channel factors [Hq + Hkv, head_dim] (set_key_scales).
        self.qk_scale: torch.Tensor | None = None
        self.attn = PagedAttention(shard.num_heads, shard.num_kv_heads, config.head_dim, self.scale, self.window)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """x: [T, hidden]; cos, sin: [T, 1, rotary_dim] (this layer's RoPE base). Returns [T, hidden]."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is None:
            qk = qkv[:, : self.qk_size].view(t, -1, self.head_dim)
        else:
            # Dense heads: the native RMSNorm reads contiguous rows (as the one-call decoder's does).
            q = self.q_norm(qkv[:, : self.q_size].reshape(t, self.num_heads, self.head_dim).contiguous())[0]
            k = self.k_norm(qkv[:, self.q_size : self.qk_size].reshape(t, -1, self.head_dim).contiguous())[0]
            qk = torch.cat([q, k], 1)
        # q and k heads side by side: one RoPE pass rotates both (and scales them for an int8 cache).
        qk = self.rotary(qk, cos, sin, self.qk_scale_for(kv_cache[0].dtype))
        v = qkv[:, self.qk_size :].view(t, self.num_kv_heads, self.head_dim)
        out = self.attn(qk[:, : self.num_heads], qk[:, self.num_heads :], v, kv_cache, attn_metadata)
        return self.tp.all_reduce(self.o_proj(out))

    def set_key_scales(self, k_weight: torch.Tensor, norm_weight: torch.Tensor) -> None:
        """Derive ``qk_scale`` from the key rows of ``qkv_proj`` (``k_weight`` [Hkv * head_dim,
        hidden], passed in: a weight kept as GGUF blocks has no float rows here), its bias, the
        attention input's RMSNorm weight and the key heads' norm weight, if any;
        ``layers/key_scales.py`` says why and how."""
        bias = self.qkv_proj.bias
        k_bias = None if bias is None else bias[self.q_size : self.qk_size]
        k_norm = None if self.k_norm is None else self.k_norm.weight
        scales = key_scales(k_weight, k_bias, norm_weight, self.num_kv_heads, k_norm, self.rotary_dim)
        self.qk_scale = qk_factors(scales, self.num_heads)

    def qk_scale_for(self, cache_dtype: torch.dtype) -> torch.Tensor | None:
        """The factors RoPE's output is multiplied by for a cache of this dtype, or None."""
        return self.qk_scale if self.qk_scale is not None and applies(cache_dtype) else None


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` (the rank's gate rows, then its up rows)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, shard: ModelShard, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * shard.intermediate_size, bias=False, dtype=dtype
        )
        self.down_proj = nn.Linear(shard.intermediate_size, config.hidden_size, bias=False, dtype=dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        # In place, in the gate half: no [T, intermediate] temporaries; down_proj reads strided rows.
        return self.tp.all_reduce(self.down_proj(self.act(self.gate_up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)), the adds fused into the norms."""

    NATIVE_NORMS: ClassVar[dict[str, str]] = {
        "input_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
        "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",  # None without qk_norm
    }

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, shard: ModelShard, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, layer, dtype, shard, tp, config.qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype, shard, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this block's MLP output, residual stream before it), both [T, hidden]."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, attn_metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLM):
    """The whole decoder plus the lm_head (``CausalLM`` runs the step and the logits).

    Args:
        config: hyper-parameters (``architecture`` "llama", "qwen2", "qwen3", "mistral" or "phi3").
        dtype: dtype of weights and activations (bfloat16 to serve, float32 for tests).
        tp: the tensor-parallel group: the module holds rank ``tp.rank``'s shard (sizes
            checked with ``sharding.check_tensor_parallel_size``).
        max_model_len: the engine's longest request, which picks a longrope RoPE's factors
            (``layers.rotary.rope_frequencies``); None: the model's context.

    Parameters are randomly initialized; :meth:`load_weights` replaces them (the loader
    builds the module on the meta device to skip that initialization).
    """

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = PACKED_MODULES_MAPPING
    NATIVE_GELU: ClassVar[bool] = False  # SwiGLU

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, tp: TPGroup = SINGLE,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__(config, dtype, tp)
        shard = self.shard
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, dtype, shard, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # Tied: the logits reuse embed_tokens.weight; there is no separate parameter.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, shard.vocab_rows, bias=False, dtype=dtype)
        )
        self.rotary_emb = RotaryEmbedding(
            config.rotary_dim, config.max_position_embeddings, config.rope_theta, dtype, config.rope_scaling,
            max_model_len,
        )
        self.requires_grad_(False)  # inference only: no autograd bookkeeping even outside inference_mode

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace all parameters with checkpoint tensors named as in HF transformers.

        Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` tensors are split into their projections
        first; each tensor is cut to the rank's part as it is read (whole tensors, as in the
        checkpoint, go in), then q/k/v and gate/up fused and cast to the model's dtype. A
        missing or unexpected name raises (ValueError for a fused projection's shard, else
        RuntimeError).
        """
        tied = self.lm_head is None
        wanted = (
            (name, tensor)
            for name, tensor in unfuse(((n.removeprefix("model."), t) for n, t in weights), self.config)
            # recomputed / tied to embed_tokens
            if not (name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"))
        )
        load_fused(self, shard_weights(wanted, self.config, self.tp), self.dtype)
