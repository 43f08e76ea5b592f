"""Architecture name (GGUF ``general.architecture`` / HF ``model_type``) -> model class."""

from __future__ import annotations

from torch import nn

from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.moe import MoEForCausalLM

# Qwen2 (q/k/v biases), Qwen3 (q/k head norms), Mistral and Phi-3 (sliding windows; Phi-3's
# fused checkpoint tensors) are Llama's class, driven by ModelConfig (see llama.py).
_MODELS: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    # Llama's class with mixture-of-experts MLPs (see moe.py).
    "qwen3_moe": MoEForCausalLM,
    "mixtral": MoEForCausalLM,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)

# Architectures whose sliding window, when the checkpoint sets one, applies to every layer
# (transformers' Mistral, Mixtral and Phi-3, llama.cpp's Phi-3; Qwen2/Qwen3 switch theirs on
# with ``use_sliding_window``, which the loaders refuse).
WINDOW_ON_EVERY_LAYER = frozenset({"mistral", "mixtral", "phi3"})
# Architectures whose transformers model rotates only the leading partial_rotary_factor of
# each head (Phi-3's apply_rotary_pos_emb; ``ModelConfig.rotary_dim``); the others' rotate the
# whole head, and fail on a factor below 1: the HF loader refuses one for them.
PARTIAL_ROTARY = frozenset({"phi3"})
# Architectures with q/k head norms (``ModelConfig.qk_norm``).
QK_NORM = frozenset({"qwen3", "qwen3_moe"})
# Architectures whose ``attention_bias`` puts a bias on o_proj as well as on q/k/v (transformers'
# Llama, Qwen3, Qwen3-MoE, Gemma 3; Qwen2's is q/k/v only). The model classes have no o_proj
# bias: the loaders refuse these.
O_PROJ_BIAS = frozenset({"llama", "qwen3", "qwen3_moe", "gemma3"})
# Gemma 3's sliding_window_pattern where the checkpoint gives none: 5 sliding-window layers,
# then a global one (transformers' Gemma3TextConfig default, llama.cpp's).
_GEMMA3_SLIDING_WINDOW_PATTERN = 6


def check_architecture(arch: str) -> None:
    """Raise ValueError if ``arch`` has no model class."""
    if arch not in _MODELS:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def mlp_activation(arch: str) -> tuple[str, str]:
    """The MLP activation ``arch``'s model class computes, as config.json names it: (its key,
    its value). Gemma 3's GELU-tanh, else SiLU."""
    return ("hidden_activation", "gelu_pytorch_tanh") if arch == "gemma3" else ("hidden_act", "silu")


def gemma3_layer_types(num_layers: int, pattern: int | None = None) -> list[str]:
    """Gemma 3's ``layer_types`` from its ``sliding_window_pattern`` (None: the default 6), as
    transformers derives them: every ``pattern``-th layer (1-based) is ``full_attention``, the
    rest ``sliding_attention``."""
    pattern = int(pattern or _GEMMA3_SLIDING_WINDOW_PATTERN)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def get_model_class(arch: str) -> type[nn.Module]:
    """The model class for an architecture name.

    Raises:
        ValueError: naming the supported architectures, for an unknown one.
    """
    check_architecture(arch)
    return _MODELS[arch]
