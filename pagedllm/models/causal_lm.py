"""What the decoder-only models share: the (vocabulary-parallel) embedding, the step over
the layers with the one-call native decode where it applies, and the logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.distributed.sharding import ModelShard
from pagedllm.layers.attention import KVCache
from pagedllm.layers.attention_metadata import AttentionMetadata
from pagedllm.layers.lora import LoRABatch
from pagedllm.layers.quantization.linear import prompt_rows
from pagedllm.layers.vocab_parallel import VocabParallelEmbedding, gather_logits
from pagedllm.models.native_decoder import NativeDecoder


class CausalLM(nn.Module):
    """A decoder-only model over flattened tokens and a paged KV cache.

    Builds ``embed_tokens`` (rank ``tp.rank``'s vocabulary rows under tensor parallelism);
    a subclass builds ``layers`` (each called as ``layer(x, residual, cos, sin, kv_cache,
    meta)`` and returning ``(x, residual)``; a layer with ``is_sliding`` true takes the local
    RoPE table), ``norm`` (the final RMSNorm), ``lm_head`` (None: tied to the embedding),
    ``rotary_emb`` and, where sliding-window layers have their own RoPE base,
    ``rotary_emb_local``; it may override :meth:`embed`.

    Args:
        config: hyper-parameters; dtype: of weights and activations; tp: the tensor-parallel group.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.shard = shard = ModelShard.of(config, tp)
        embedding = torch.empty(shard.vocab_rows, config.hidden_size, dtype=dtype)
        if not embedding.is_meta:  # nn.Embedding's own normal_ on meta imports torch._dynamo: 1.5 s
            nn.init.normal_(embedding)
        self.embed_tokens = (
            nn.Embedding.from_pretrained(embedding)
            if tp.size == 1
            else VocabParallelEmbedding(embedding, shard.vocab_start, tp)
        )
        self.rotary_emb_local: nn.Module | None = None
        # Decode-only steps in one native call, built on the first such step (after loading
        # and quantization have put the final layers in place); False: never (tests compare).
        self.native_decoder: NativeDecoder | None | bool = None
        # The step's LoRA adapter runs where LoRA layers are installed (``models/lora_model.py``).
        self.lora_batch: LoRABatch | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden_size] inputs of the first layer."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: list[AttentionMetadata],
        prompt_from: int | None = None,
    ) -> torch.Tensor:
        """One step over all scheduled tokens of all requests, flattened.

        Args:
            input_ids: [T] int64 token ids.
            positions: [T] int64 position of each token in its sequence.
            kv_caches: one (k_cache, v_cache) per layer (layers may share tensors), each
                [num_blocks, block_size, num_kv_heads, head_dim] in the model's dtype.
            attn_metadata: per layer, the step's paged-attention metadata (layers of one
                KV cache group share one; see ``worker/kv_cache.build_attention_metadata``).
            prompt_from: the first of the trailing rows that are prompt chunks, which linear
                layers with a prompt kernel (``layers.quantization.linear.prompt_rows``) compute
                on it; None: none.

        Returns:
            [T, hidden_size] final hidden states (after the last norm), in the model's dtype.
        """
        if self.native_decoder is None:
            self.native_decoder = NativeDecoder.of(self) or False
        x = self.embed(input_ids)
        if self.native_decoder:
            tables = self.rotary_emb.cos_sin[positions]
            local = tables if self.rotary_emb_local is None else self.rotary_emb_local.cos_sin[positions]
            hidden = self.native_decoder(x, (tables, local), kv_caches, attn_metadata, self.lora_batch, prompt_from)
            if hidden is not None:
                return hidden
        cos_sin = self.rotary_emb(positions)
        cos_sin_local = cos_sin if self.rotary_emb_local is None else self.rotary_emb_local(positions)
        residual = None
        with prompt_rows(prompt_from):
            for layer, kv_cache, meta in zip(self.layers, kv_caches, attn_metadata, strict=True):
                cos, sin = cos_sin_local if getattr(layer, "is_sliding", False) else cos_sin
                x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[S, hidden_size] -> [S, vocab_size] float32 logits, soft-capped where the config says
        so; with tensor parallelism every rank calls it with the same rows, and only rank 0
        gets the logits (the others None)."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()  # a quantized lm_head is a module of its own
        if self.tp.size > 1:
            logits = gather_logits(logits, self.config.vocab_size, self.shard.vocab_padded, self.tp)
            if logits is None:
                return None
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
