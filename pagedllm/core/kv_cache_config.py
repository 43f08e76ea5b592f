"""The KV cache's geometry, computed once at start-up and handed to every part that needs it.

The engine core sizes the pool from it, the scheduler's KV cache manager takes its groups,
each worker allocates its own share of the cache from it (with tensor parallelism a rank
holds the K/V of its own KV heads only, so a block is ``1 / tp`` of the bytes per rank when
the KV heads split, and the same budget buys ``tp`` times the blocks), the live view draws
its groups. Nothing recomputes it.

A block holds, per layer of a group, K and V rows of ``block_size`` slots x ``num_kv_heads``
heads. A head's row is ``head_dim`` values in the cache's dtype, or, in the 8-bit caches
(int8, fp8 e4m3), ``head_dim`` one-byte codes followed by the row's float16 scale
(``KV_SCALE_BYTES``; value = code x scale), so a block's bytes count its scales.

The scale's granularity is one per token and KV head, set when the row is written (its max
|x| over the largest code, 127 or e4m3's 448, rounded up to float16) and never changed. Why:
keys carry a few large channels and tokens differ in magnitude by orders (the first token's
keys, outliers), so a scale shared by a block or the whole tensor leaves most rows a handful of
codes, and a block scale would have to be raised, re-quantizing its earlier rows, when a later
token outgrows it; a per-row scale costs 2 bytes per ``head_dim`` (3% at 64) and keeps the
write a single pass. float16 rather than float32 halves that share (what it buys in requests
held: docs/benchmarks.md); its rounding, up and at most 2^-11 of the scale, is a twentieth of
an int8 code's step, and where it is coarser (a float16 subnormal: max|x| under 0.008) the
values are too small for the error to matter beside the row's neighbours.
The perplexity it keeps: docs/benchmarks.md ("An 8-bit KV cache").
"""

from __future__ import annotations

import logging
import os

import msgspec
import torch

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.core.kv_cache_groups import KVCacheGroup, kv_cache_groups, layers_per_block, max_request_tokens

logger = logging.getLogger("pagedllm")

