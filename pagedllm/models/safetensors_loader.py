"""HF checkpoint directories: config.json -> ModelConfig, *.safetensors -> HF-named tensors."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pagedllm.config import ModelConfig
from pagedllm.errors import InvalidParamError
from pagedllm.layers.rotary import check_rope_scaling, scaled_context
from pagedllm.models.registry import (
    O_PROJ_BIAS, PARTIAL_ROTARY, QK_NORM, WINDOW_ON_EVERY_LAYER, check_architecture, gemma3_layer_types, mlp_activation,
)
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


def _ids(value: Any) -> list[int]:
    """A token id field (int, list of ints or null) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def hf_config(model_dir: Path, name: str = "") -> ModelConfig:
    """ModelConfig from ``config.json`` (eos ids from ``generation_config.json`` when present).

    Raises:
        ValueError: unsupported architecture, RoPE scaling other than linear, llama3, yarn,
            longrope and dynamic (``layers.rotary.ROPE_SCALING_TYPES``; any on Gemma 3's
            sliding layers), partial rotary embeddings other than Phi-3's (``PARTIAL_ROTARY``;
            an odd rotated count: ``ModelConfig``), Qwen's ``use_sliding_window``, an MLP
            bias, an o_proj bias (``attention_bias`` beyond Qwen2's q/k/v, ``O_PROJ_BIAS``), or
            an MLP activation other than the architecture's (``hidden_act``, Gemma 3's
            ``hidden_activation``).
    """
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg) if cfg.get("model_type") == "gemma3" else cfg  # the multimodal wrapper
    arch = cfg.get("model_type", "<missing>")
    arch = "gemma3" if arch == "gemma3_text" else arch
    check_architecture(arch)
    # transformers >= 5 nests rope settings in rope_parameters (per layer kind for Gemma 3);
    # older files use rope_theta/rope_scaling. A file with both (a rope_scaling added to a
    # transformers 5 config.json, as Qwen2.5's long-context instructions have it) is read as
    # transformers' convert_rope_params_to_dict reads it: rope_scaling replaces the rope
    # parameters (Gemma 3: it updates its global layers'), and their own rope_theta comes first.
    rope = cfg.get("rope_parameters") or {}
    kinds = dict(rope) if "full_attention" in rope else {"full_attention": rope}
    kinds = {kind: params or {} for kind, params in kinds.items()}  # a kind saved as null: plain RoPE
    if cfg.get("rope_scaling"):
        old = cfg["rope_scaling"]
        kinds["full_attention"] = kinds["full_attention"] | old if arch == "gemma3" else old

    def rotated(params: dict[str, Any]) -> float:
        """A kind's partial_rotary_factor as transformers reads it: its parameters', else the top level's."""
        return float(params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)

    if arch not in PARTIAL_ROTARY and any(rotated(kind) != 1.0 for kind in kinds.values()):
        raise ValueError(
            f"partial rotary embeddings (partial_rotary_factor < 1) on {arch} are not supported "
            f"(transformers' {arch} rotates the whole head; supported on {', '.join(sorted(PARTIAL_ROTARY))})"
        )
    rope_scaling = _rope_scaling(kinds["full_attention"], cfg)
    if _rope_scaling(kinds.get("sliding_attention", {}), cfg):
        raise ValueError("RoPE scaling of the sliding-window layers is not supported")
    if cfg.get("use_sliding_window") or cfg.get("mlp_bias"):
        raise ValueError("sliding-window attention and MLP biases are not supported")
    if cfg.get("attention_bias") and arch in O_PROJ_BIAS:
        raise ValueError(f"attention_bias on {arch} (a bias on o_proj as well as q/k/v) is not supported")
    act_key, act = mlp_activation(arch)
    if cfg.get(act_key, act) != act:
        raise ValueError(f"unsupported activation {act_key}={cfg[act_key]!r}: only {act} is supported for {arch}")
    eos = _ids(cfg.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    eos = _ids(generation.get("eos_token_id")) or eos
    hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // num_heads
    full = kinds["full_attention"]
    extra: dict[str, Any] = {}
    if arch in WINDOW_ON_EVERY_LAYER and cfg.get("sliding_window"):
        extra = dict(
            layer_types=["sliding_attention"] * cfg["num_hidden_layers"], sliding_window=int(cfg["sliding_window"])
        )
    if arch == "gemma3":
        local = kinds.get("sliding_attention", {})
        extra = dict(
            # Google's first Gemma 3 configs give sliding_window_pattern instead of layer_types.
            layer_types=list(
                cfg.get("layer_types") or gemma3_layer_types(cfg["num_hidden_layers"], cfg.get("sliding_window_pattern"))
            ),
            sliding_window=cfg.get("sliding_window"),
            rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )
    if arch in ("qwen3_moe", "mixtral"):
        extra.update(_moe_fields(cfg, arch))
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rotary_dim=int(head_dim * rotated(full)),
        # transformers' defaults where neither is set: Gemma 3's global layers 1e6, else 1e4.
        rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1e6 if arch == "gemma3" else 10000.0))),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        max_position_embeddings=scaled_context(cfg["max_position_embeddings"], rope_scaling, arch),
        # Gemma 3 always ties its lm_head; its config.json may leave the field out.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),  # Qwen2 always has q/k/v bias
        qk_norm=arch in QK_NORM,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        name=name or model_dir.name,
        sampling_defaults=sampling_defaults(generation, gen_path),
        **extra,
    )


