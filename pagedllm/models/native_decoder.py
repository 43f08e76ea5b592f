"""Model steps in one native call (``csrc/decoder.cpp``): the Llama family (Llama, SmolLM2,
Qwen2, Qwen3, Mistral, Phi-3, and the mixtures of experts Qwen3-MoE and Mixtral) and Gemma 3.

At batch 1 a decode step is about 300 small kernels: 4 GEMVs, the norms, RoPE, the K/V write,
attention and the gated activation per layer. Called one at a time from the modules, the
Python, ctypes and argument checks around each cost as much as the kernel itself;
``kernels.decoder.decode_layers`` runs the same kernels in the same order from C++, so its outputs equal
the modules' bit for bit, for one call per step. Prefill chunks and speculative verification
(requests of several tokens) run in the same call beside the decodes. Models it does not cover,
and blocks larger than the prefill kernel takes in a step with such requests, run the modules.

A model opts in with two class attributes: its decoder layer's ``NATIVE_NORMS`` (which of
its norm modules fills which ``LayerDesc`` slot; a module that is None, as Llama's
q/k norms without ``qk_norm``, leaves the slot null) and its own ``NATIVE_GELU`` (the MLP's
activation: GELU-tanh, else SiLU).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from pagedllm.core.kv_cache_config import kv_row_width
from pagedllm.kernels import attention, library
from pagedllm.kernels.decoder import DecoderDesc, LayerDesc, LoRAStep, decode_layers
from pagedllm.kernels.lora import DTYPE_CODES as LORA_DTYPES
from pagedllm.kernels.lora import MAX_PARTS
from pagedllm.layers.attention import KVCache
from pagedllm.layers.attention_metadata import AttentionMetadata
from pagedllm.layers.lora import LoRABatch, LoRALinear


def _base(linear: nn.Module) -> nn.Module:
    """The base layer of a LoRA layer (the one-call decoder runs steps without adapters), else the layer."""
    return linear.base if isinstance(linear, LoRALinear) else linear


def _is_moe(mlp: nn.Module) -> bool:
    """Whether a layer's MLP is a mixture of experts (``layers/fused_moe.FusedMoE``)."""
    return hasattr(mlp, "native_block")