# The 8-bit caches, and the bytes after each head's codes in their rows: its float16 scale
# (the kernels' PAGEDLLM_KV_SCALE_BYTES, pagedllm_abi.h; tests/test_kv_cache_8bit_kernels.py checks they agree).
QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)
KV_SCALE_BYTES = 2


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in one head's row of a cache: ``head_dim``, plus the scale's bytes
    in an 8-bit cache."""
    return head_dim + KV_SCALE_BYTES if dtype in QUANTIZED_KV_DTYPES else head_dim


class KVCacheConfig(msgspec.Struct, frozen=True):
    """One model's paged KV cache on one tensor-parallel rank (every rank has the same geometry).

    Attributes:
        num_blocks: blocks in the pool (shared by every group).
        block_size: token slots per block.
        groups: the KV cache groups (layers sharing a block table).
        num_layers: the model's layers.
        num_kv_heads: KV heads each rank stores (replicated heads counted once per rank).
        head_dim: elements per head.
        dtype: the caches' torch dtype, by name ("float32", "bfloat16", "float16", "int8",
            "float8_e4m3fn").
        max_model_len: the longest request (prompt + output, tokens) whose blocks fit.
        kv_limited: whether ``max_model_len`` is the pool's capacity, below the length asked
            for (``--max-model-len``, else the model's context).
    """

    num_blocks: int
    block_size: int
    groups: list[KVCacheGroup]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_model_len: int
    kv_limited: bool = False

    @classmethod
    def for_model(
        cls,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        tp_size: int = 1,
        max_model_len: int = 0,
        kv_limited: bool = False,
    ) -> KVCacheConfig:
        """The geometry of ``num_blocks`` blocks for ``model_config`` split over ``tp_size`` ranks."""
        return cls(
            num_blocks, block_size, kv_cache_groups(model_config), model_config.num_layers,
            kv_heads_per_rank(model_config, tp_size), model_config.head_dim, str(dtype).removeprefix("torch."),
            max_model_len, kv_limited,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def row_width(self) -> int:
        """Elements of ``torch_dtype`` per head and slot (``kv_row_width``)."""
        return kv_row_width(self.head_dim, self.torch_dtype)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block on one rank: K and V of ``block_size`` slots in each layer of a group."""
        return block_bytes(self.groups, self.block_size, self.num_kv_heads, self.head_dim, self.torch_dtype)

    @property
    def num_bytes(self) -> int:
        """Bytes of the whole cache on one rank."""
        return self.num_blocks * self.bytes_per_block


def block_bytes(
    groups: list[KVCacheGroup], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * layers_per_block(groups) * block_size * num_kv_heads * kv_row_width(head_dim, dtype) * elem


def kv_heads_per_rank(model_config: ModelConfig, tp_size: int) -> int:
    """KV heads one rank holds: its share, or one replicated head when ``tp_size`` exceeds their count."""
    return max(1, model_config.num_kv_heads // tp_size)


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The engine's max_model_len: the user's value, else the model's context capped at 8192.

    Raises:
        ValueError: if the user's value exceeds the model's context length.
    """
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return min(limit, 8192)
    if not 0 < config.max_model_len <= limit:
        raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {config.max_model_len}")
    return config.max_model_len


def create_kv_cache_config(config: EngineConfig, model_config: ModelConfig) -> KVCacheConfig:
    """The geometry an engine with ``config`` serving ``model_config`` uses.

    The block count is ``config.kv_cache_memory`` (bytes per rank) over one rank's bytes per
    block, or ``config.num_gpu_blocks_override``. A ``config.max_model_len`` longer than the
    blocks hold is lowered to what they hold, with a warning.

    Raises:
        ValueError: if the budgets of the engine cores and ranks on this machine exceed its memory
            (they could not be allocated: a typo such as 2TiB for 2GiB would exhaust the memory),
            the budget cannot hold one token in every group, or max_model_len is too long.
    """
    groups = kv_cache_groups(model_config)
    heads = kv_heads_per_rank(model_config, config.tensor_parallel_size)
    dtype = config.kv_dtype
    num_blocks = config.num_gpu_blocks_override
    if num_blocks is None:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        # Every data-parallel engine core and local tensor-parallel rank holds a budget of its own.
        local = config.data_parallel_size * (1 if config.distributed_executor_backend == "ray" else
                                             config.tensor_parallel_size)
        if config.kv_cache_memory * local > physical:
            raise ValueError(
                f"kv_cache_memory {config.kv_cache_memory / 1024**3:.1f} GiB per rank x {local} rank(s) and engine "
                f"core(s) on this machine exceeds its memory, {physical / 1024**3:.1f} GiB: lower --kv-cache-memory"
            )
        num_blocks = config.kv_cache_memory // block_bytes(groups, config.block_size, heads, model_config.head_dim, dtype)
    wanted = resolve_max_model_len(config, model_config)
    max_len = max_request_tokens(groups, num_blocks, config.block_size, config.max_num_batched_tokens, wanted)
    if max_len < 1:
        raise ValueError(
            f"kv_cache_memory {config.kv_cache_memory} bytes ({num_blocks} KV blocks) cannot hold one token "
            f"in every KV cache group ({len(groups)} groups)"
        )
    if config.max_model_len is not None and max_len < wanted:
        logger.warning(
            "max_model_len %d does not fit in the KV cache (%d blocks): requests are limited to %d tokens; "
            "raise kv_cache_memory (--kv-cache-memory) or lower max_model_len (--max-model-len)",
            wanted, num_blocks, max_len,
        )
    return KVCacheConfig.for_model(
        model_config, num_blocks, config.block_size, dtype, config.tensor_parallel_size, max_len, max_len < wanted
    )
