"""LoRA adapters (PEFT folders, llama.cpp GGUF files) read and checked against a base model,
and cut to a rank's shard.

A folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ...) and
``adapter_model.safetensors`` with, per targeted projection, ``...layers.{i}.{self_attn|mlp}.
{proj}.lora_A.weight`` [r, in_features] and ``lora_B.weight`` [out_features, r]. The
projection's output gains ``scale * (x @ A.T) @ B.T`` with ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA); ``rank_pattern`` / ``alpha_pattern`` give some
modules their own r / alpha. Targets: q/k/v/o and gate/up/down projections, and Phi-3's
fused ``qkv_proj`` / ``gate_up_proj`` (its B split like the fused weight). A GGUF LoRA file
(``read_adapter``) holds the same A and B per projection under the base GGUF's tensor names.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pagedllm.config import ModelConfig
from pagedllm.distributed.sharding import ModelShard
from pagedllm.errors import LoRAError
from pagedllm.models.gguf_file import GGUFFile
from pagedllm.models.gguf_loader import hf_name, hf_rows
from pagedllm.models.weights import STACKED

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# HF projection -> (our module, its part index): the unfused ones from the fused table, the
# rest whole.
_TARGETS: dict[str, tuple[str, int]] = STACKED | {"o_proj": ("o_proj", 0), "down_proj": ("down_proj", 0)}
_FUSED_HF = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_GGUF_KEY = re.compile(r"(blk\.(\d+)\.\w+\.weight)\.lora_([ab])")  # (the base tensor's name, layer, which)


@dataclass
class LoRAPart:
    """One HF projection's low-rank update (the whole model's, or one rank's share).

    Attributes:
        a: [r, in_features] float32.
        b: [out_features, r] float32, already multiplied by the adapter's scale.
    """

    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoRAAdapter:
    """An adapter read from a PEFT folder and checked against a base model.

    Attributes:
        parts: (layer, HF projection name) -> its update, whole-model sizes.
    """

    parts: dict[tuple[int, str], LoRAPart]

    def layer_parts(self, shard: ModelShard) -> dict[tuple[int, str, int], LoRAPart]:
        """The updates as rank ``shard`` runs them: (layer, our module, part index) -> update.

        Column-parallel projections (q/k/v, gate/up) keep B's rows of the rank's outputs,
        row-parallel ones (o, down) A's columns of the rank's inputs (their partial deltas
        are summed by the layer's all-reduce with its base output).
        """
        out: dict[tuple[int, str, int], LoRAPart] = {}
        for (layer, proj), part in self.parts.items():
            module, index = _TARGETS[proj]
            split = shard.split_of(f"{proj}.weight")
            a, b = part.a, part.b
            if split is not None:
                dim, start, stop = split
                if dim == 0:
                    b = b[start:stop]
                else:
                    a = a[:, start:stop]
            out[(layer, module, index)] = LoRAPart(a.contiguous(), b.contiguous())
        return out


def _sizes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF projection -> (out_features, in_features) of the whole model."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
        "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
    }


def _pattern_value(pattern: dict, key: str, default: float) -> float:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first pattern the module's
    name ends with (a regex matched at the end of ``key``), else ``default``."""
    for pat, value in pattern.items():
        if re.match(rf"(.*\.)?(?:{pat})$", key):
            return value
    return default


@dataclass
class _Update:
    """One HF projection's update as a file holds it: A [r, in], B [out, r] (unscaled), its
    scale, and the rank r the file declares for it."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    rank: int


def read_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check a LoRA adapter for the base model ``config``: a PEFT folder, or a GGUF
    file of llama.cpp's ``convert_lora_to_gguf.py`` (``general.type`` "adapter",
    ``adapter.type`` "lora", ``adapter.lora.alpha``; per projection
    ``blk.{i}.{attn_q|...}.weight.lora_a`` [r, in_features] and ``.lora_b`` [out_features, r],
    the q/k rows in llama.cpp's order where its converter permutes them; scale ``alpha / r``
    as llama.cpp applies it, 1 where alpha is 0 or missing. The file carries no rsLoRA flag:
    the converter writes PEFT's ``lora_alpha`` as it is and drops ``use_rslora``, so an
    rsLoRA adapter's ``alpha / sqrt(r)`` is had from a file whose alpha is ``alpha sqrt(r)``).

    Returns:
        The adapter, its B matrices scaled, in float32.

    Raises:
        LoRAError (a ValueError naming the problem): no such folder or file, a config or
            weights file that cannot be read, a setting we cannot serve (``modules_to_save``,
            DoRA, a trained bias, ``fan_in_fan_out``), a GGUF file that is not a LoRA adapter,
            a target other than the q/k/v/o and gate/up/down projections, a rank above
            ``max_rank``, shapes that do not fit ``config`` (an adapter for another base
            model), or a NaN or infinity in a weight.
    """
    where = Path(path)
    if where.is_file():
        updates, source = _read_gguf(where, config), where.name
    elif where.is_dir():
        updates, source = _read_peft(where), WEIGHTS_FILE
    else:
        raise LoRAError(f"LoRA adapter path {str(path)!r} is neither a PEFT adapter folder nor a GGUF file")
    return _fit(updates, config, max_rank, source)


def _read_peft(folder: Path) -> dict[tuple[int, str], _Update]:
    """(layer, HF projection) -> its update, from a PEFT folder."""
    cfg_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for f in (cfg_path, weights_path):
        if not f.is_file():
            raise LoRAError(f"LoRA adapter folder {str(folder)!r} has no {f.name}")
    try:
        cfg = json.loads(cfg_path.read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
        r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LoRAError(f"cannot read {cfg_path}: {type(e).__name__}: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("modules_to_save"):
        raise LoRAError(
            f"{cfg_path}: modules_to_save {cfg['modules_to_save']} is not supported (the adapter replaces whole "
            "modules of the base model, which cannot be batched with other adapters)"
        )
    if cfg.get("use_dora"):
        raise LoRAError(f"{cfg_path}: DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{cfg_path}: trained biases (bias={cfg['bias']!r}) are not supported")
    if cfg.get("fan_in_fan_out"):
        raise LoRAError(f"{cfg_path}: fan_in_fan_out adapters are not supported")
    rslora = bool(cfg.get("use_rslora", False))
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    module_keys: dict[tuple[int, str], str] = {}  # the module's name in the file, for the patterns
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():
                m = _KEY.search(key)
                if m is None:
                    raise LoRAError(
                        f"{weights_path.name}: tensor {key!r} is not a LoRA update of a q/k/v/o or gate/up/down "
                        "projection (embeddings, lm_head and other modules are not supported)"
                    )
                layer, proj, which = int(m.group(1)), m.group(2), m.group(3)
                pairs.setdefault((layer, proj), {})[which] = f.get_tensor(key).float()
                module_keys[(layer, proj)] = key.rsplit(".lora_", 1)[0]
    except LoRAError:
        raise
    except Exception as e:  # safetensors raises its own types for a truncated or garbled file
        raise LoRAError(f"cannot read {weights_path}: {type(e).__name__}: {e}") from None
    updates: dict[tuple[int, str], _Update] = {}
    for (layer, proj), pair in pairs.items():
        if "A" not in pair or "B" not in pair:
            raise LoRAError(
                f"{weights_path.name}: layer {layer} {proj} has lora_{'B' if 'A' in pair else 'A'} without its pair"
            )
        module_key = module_keys[(layer, proj)]
        mr = int(_pattern_value(rank_pattern, module_key, r))
        malpha = float(_pattern_value(alpha_pattern, module_key, alpha))
        updates[(layer, proj)] = _Update(pair["A"], pair["B"], malpha / (math.sqrt(mr) if rslora else mr), mr)
    return updates


def _read_gguf(path: Path, config: ModelConfig) -> dict[tuple[int, str], _Update]:
    """(layer, HF projection) -> its update, from a llama.cpp GGUF LoRA file."""
    try:
        f = GGUFFile(path)
    except Exception as e:  # a truncated or garbled header: struct, enum and numpy errors alike
        raise LoRAError(f"cannot read {path.name} as a GGUF file: {type(e).__name__}: {e}") from None
    meta = f.metadata
    kind, adapter = meta.get("general.type"), meta.get("adapter.type")
    if kind != "adapter" or adapter != "lora":
        raise LoRAError(
            f"{path.name}: not a GGUF LoRA adapter (general.type {kind!r}, adapter.type {adapter!r}; "
            "llama.cpp's convert_lora_to_gguf.py writes 'adapter' and 'lora')"
        )
    alpha = float(meta.get("adapter.lora.alpha", 0.0))
    arch = str(meta.get("general.architecture", ""))
    sizes = _sizes(config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name in f.tensors:
        m = _GGUF_KEY.fullmatch(name)
        try:
            if m is None:
                raise ValueError(name)
            proj = hf_name(m.group(1), arch).split(".")[-2]
        except ValueError:
            raise LoRAError(
                f"{path.name}: tensor {name!r} is not a LoRA update of a layer's projection "
                "(blk.N.<projection>.weight.lora_a / .lora_b)"
            ) from None
        try:
            tensor = f.dequantize(name, torch.float32)
        except Exception as e:  # data past the end of a truncated file, a block format we lack
            raise LoRAError(f"cannot read tensor {name!r} of {path.name}: {type(e).__name__}: {e}") from None
        if m.group(3) == "b" and proj in ("q_proj", "k_proj") and tensor.shape[0] == sizes[proj][0]:
            tensor = hf_rows(tensor, m.group(1), config, arch)  # llama.cpp's q/k row order, back to HF's
        pairs.setdefault((int(m.group(2)), proj), {})[m.group(3).upper()] = tensor
    updates: dict[tuple[int, str], _Update] = {}
    for (layer, proj), pair in pairs.items():
        if "A" not in pair or "B" not in pair:
            missing = "lora_a" if "B" in pair else "lora_b"
            raise LoRAError(f"{path.name}: layer {layer} {proj} has no {missing} to pair with")
        rank = pair["A"].shape[0]
        updates[(layer, proj)] = _Update(pair["A"], pair["B"], alpha / rank if alpha and rank else 1.0, rank)
    return updates


def _fit(updates: dict[tuple[int, str], _Update], config: ModelConfig, max_rank: int, source: str) -> LoRAAdapter:
    """The updates checked against ``config`` and cut into its unfused projections."""
    if not updates:
        raise LoRAError(f"{source} holds no LoRA weights")
    sizes = _sizes(config)
    parts: dict[tuple[int, str], LoRAPart] = {}
    for (layer, proj), update in sorted(updates.items()):
        where = f"layer {layer} {proj}"
        if layer >= config.num_layers:
            raise LoRAError(f"{where}: the base model has {config.num_layers} layers (an adapter for another base model?)")
        if proj not in sizes and proj not in _FUSED_HF:
            raise LoRAError(f"{where}: LoRA on {proj} is not supported (only q/k/v/o and gate/up/down projections)")
        a, b, mr = update.a, update.b, update.rank
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != mr or b.shape[1] != mr:
            raise LoRAError(f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not have rank r={mr}")
        if mr > max_rank:
            raise LoRAError(f"{where}: LoRA rank {mr} exceeds max_lora_rank {max_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"{where}: lora_A or lora_B holds a NaN or an infinity")
        names = _FUSED_HF.get(proj, (proj,))
        out_sizes = [sizes[n][0] for n in names]
        expected = (sum(out_sizes), sizes[names[0]][1])
        if (b.shape[0], a.shape[1]) != expected:
            raise LoRAError(
                f"{where}: the adapter maps {a.shape[1]} -> {b.shape[0]} features, the base model's projection "
                f"{expected[1]} -> {expected[0]} (an adapter for another base model?)"
            )
        for name, piece in zip(names, (b * update.scale).split(out_sizes), strict=True):
            parts[(layer, name)] = LoRAPart(a, piece.contiguous())
    return LoRAAdapter(parts)