class NativeDecoder:
    """The model's weights and K/V caches as a ``DecoderDesc``, built once.

    Use :meth:`of`; the descriptor points into the model's own tensors (kept alive through
    ``model``), and into the K/V caches last passed to :meth:`__call__`.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        config, shard = model.config, model.shard
        self.layers = (LayerDesc * config.num_layers)()
        # Per layer: its qkv, o, gate_up and down LoRA layers (None: not one; empty: no LoRA layers).
        self.lora_linears: list[LoRALinear | None] = []
        self.lora_step = LoRAStep()
        self._lora_key: tuple | None = None
        self._lora_arrays: tuple[torch.Tensor, ...] = ()
        for desc, layer in zip(self.layers, model.layers, strict=True):
            for slot, path in type(layer).NATIVE_NORMS.items():
                parent, _, name = path.rpartition(".")
                norm = getattr(layer.get_submodule(parent), name)
                if norm is not None:
                    setattr(desc, slot, norm.weight.data_ptr())
            attn, mlp = layer.self_attn, layer.mlp
            desc.qkv, desc.o = _base(attn.qkv_proj).native_desc(), _base(attn.o_proj).native_desc()
            if _is_moe(mlp):
                desc.moe = ctypes.pointer(mlp.native_block().desc)
            else:
                desc.gate_up, desc.down = _base(mlp.gate_up_proj).native_desc(), _base(mlp.down_proj).native_desc()
            desc.window = getattr(attn, "window", 0)
            projections = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
            self.lora_linears += [m if isinstance(m, LoRALinear) else None for m in projections]
            desc.rope = int(getattr(layer, "is_sliding", False))
        self.desc = DecoderDesc(
            num_layers=config.num_layers,
            hidden=config.hidden_size,
            num_heads=shard.num_heads,
            num_kv_heads=shard.num_kv_heads,
            head_dim=config.head_dim,
            rotary_dim=config.rotary_dim,
            intermediate=shard.intermediate_size,
            gelu=int(type(model).NATIVE_GELU),
            eps=config.rms_norm_eps,
            scale=model.layers[0].self_attn.scale,
            layers=ctypes.cast(self.layers, ctypes.POINTER(LayerDesc)),
            final_norm=model.norm.weight.data_ptr(),
        )
        self.kv_caches: list[KVCache] | None = None
        self.layer_groups: list[int] = []

    @staticmethod
    def of(model: nn.Module) -> NativeDecoder | None:
        """The model's one-call decoder, or None where it does not apply: no native kernels,
        tensor parallelism (an all-reduce sits inside each layer), a dtype other than float32,
        a linear layer (or a mixture of experts' expert) not on our packed kernels, or heads the
        decode attention lacks."""
        shard = model.shard
        linears = [
            _base(m) for layer in model.layers
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)
            + (() if _is_moe(layer.mlp) else (layer.mlp.gate_up_proj, layer.mlp.down_proj))
        ]
        if (
            not library.available() or model.tp.size != 1 or model.dtype != torch.float32
            or not attention.decode_attention_supported(shard.num_heads, shard.num_kv_heads, model.config.head_dim)
            or not all(hasattr(m, "native_desc") for m in linears)
            or not all(layer.mlp.native_block() for layer in model.layers if _is_moe(layer.mlp))
        ):
            return None
        return NativeDecoder(model)

    def __call__(
        self,
        stream: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[KVCache],
        attn_metadata: list[AttentionMetadata],
        lora: LoRABatch | None = None,
        prompt_from: int | None = None,
    ) -> torch.Tensor | None:
        """The model's forward for a step: ``stream`` [T, hidden] its (scaled) embeddings,
        ``cos_sin`` the global and local RoPE tables' rows for its positions ([T, 2, 1,
        rotary_dim] each), ``lora`` the step's adapter runs (the model's LoRA layers'),
        ``prompt_from`` the first row of its prompt chunks (``CausalLM.forward``); the final
        hidden states, or None, with nothing computed, for a step the kernels cannot take
        (multi-token requests with blocks larger than ``kernels.attention.MAX_PREFILL_BLOCK``,
        caches they cannot read)."""
        # Layers of one KV cache group share one metadata object: number the groups by it.
        numbering: dict[int, int] = {}
        layer_groups = [numbering.setdefault(id(meta), len(numbering)) for meta in attn_metadata]
        metas = list({id(meta): meta for meta in attn_metadata}.values())
        if kv_caches is not self.kv_caches and not self._bind(kv_caches):
            return None
        prefills = metas[0].prefills
        if prefills and self.desc.block_size > attention.MAX_PREFILL_BLOCK:
            return None
        if layer_groups != self.layer_groups:
            for desc, group in zip(self.layers, layer_groups, strict=True):
                desc.group = group
            self.layer_groups, self.desc.num_groups = layer_groups, len(metas)
        self.desc.lora = self._lora(lora) if lora is not None and lora.segments else None
        return decode_layers(
            self.desc,
            stream,
            cos_sin,
            [meta.slot_mapping for meta in metas],
            [meta.decode_block_tables for meta in metas],
            metas[0].decode_seq_lens,
            [meta.prefill_block_tables for meta in metas] if prefills else None,
            metas[0].prefill_spans,
            prompt_from,
        )

    def _lora(self, lora: LoRABatch) -> ctypes.POINTER(LoRAStep):
        """The step's LoRA updates for the kernel, rebuilt when the runs' adapters or the
        installed adapters change (kept across decode steps of the same batch)."""
        key = (lora.key, lora.version)
        step = self.lora_step
        if key != self._lora_key:
            runs = len(lora.key)
            none = (torch.zeros(runs, dtype=torch.int64),) * 2 + (torch.zeros(runs, MAX_PARTS, dtype=torch.int64),)
            # Per projection: (A.T addresses, B.T addresses, ranks); zeros where no LoRA layer is.
            args = [none if m is None else m.native_args(lora.key) for m in self.lora_linears]
            self._lora_arrays = tuple(torch.cat([a[j] for a in args]) for j in range(3))
            step.num_runs = runs
            step.a, step.b, step.ranks = (t.data_ptr() for t in self._lora_arrays)
            step.dtype = LORA_DTYPES[lora.dtype]
            self._lora_key = key
        step.runs = lora.runs.data_ptr()  # the runs' lengths change as requests come and go
        return ctypes.pointer(step)

    def _bind(self, kv_caches: list[KVCache]) -> bool:
        """Point the layers at these caches; False where the kernels cannot read them."""
        first = kv_caches[0][0]
        if first.dtype not in attention.CACHE_DTYPES:
            return False
        for (k, v) in kv_caches:
            if not (k.shape == v.shape == first.shape and k.dtype == v.dtype == first.dtype):
                return False
            if not (k.is_contiguous() and v.is_contiguous() and k.device.type == v.device.type == "cpu"):
                return False
        if first.shape[2:] != (self.desc.num_kv_heads, kv_row_width(self.desc.head_dim, first.dtype)):
            return False
        for desc, layer, (k, v) in zip(self.layers, self.model.layers, kv_caches, strict=True):
            desc.k_cache, desc.v_cache = k.data_ptr(), v.data_ptr()
            qk_scale = layer.self_attn.qk_scale_for(k.dtype)
            desc.qk_scale = None if qk_scale is None else qk_scale.data_ptr()
        self.desc.block_size = first.shape[1]
        self.desc.cache_kind = attention.cache_kind(first.dtype)
        self.kv_caches = kv_caches
        return True
