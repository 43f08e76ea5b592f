"""Configuration: the model's hyper-parameters and the engine's runtime settings."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from pagedllm.config_values import DTYPES, KV_CACHE_DTYPES, check_block_size, check_dtype, check_kv_cache_dtype
from pagedllm.default_model import DEFAULT_MODEL
from pagedllm.quantization_config import QuantizationConfig
from pagedllm.scheduler_defaults import MAX_NUM_BATCHED_TOKENS
from pagedllm.speculative_config import SpeculativeConfig

# The environment variable that sets ``EngineConfig.model_runner_cls`` where no caller passes it
# (a server, its engine core): tests name their fault-injecting runner with it.
MODEL_RUNNER_CLS_ENV = "PAGEDLLM_MODEL_RUNNER_CLS"


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, read from GGUF metadata or config.json."""

    architecture: str  # registry key: "llama" | "qwen2" | "qwen3" | "mistral" | "phi3" | "gemma3" | "qwen3_moe" | "mixtral"
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
    qk_norm: bool = False  # qwen3: RMSNorm (weight [head_dim]) over each query and key head before RoPE
    # RoPE scaling of the full-attention layers (Gemma 3's sliding ones run plain RoPE), in
    # transformers' rope parameters: rope_type ("linear" | "llama3" | "yarn" | "longrope" |
    # "dynamic") and its own keys (factor, original_max_position_embeddings, ...; dynamic's
    # original length set by the loaders), the base being ``rope_theta``; or a GGUF's
    # llama.cpp frequency factors (rope_type "freq_factors", layers/rotary.py). Empty: none.
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    # The leading dims of each q/k head RoPE rotates (partial rotary embeddings: HF's
    # int(head_dim * partial_rotary_factor), Phi-4-mini's 96 of 128; a GGUF's
    # rope.dimension_count), paired by rotate_half among themselves; the rest pass through
    # unrotated. None: the whole head (``__post_init__`` sets head_dim).
    rotary_dim: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    # Per-layer attention kind ("sliding_attention" | "full_attention"; empty: all full) and
    # the window (keys within the last ``sliding_window`` positions, query included): Gemma 3
    # mixes both kinds, Mistral and Phi-3 with a window set slide on every layer. Gemma 3's
    # sliding layers' own RoPE base, and its query scaling (scale = scalar ** -0.5).
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts (qwen3_moe, mixtral; 0 experts: dense): experts per MoE layer, the
    # ones each token runs (top-k of the router's softmax, renormalized to sum to 1 when
    # ``norm_topk_prob``), each expert's MLP width, and the layers with a dense MLP of
    # ``intermediate_size`` instead (Qwen3-MoE's ``mlp_only_layers`` and ``decoder_sparse_step``).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_mlp_layers: list[int] = field(default_factory=list)
    # The model creator's sampling defaults from generation_config.json (temperature, top_p,
    # top_k, min_p, repetition_penalty where they differ from transformers' defaults, and
    # max_new_tokens as max_tokens), applied as vLLM's ``--generation-config auto`` does: to the
    # fields a request leaves unset (max_tokens: a cap on every server request's output).
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Resolve ``rotary_dim``.

        Raises:
            ValueError: a rotary_dim that is odd, not positive or beyond head_dim.
        """
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"RoPE over {self.rotary_dim} dims of a {self.head_dim}-dim head: need an even count up to it")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether a layer's MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    def layer_window(self, layer: int) -> int:
        """The attention window of a layer in tokens; 0 for full attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention" and self.sliding_window:
            return self.sliding_window
        return 0


