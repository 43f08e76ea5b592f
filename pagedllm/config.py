"""Configuration: the model's hyper-parameters and the engine's runtime settings."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, read from GGUF metadata or config.json."""

    architecture: str  # registry key: "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # qwen2: bias on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""


@dataclass
class EngineConfig:
    """Runtime settings of one engine instance (vLLM's flag names).

    Units: ``kv_cache_memory`` in bytes; ``max_num_batched_tokens`` is the per-step token budget.
    """

    model: str = DEFAULT_MODEL
    dtype: torch.dtype = torch.bfloat16
    max_model_len: int | None = None  # None: min(model's context, 8192)
    block_size: int = 16
    kv_cache_memory: int = 4 * 1024**3
    num_gpu_blocks_override: int | None = None  # exact block count, for tests
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None: all cores

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")


_DTYPES = {
    "auto": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype name ("auto", "bfloat16", "float32", ...) to a torch dtype.

    Raises:
        ValueError: for an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}") from None


def parse_memory(value: str | int | float) -> int:
    """Parse a memory size: bytes as a number, or with a unit ("4GiB", "512MiB", "2G").

    Raises:
        ValueError: when the value cannot be parsed or is not positive.
    """
    if isinstance(value, (int, float)):
        return int(value)
    units = {"k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
    s = value.strip().lower().removesuffix("b").removesuffix("i")
    try:
        if s and s[-1] in units:
            return int(float(s[:-1]) * units[s[-1]])
        return int(float(s))
    except ValueError:
        raise ValueError(f"cannot parse memory size {value!r}; use e.g. 4GiB or 512MiB") from None