def _rope_scaling(params: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig.rope_scaling`` of one layer kind's rope parameters (an old ``rope_scaling``
    or transformers 5's ``rope_parameters``), standardized as transformers'
    ``standardize_rope_params`` does: ``type`` read as ``rope_type``, llama3's, yarn's and
    longrope's ``original_max_position_embeddings`` from the top level of config.json where
    Phi-3's sets it (transformers reads no other architecture's there), else the parameters',
    else ``max_position_embeddings``. Dynamic's is ``max_position_embeddings`` (the length
    transformers' dynamic NTK scales from; ModelConfig's is the scaled context). Empty for
    plain RoPE.

    Raises:
        ValueError: a type not in ``ROPE_SCALING_TYPES``, or one missing its keys.
    """
    rope_type = params.get("rope_type", params.get("type", "default"))
    skip = {"type", "rope_type", "rope_theta", "partial_rotary_factor"}
    scaling = {"rope_type": rope_type} | {k: v for k, v in params.items() if k not in skip}
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers reads a top-level one only where the config class has the attribute (Phi-3's).
        original = cfg.get("original_max_position_embeddings") if cfg.get("model_type") == "phi3" else None
        scaling["original_max_position_embeddings"] = original or scaling.get(
            "original_max_position_embeddings", cfg["max_position_embeddings"]
        )
    if rope_type == "dynamic":
        scaling["original_max_position_embeddings"] = cfg["max_position_embeddings"]
    if rope_type == "yarn" and scaling.get("factor") is None:  # transformers' (DeepSeek-V3's) fallback
        scaling["factor"] = cfg["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    check_rope_scaling(scaling)
    return {} if rope_type == "default" else scaling


# The generation_config.json fields vLLM reads as sampling defaults (``get_diff_sampling_param``).
# Every value the file states is read, transformers' own default included: vLLM reads the file's
# ``GenerationConfig.to_diff_dict()``, and transformers (5.x) defaults these fields to None, so an
# explicit ``"temperature": 1.0`` or ``"top_p": 1.0`` is a recommendation as any other value is.
_GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def sampling_defaults(generation: dict[str, Any], path: Path | str = "generation_config.json") -> dict[str, float | int]:
    """The sampling defaults a ``generation_config.json`` recommends, as vLLM's
    ``ModelConfig.get_diff_sampling_param`` reads them: temperature, top_p, top_k, min_p,
    repetition_penalty and max_new_tokens (as ``max_tokens``: vLLM's server-wide cap on output
    tokens) wherever the file sets them (not null), a value equal to transformers' old default
    (temperature 1.0, top_p 1.0, top_k 50) included; ``do_sample`` and ``max_length`` are not
    read, as vLLM. A value outside its SamplingParams range, or of another type, is dropped
    with a warning rather than failing every request that leaves the field unset."""
    defaults: dict[str, float | int] = {}
    for key in _GENERATION_FIELDS:
        value = generation.get(key)
        if value is None:
            continue
        name = "max_tokens" if key == "max_new_tokens" else key
        try:
            SamplingParams(**{name: value})
            if name == "max_tokens" and value < 1:
                raise InvalidParamError(name, f"max_new_tokens must be at least 1, got {value}")
        except (InvalidParamError, TypeError) as e:
            logger.warning("%s: %s=%r is not a valid default, ignored: %s", path, key, value, e)
            continue
        defaults[name] = value
    return defaults


def _moe_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from a Qwen3-MoE or Mixtral config.json.

    Mixtral always renormalizes its top-k weights and has no dense layers; Qwen3-MoE's dense
    layers are ``mlp_only_layers`` and those off its ``decoder_sparse_step``.
    """
    layers = cfg["num_hidden_layers"]
    if arch == "mixtral":
        return dict(
            num_experts=int(cfg["num_local_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
        )
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
    return dict(
        num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        dense_mlp_layers=[i for i in range(layers) if i in dense or (i + 1) % step],
    )


def hf_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of every ``*.safetensors`` file in the directory.

    Raises:
        ValueError: no such file, or one that is not safetensors (truncated, corrupt), named.
    """
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    yield key, f.get_tensor(key)
        except SafetensorError as e:
            raise ValueError(f"{path} is not a readable safetensors file: {e}") from None
