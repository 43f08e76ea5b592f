"""GGUF files as models: metadata -> ModelConfig, tensor names -> HF's, tensors -> HF-named
float tensors (the file itself: ``gguf_file``). Tensors the model keeps as stored are not
dequantized at all (``gguf_weights``'s ``stored``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from pagedllm.config import ModelConfig
from pagedllm.layers.rotary import FREQ_FACTORS, check_rope_scaling, scaled_context
from pagedllm.models.gguf_file import GGUFFile, StringArray
from pagedllm.models.registry import QK_NORM, WINDOW_ON_EVERY_LAYER, check_architecture, gemma3_layer_types


# llama.cpp's converter permutes the q/k rows of these architectures (not qwen2's, qwen3's
# nor phi3's). It writes Mistral checkpoints as "llama" files (no sliding window, as
# llama.cpp runs them).
_PERMUTED_QK = {"llama", "mixtral"}
# Qwen2 chat models end a turn with <|im_end|> and a document with <|endoftext|>; HF's
# generation_config stops on both, while the GGUF names only one eos id.
_EXTRA_EOS = {
    "qwen2": ("<|im_end|>", "<|endoftext|>"),
    "qwen3": ("<|im_end|>", "<|endoftext|>"),
    "qwen3_moe": ("<|im_end|>", "<|endoftext|>"),
    "phi3": ("<|end|>", "<|endoftext|>"),
    "gemma3": ("<end_of_turn>",),
}
_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Mixtures of experts: the router, and every expert's projection stacked in one 3-D tensor
# [experts, rows, columns] (split into experts by models/moe.py).
_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# llama.cpp's architecture names that are not ours; its converter writes Mixtral as "llama"
# with experts (``llama.expert_count``).
_ARCHITECTURES = {"qwen3moe": "qwen3_moe"}
# Gemma 3 norms around attention and MLP: its ffn_norm is the pre-MLP norm, not Llama's
# post-attention one (which is the norm *after* attention here).
# Qwen3's q/k head norms; Phi-3's fused q/k/v and gate/up, split by the model's load_weights.
_PER_LAYER_ARCH = {
    "qwen3": {**_PER_LAYER, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "phi3": {**_PER_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "qwen3_moe": {**_PER_LAYER, **_EXPERTS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "mixtral": {**_PER_LAYER, **_EXPERTS},
    "gemma3": {
        **_PER_LAYER,
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }
}
# Gemma's RMSNorm multiplies by (1 + weight) in transformers; llama.cpp's converter stores
# weight + 1 in the GGUF. gguf_weights subtracts the one again, so every loader hands the
# model transformers' values (as transformers' own GGUF loader does).
_NORM_PLUS_ONE = {"gemma3"}
# llama.cpp's Gemma 3 (src/llama-model.cpp): 5 sliding-window layers then a global one
# (gemma3_layer_types), the sliding ones with RoPE base 10000; queries scaled by
# head_dim ** -0.5, except the 27B (62 layers), which uses hidden / heads as transformers'
# query_pre_attn_scalar.
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
# llama.cpp's RoPE frequency factors (Llama 3.1's RoPE as its converter writes it), and
# Phi-3's LongRoPE factors (its converter's ``generate_extra_tensors``): config, not weights.
_ROPE_FREQS = "rope_freqs.weight"
_LONGROPE = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}
_ROPE_TENSORS = frozenset((_ROPE_FREQS, *_LONGROPE.values()))
# llama.cpp's yarn settings and the values that leave its YaRN transformers' (ext factor -1:
# 1 for yarn); another value is refused.
_YARN_DEFAULTS = {
    "attn_factor": (1.0,), "yarn_attn_factor": (1.0,), "yarn_ext_factor": (-1.0, 1.0), "yarn_log_multiplier": (0.0,),
}


def gguf_config(f: GGUFFile, name: str = "") -> ModelConfig:
    """ModelConfig from the ``{arch}.*`` and ``tokenizer.ggml.*`` metadata.

    Raises:
        ValueError: unsupported architecture, partial rotary embeddings on an architecture
            whose q/k rows llama.cpp permutes (``_PERMUTED_QK``; rope.dimension_count otherwise
            is ``ModelConfig.rotary_dim``, llama.cpp's NEOX RoPE over the leading dims), or
            RoPE scaling other than linear, yarn, llama.cpp's frequency factors and Phi-3's
            LongRoPE factors (``_rope_scaling``).
    """
    md = f.metadata
    file_arch = md.get("general.architecture", "<missing>")
    arch = _ARCHITECTURES.get(file_arch, file_arch)
    arch = "mixtral" if arch == "llama" and md.get("llama.expert_count") else arch
    check_architecture(arch)

    def get(key: str, default: Any = None) -> Any:
        return md.get(f"{file_arch}.{key}", default)

    hidden, num_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    rotary_dim = int(get("rope.dimension_count", head_dim))
    if rotary_dim != head_dim and arch in _PERMUTED_QK:
        raise ValueError(
            f"partial rotary embeddings (rope.dimension_count < head_dim) on {file_arch} files are not supported "
            "(llama.cpp rotates their permuted q/k rows in pairs other than transformers')"
        )
    rope_scaling = _rope_scaling(f, get, rotary_dim)
    context = int(get("context_length"))
    eos = [int(md[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in md]
    extra = _EXTRA_EOS.get(arch)
    if extra and isinstance(md.get("tokenizer.ggml.tokens"), StringArray):
        found = f.find_strings(md["tokenizer.ggml.tokens"], set(extra))
        eos += [found[t] for t in extra if t in found]
    bos = md.get("tokenizer.ggml.bos_token_id")
    extra_fields: dict[str, Any] = {}
    window = int(get("attention.sliding_window", 0))
    if arch in WINDOW_ON_EVERY_LAYER and window > 0:
        extra_fields = {"layer_types": ["sliding_attention"] * int(get("block_count")), "sliding_window": window}
    if arch == "gemma3":
        num_layers = int(get("block_count"))
        extra_fields = {
            "layer_types": gemma3_layer_types(num_layers),
            "sliding_window": int(get("attention.sliding_window")),
            "rope_local_theta": _GEMMA3_LOCAL_ROPE_BASE,
            "query_pre_attn_scalar": float(hidden // num_heads if num_layers == 62 else head_dim),
            "attn_logit_softcapping": get("attn_logit_softcapping"),
            "final_logit_softcapping": get("final_logit_softcapping"),
        }
    if get("expert_count"):  # llama.cpp renormalizes the top-k weights of both (expert_weights_norm)
        num_layers = int(get("block_count"))
        extra_fields.update(
            num_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length", get("feed_forward_length"))),
            norm_topk_prob=bool(get("expert_weights_norm", True)),
            dense_mlp_layers=[i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in f.tensors],
        )
    return ModelConfig(
        architecture=arch,
        vocab_size=int(get("vocab_size", f.tensors["token_embd.weight"].shape[0])),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=scaled_context(context, rope_scaling, arch),
        tie_word_embeddings="output.weight" not in f.tensors,
        attention_bias="blk.0.attn_q.bias" in f.tensors,
        qk_norm=arch in QK_NORM,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=list(dict.fromkeys(eos)),
        name=name or str(md.get("general.name", "")),
        **extra_fields,
    )


def _rope_scaling(f: GGUFFile, get: Callable[..., Any], rotary_dim: int) -> dict[str, Any]:
    """``ModelConfig.rope_scaling`` of a GGUF, as llama.cpp reads it: a ``rope_freqs.weight``
    tensor (its converter's Llama 3.1 RoPE: each inverse frequency divided by its factor);
    ``rope_factors_long.weight`` and ``rope_factors_short.weight`` (Phi-3's longrope,
    ``_rope_factors``); ``rope.scaling.factor`` (or the older ``rope.scale_linear``; 0: none)
    linear unless ``rope.scaling.type`` is none (no scaling, as llama.cpp: the factor unused)
    or yarn, then with ``rope.scaling.original_context_length`` (default the context length)
    and llama.cpp's defaults, which are transformers' (beta_fast 32, beta_slow 1, attention
    factor 0.1 ln(factor) + 1).

    Raises:
        ValueError: another scaling type, frequency or LongRoPE factors with a scaling type,
            factors not one per rotated pair, or yarn's attention factor, ext factor or log
            multiplier set.
    """
    kind = get("rope.scaling.type", "linear")  # llama.cpp's default: a factor alone is linear
    factor = float(get("rope.scaling.factor", get("rope.scale_linear", 0.0))) or 1.0
    tensors = [name for name in (_ROPE_FREQS, *_LONGROPE.values()) if name in f.tensors]
    longrope = _LONGROPE["long_factor"] in f.tensors  # rope.scaling.type longrope: only beside them
    if kind not in ("none", "linear", "yarn", "longrope") or (kind == "longrope" and not longrope):
        raise ValueError(
            f"GGUF RoPE scaling {kind!r} is not supported (supported: rope.scaling.type none, linear or yarn; "
            f"factor tensors {_ROPE_FREQS} or {' and '.join(_LONGROPE.values())})"
        )
    if kind == "none":  # llama.cpp never scales then, whatever factor the file gives
        factor = 1.0
    if tensors:
        if kind == "yarn" or factor != 1.0:
            raise ValueError(f"RoPE factors ({', '.join(tensors)}) with rope.scaling.{kind} are not supported")
        return _rope_factors(f, get, rotary_dim, tensors)
    if kind != "yarn":
        return {} if factor == 1.0 else {"rope_type": "linear", "factor": factor}
    for key, values in _YARN_DEFAULTS.items():
        value = get(f"rope.scaling.{key}")
        if value is not None and float(value) not in values:
            raise ValueError(f"yarn with rope.scaling.{key}={value} is not supported")
    scaling = {
        "rope_type": "yarn", "factor": factor,
        "original_max_position_embeddings": int(get("rope.scaling.original_context_length", get("context_length"))),
    }
    for key in ("beta_fast", "beta_slow"):
        if get(f"rope.scaling.yarn_{key}") is not None:
            scaling[key] = float(get(f"rope.scaling.yarn_{key}"))
    check_rope_scaling(scaling)
    return scaling


def _rope_factors(f: GGUFFile, get: Callable[..., Any], rotary_dim: int, tensors: list[str]) -> dict[str, Any]:
    """``_rope_scaling`` of a file with RoPE factor tensors (``tensors``, those it has):
    llama.cpp's frequency factors, or Phi-3's long and short LongRoPE factors with
    ``rope.scaling.original_context_length`` (default the context length) and
    ``rope.scaling.attn_factor`` (absent: transformers' default from the two lengths), the
    factor set picked as for a checkpoint (``layers.rotary.rope_frequencies``).

    Raises:
        ValueError: both kinds, one LongRoPE set without the other, or factors not one per
            rotated pair.
    """
    if tensors not in ([_ROPE_FREQS], list(_LONGROPE.values())):
        raise ValueError(
            f"RoPE factor tensors {', '.join(tensors)} are not supported "
            f"({_ROPE_FREQS} alone, or {' and '.join(_LONGROPE.values())})"
        )
    if tensors == [_ROPE_FREQS]:
        scaling: dict[str, Any] = {"rope_type": FREQ_FACTORS}
        names = {FREQ_FACTORS: _ROPE_FREQS}
    else:
        scaling = {
            "rope_type": "longrope",
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length", get("context_length"))),
        }
        if get("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(get("rope.scaling.attn_factor"))
        names = _LONGROPE
    for key, name in names.items():
        factors = f.dequantize(name, torch.float32).flatten()
        if factors.numel() != rotary_dim // 2:
            raise ValueError(f"{name} has {factors.numel()} factors, not one per rotated pair ({rotary_dim // 2})")
        scaling[key] = factors.tolist()
    return scaling


def hf_name(gguf_name: str, arch: str = "") -> str:
    """GGUF tensor name -> HF name: ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    base, _, suffix = gguf_name.rpartition(".")
    try:
        if base.startswith("blk."):
            _, layer, part = base.split(".", 2)
            return f"model.layers.{layer}.{_PER_LAYER_ARCH.get(arch, _PER_LAYER)[part]}.{suffix}"
        return f"{_TOP_LEVEL[base]}.{suffix}"
    except (KeyError, ValueError):
        raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file") from None


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``permute`` (convert_hf_to_gguf.py): back to HF's rotate_half rows."""
    return w.view(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_rows(tensor: torch.Tensor, gguf_name: str, config: ModelConfig, arch: str | None = None) -> torch.Tensor:
    """A tensor of ``gguf_name`` with its rows (dim 0) in HF order: q/k rows of the
    architectures llama.cpp permutes are put back; any trailing dims (e.g. blocks) ride along.
    ``arch``: the file's ``general.architecture`` where it may differ from the model's (a LoRA
    adapter file for an HF checkpoint)."""
    if (arch or config.architecture) in _PERMUTED_QK:
        if ".attn_q." in gguf_name:
            return _unpermute(tensor, config.num_heads)
        if ".attn_k." in gguf_name:
            return _unpermute(tensor, config.num_kv_heads)
    return tensor


def gguf_weights(
    f: GGUFFile, config: ModelConfig, dtype: torch.dtype, num_workers: int = 1, stored: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in ``dtype``) for every tensor of the file, in file order.

    ``num_workers`` threads dequantize different tensors at once (torch ops release the GIL);
    meant to run with torch's intra-op parallelism off (see ``loader.load_model``). Tensors
    named in ``stored`` (GGUF names: layers the model then runs from the file's blocks) come
    as placeholders on the meta device, of their shape and dtype, nothing read.
    """
    arch = config.architecture
    # Reject unknown tensors before any work; RoPE's factors are config (gguf_config).
    names = {name: hf_name(name, arch) for name in f.tensors if name not in _ROPE_TENSORS}

    def load(name: str) -> tuple[str, torch.Tensor]:
        if name in stored:
            return names[name], torch.empty(f.tensors[name].shape, dtype=dtype, device="meta")
        if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            # Stored as weight + 1 (see _NORM_PLUS_ONE); left in float32, so the model's
            # own + 1 rounds once to its dtype.
            return names[name], f.dequantize(name, torch.float32) - 1
        return names[name], hf_rows(f.dequantize(name, dtype), name, config)

    with ThreadPoolExecutor(num_workers) as pool:
        yield from pool.map(load, names)