@dataclass
class EngineConfig:
    """Runtime settings of one engine instance (vLLM's flag names).

    Units: ``kv_cache_memory`` in bytes; ``max_num_batched_tokens`` is the per-step token budget.
    """

    model: str = DEFAULT_MODEL
    dtype: torch.dtype = torch.float32
    # dtype of the K/V caches; None: the model's dtype. dtype "auto" sets bfloat16 on the native
    # kernels (decode attention is bound by reading K/V, and half the bytes is twice the context
    # per GiB); on the PyTorch fallback it leaves None, as casting would cost a pass per layer.
    # torch.int8 or torch.float8_e4m3fn: 8-bit codes with a float16 scale per token and KV head
    # (core/kv_cache_config.py), about half bfloat16's bytes.
    kv_cache_dtype: torch.dtype | None = None
    max_model_len: int | None = None  # None: min(model's context, 8192)
    block_size: int = 16
    kv_cache_memory: int = 4 * 1024**3
    num_gpu_blocks_override: int | None = None  # exact block count, for tests
    max_num_seqs: int = 128
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS  # `serve`: SERVE_MAX_NUM_BATCHED_TOKENS
    long_prefill_token_threshold: int = 0  # most tokens one request computes per step; 0: no cap
    enable_prefix_caching: bool = True
    # Defaults of the sampling fields a request leaves unset: "auto", the HF checkpoint's
    # generation_config.json recommendations (ModelConfig.sampling_defaults); "vllm",
    # SamplingParams' own; or a folder, its generation_config.json's (vLLM's --generation-config).
    generation_config: str = "auto"
    seed: int = 0  # None (vLLM's LLM(seed=None)) is taken as 0, vLLM V1's default
    num_threads: int | None = None  # torch intra-op threads; None: all cores
    # Speculative decoding; a dict or JSON string in vLLM's shape is parsed. None: off.
    speculative_config: SpeculativeConfig | None = None
    # Quantization of the linear layers: "none" | "int8" | "int4" (weight-only) | "w8a8" |
    # "w4a8" (layers/quantization). dtype "auto" sets auto_linears()'s with the lm_head.
    quantization: str = "none"
    quantization_group_size: int = 32  # int4's group size: 32, 64 or 128
    quantize_lm_head: bool = False  # the logits matmul too (a tied embedding's lookup stays float)
    requantize_4bit: bool = True  # w4a8: False runs weights not stored as 4-bit blocks as w8a8 (auto)
    live_view: bool = False  # the core sends a StepRecord with every step (pagedllm.live_view)
    live_view_steps: int = 4096  # step records the front end keeps (a ring buffer)
    # Scale-out (pagedllm/executor, pagedllm/distributed): ranks splitting one model (Megatron-LM
    # style, torch.distributed); full replicas behind one front end (``pagedllm serve`` only);
    # where the ranks run: None = "uni" at one rank, else "mp" (local processes) | "ray" (actors).
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    ray_placement_strategy: str = "STRICT_PACK"  # or "SPREAD" (one bundle per rank)
    # How long a rank may keep the others waiting in a collective (a hung rank) before the step
    # fails with an engine error; a rank that exits fails the step at once.
    worker_timeout_s: float = 120.0
    # LoRA adapters (pagedllm/models/lora_adapter.py), vLLM's flags: requests may name an adapter;
    # at most max_loras distinct ones run in one step, of rank at most max_lora_rank; each rank
    # keeps max_cpu_loras loaded (None: max_loras), the least recently used dropped beyond.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # The adapters' A and B in memory: float32 or bfloat16 (None: the model's dtype). dtype
    # "auto" sets bfloat16 on the native kernels (docs/benchmarks.md, "LoRA adapters").
    lora_dtype: torch.dtype | None = None
    # "module:Class" of a ModelRunner subclass every rank runs instead of ModelRunner ("": none);
    # tests inject faults with one. Default: $PAGEDLLM_MODEL_RUNNER_CLS.
    model_runner_cls: str = field(default_factory=lambda: os.environ.get(MODEL_RUNNER_CLS_ENV, ""))

    def __post_init__(self) -> None:
        """Check every setting.

        Raises:
            ValueError: a setting out of its range, an integer setting that is not an int
                (``max_model_len="256"``), or a flag that is not a bool (``enable_lora="no"``,
                which is truthy); the message names the setting.
        """
        if self.seed is None:  # vLLM's EngineArgs take None for its V1 default, 0
            self.seed = 0
        for f in fields(self):  # the settings annotated int (or int | None), and the flags
            value = getattr(self, f.name)
            if f.type in ("int", "int | None") and not (value is None and f.type != "int") and (
                isinstance(value, bool) or not isinstance(value, int)
            ):
                raise ValueError(f"{f.name} must be an integer, got {value!r:.80}")
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be True or False, got {value!r:.80}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1 (None: all cores), got {self.num_threads}")
        if not -(2**63) <= self.seed < 2**63:  # torch.manual_seed's range
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.quantization_config()  # raises on a bad mode or group size
        if self.generation_config not in ("auto", "vllm") and not os.path.isfile(
            os.path.join(str(self.generation_config), "generation_config.json")
        ):
            raise ValueError(
                "generation_config must be auto, vllm or a folder holding a generation_config.json, "
                f"got {self.generation_config!r:.200}"
            )
        check_block_size(self.block_size)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be 0 (no cap) or positive, got {self.long_prefill_token_threshold}"
            )
        if self.live_view_steps < 1:
            raise ValueError(f"live_view_steps must be at least 1, got {self.live_view_steps}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size and data_parallel_size must be at least 1, got "
                f"{self.tensor_parallel_size} and {self.data_parallel_size}"
            )
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.tensor_parallel_size == 1 else "mp"
        if self.distributed_executor_backend not in ("uni", "mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend must be uni, mp or ray, got {self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("the uni executor runs one rank: use mp or ray for tensor_parallel_size > 1")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras and max_lora_rank must be at least 1, got {self.max_loras} and {self.max_lora_rank}"
            )
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.lora_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"lora_dtype must be float32 or bfloat16, got {self.lora_dtype}")
        if not self.worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be positive, got {self.worker_timeout_s}")
        if self.ray_placement_strategy not in ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"):
            raise ValueError(
                "ray_placement_strategy must be STRICT_PACK, PACK, SPREAD or STRICT_SPREAD, got "
                f"{self.ray_placement_strategy!r}"
            )
        if self.ray_placement_strategy != "STRICT_PACK" and self.distributed_executor_backend != "ray":
            raise ValueError(f"ray_placement_strategy {self.ray_placement_strategy} places Ray actors: it needs "
                             f"distributed_executor_backend ray, not {self.distributed_executor_backend}")

    @property
    def kv_dtype(self) -> torch.dtype:
        """The K/V caches' dtype."""
        return self.kv_cache_dtype or self.dtype

    def quantization_config(self) -> QuantizationConfig | None:
        """The quantization flags as one config; None when off."""
        return QuantizationConfig.parse(
            self.quantization, self.quantization_group_size, self.quantize_lm_head, self.requantize_4bit
        )


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype name (``config_values.DTYPES``: "auto", "bfloat16", "float32", ...) to a torch dtype.

    Raises:
        ValueError: for an unknown name, or a value that is neither a str nor a torch dtype.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, DTYPES[check_dtype(dtype)])


def parse_kv_cache_dtype(name: str | torch.dtype) -> torch.dtype | None:
    """Map a K/V cache dtype name to a torch dtype; None for "auto" (as the engine's dtype decides).

    Raises:
        ValueError: for an unknown name, or a value that is neither a str nor a torch dtype.
    """
    if isinstance(name, torch.dtype):
        return name
    name = check_kv_cache_dtype(name)
    return None if name == "auto" else getattr(torch, KV_CACHE_DTYPES.get(name) or DTYPES[name])
