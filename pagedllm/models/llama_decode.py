"""Decode steps of a Llama-family model in one native call (``csrc/decoder.cpp``).

At batch 1 a decode step is about 300 small kernels: 4 GEMVs, 2 norms, RoPE, the K/V write,
attention and SiLU-and-mul per layer. Called one at a time from the modules, the Python,
ctypes and argument checks around each cost as much as the kernel itself; ``llama_decode``
runs the same kernels in the same order from C++, so its outputs equal the modules' bit for
bit, for one call per step. Steps with prefill tokens, and models it does not cover, run
the modules.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from pagedllm.kernels import ops
from pagedllm.layers.attention import AttentionMetadata, KVCache

if TYPE_CHECKING:
    from pagedllm.models.llama import LlamaForCausalLM


class NativeDecoder:
    """The model's weights and K/V caches as ``ops.DecoderDesc``, built once.

    Use :meth:`of`; the descriptor points into the model's own tensors (kept alive through
    ``model``), and into the K/V caches last passed to :meth:`__call__`.
    """

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        config, shard = model.config, model.shard
        self.layers = (ops.LayerDesc * config.num_layers)()
        for desc, layer in zip(self.layers, model.layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            desc.input_norm = layer.input_layernorm.weight.data_ptr()
            desc.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            desc.qkv, desc.o = attn.qkv_proj.native_desc(), attn.o_proj.native_desc()
            desc.gate_up, desc.down = mlp.gate_up_proj.native_desc(), mlp.down_proj.native_desc()
        self.desc = ops.DecoderDesc(
            num_layers=config.num_layers,
            hidden=config.hidden_size,
            num_heads=shard.num_heads,
            num_kv_heads=shard.num_kv_heads,
            head_dim=config.head_dim,
            intermediate=shard.intermediate_size,
            eps=config.rms_norm_eps,
            scale=config.head_dim**-0.5,
            layers=ctypes.cast(self.layers, ctypes.POINTER(ops.LayerDesc)),
            final_norm=model.norm.weight.data_ptr(),
        )
        self.kv_caches: list[KVCache] | None = None

    @staticmethod
    def of(model: LlamaForCausalLM) -> NativeDecoder | None:
        """The model's one-call decoder, or None where it does not apply: no native kernels,
        tensor parallelism (an all-reduce sits inside each layer), a dtype other than float32,
        a linear layer not on our packed kernels, or heads the decode attention lacks."""
        shard = model.shard
        linears = [
            m for layer in model.layers
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        ]
        if (
            not ops.available() or model.tp.size != 1 or model.dtype != torch.float32
            or not ops.decode_attention_supported(shard.num_heads, shard.num_kv_heads, model.config.head_dim)
            or not all(hasattr(m, "native_desc") for m in linears)
        ):
            return None
        return NativeDecoder(model)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: list[AttentionMetadata],
    ) -> torch.Tensor | None:
        """``LlamaForCausalLM.forward`` for a step of decode tokens only (its arguments and
        result); None, with nothing computed, for any other step."""
        meta = attn_metadata[0]
        if meta.num_decodes != input_ids.shape[0] or any(m is not meta for m in attn_metadata):
            return None
        if kv_caches is not self.kv_caches and not self._bind(kv_caches):
            return None
        model = self.model
        return ops.llama_decode(
            self.desc,
            model.embed_tokens(input_ids),
            model.rotary_emb.cos_sin[positions],
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_seq_lens,
        )

    def _bind(self, kv_caches: list[KVCache]) -> bool:
        """Point the layers at these caches; False where the kernels cannot read them."""
        first = kv_caches[0][0]
        if first.dtype not in (torch.float32, torch.bfloat16):
            return False
        for (k, v) in kv_caches:
            if not (k.shape == v.shape == first.shape and k.dtype == v.dtype == first.dtype):
                return False
            if not (k.is_contiguous() and v.is_contiguous() and k.device.type == v.device.type == "cpu"):
                return False
        if first.shape[2:] != (self.desc.num_kv_heads, self.desc.head_dim):
            return False
        for desc, (k, v) in zip(self.layers, kv_caches, strict=True):
            desc.k_cache, desc.v_cache = k.data_ptr(), v.data_ptr()
        self.desc.block_size = first.shape[1]
        self.desc.cache_bf16 = int(first.dtype == torch.bfloat16)
        self.kv_caches = kv_caches
        return True
