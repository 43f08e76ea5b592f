"""``EngineArgs``: the engine's settings as command-line flags (vLLM's names), declared once for
every command that builds an engine (generate, chat, serve, every bench)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pagedllm.config_values import BLOCK_SIZES, check_block_size, check_dtype, check_kv_cache_dtype, parse_memory
from pagedllm.default_model import DEFAULT_MODEL
from pagedllm.kernels.abi import CONSTANTS
from pagedllm.quantization_config import QuantizationConfig
from pagedllm.scheduler_defaults import MAX_NUM_BATCHED_TOKENS
from pagedllm.speculative_config import SpeculativeConfig

T = TypeVar("T")


def parse_int(text: str) -> int:
    """An integer flag's value.

    Raises:
        argparse.ArgumentTypeError: not an integer ("1k", "2.5"), said so: argparse's own
            message for a ValueError names the type function ("invalid positive_int value").
    """
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def parse_float(text: str) -> float:
    """A number flag's value.

    Raises:
        argparse.ArgumentTypeError: not a number, said so (as ``parse_int``).
    """
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = parse_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0 ("inf" included: a rate without limit)."""
    value = parse_float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be above 0, got {text!r}")
    return value


def _checked(check: Callable[[str], T]) -> Callable[[str], T]:
    """argparse type from ``check`` (a value's parser or check that raises ValueError): its
    message shown as the flag's error, not argparse's "invalid <check> value"."""

    def parse(text: str) -> T:
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _block_size(text: str) -> int:
    value = parse_int(text)
    check_block_size(value)
    return value


memory_size = _checked(parse_memory)  # a memory size in bytes ("1GiB", "512MiB")
kv_cache_dtype = _checked(check_kv_cache_dtype)  # a KV cache dtype's name, lower-cased
kv_block_size = _checked(_block_size)  # tokens per KV block, one of BLOCK_SIZES


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = parse_int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def thread_count(text: str) -> int:
    """argparse type: threads for a kernel benchmark, 1 to the CPUs this process may run on."""
    value, cpus = positive_int(text), len(os.sched_getaffinity(0))
    if value > cpus:
        raise argparse.ArgumentTypeError(f"must be at most the {cpus} CPUs this process may run on, got {value}")
    return value


def _items(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"must be a comma list with no empty item, such as 1,8, got {text!r}")
    return items


def positive_int_list(text: str) -> list[int]:
    """argparse type: a comma list of integers >= 1 ("1,8": batch sizes, context lengths)."""
    return [positive_int(item) for item in _items(text)]


def non_negative_int_list(text: str) -> list[int]:
    """argparse type: a comma list of integers >= 0 ("0,1,4")."""
    return [non_negative_int(item) for item in _items(text)]


def choice_list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """argparse type: a comma list of some of ``choices`` ("f32,w8a8"), at least one."""

    def parse(text: str) -> list[str]:
        items = _items(text)
        unknown = [item for item in items if item not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(choices)}")
        return items

    return parse


def finite_float(text: str) -> float:
    """argparse type: a finite float (NaN and infinities are refused)."""
    value = parse_float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def output_file(text: str) -> str:
    """argparse type: a file the command writes when it ends (``--result-json``), checked now,
    so that a run of minutes does not end in a traceback: not a directory, in a writable one."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{folder} is not a directory")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write in {folder}")
    return text


def input_file(text: str) -> Path:
    """argparse type: a file the command reads, checked now: it exists and may be read."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {text}")
    return path


def _flag(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help, **argparse_kwargs})


class _ModelOnce(argparse.Action):
    """Stores the model, from the positional or ``--model``; both with different values is a usage error."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = getattr(namespace, "_model_given", None)
        if given is not None and given != values:
            parser.error(f"the model is given twice: {given!r} and {values!r}; give it once, as MODEL or --model")
        namespace._model_given = values
        setattr(namespace, self.dest, values)


def check_model_path(model: str) -> None:
    """Refuse a model named by a path (it holds a "/" or ends in ".gguf": no installed alias
    does) that does not exist, before anything loads; the loader checks the rest
    (``models.loader.resolve_model``).

    Raises:
        ValueError: naming the path.
    """
    if ("/" in model or model.lower().endswith(".gguf")) and not Path(model).expanduser().exists():
        raise ValueError(
            f"model {model!r}: no such file or directory (a model is a .gguf file, an HF checkpoint "
            "directory or an installed alias: pagedllm env lists those installed)"
        )


@dataclass
class EngineArgs:
    """The ``LLM(...)`` keyword arguments a command line sets; each field is one flag
    (``--max-num-seqs`` for ``max_num_seqs``) with its default, help and argparse type."""

    model: str = _flag(DEFAULT_MODEL, ".gguf path, HF directory, or installed alias")
    dtype: str = _flag(
        "auto",
        "auto (float32 activations around linear layers run from the GGUF's own Q4_K/Q5_K/Q6_K/Q5_0/Q8_0 blocks, "
        "w4a8 where it stores Q4_0/Q4_1 blocks, else w8a8, the lm_head likewise, on AVX-512 and AVX2 kernels; "
        "w8a8 for all but the stored blocks on NEON; float32 ones on scalar kernels; a "
        "bfloat16 K/V cache; without native kernels, float32 activations and K/V around weight-only int8 linear layers "
        "and lm_head) | float32 (exact) | bfloat16 | float16",
    )
    kv_cache_dtype: str = _flag(
        "auto", "auto (as --dtype decides) | float32 | bfloat16 | float16 | int8 | fp8 (fp8_e4m3)"
    )
    max_model_len: int | None = _flag(
        None, "longest request (prompt + output) in tokens; None: the model's context, at most 8192", type=positive_int
    )
    max_num_seqs: int = _flag(128, "most requests running at once", type=positive_int)
    max_num_batched_tokens: int = _flag(MAX_NUM_BATCHED_TOKENS, "token budget of one engine step", type=positive_int)
    long_prefill_token_threshold: int = _flag(
        0, "most tokens one request computes in a step (0: no cap beyond the budget)", type=non_negative_int
    )
    kv_cache_memory: str = _flag("2GiB", "KV cache budget, e.g. 2GiB or 512MiB (units of 1024: 2GB and 2G are 2GiB)")
    block_size: int = _flag(
        16,
        # kernels.attention.MAX_PREFILL_BLOCK, read from the header: this module imports no torch.
        f"tokens per KV block: {' | '.join(map(str, BLOCK_SIZES))}; above {CONSTANTS['PAGEDLLM_MAX_PREFILL_BLOCK']} "
        "prefill attention runs in PyTorch, not the native kernel (slower)",
        type=int,
    )
    enable_prefix_caching: bool = _flag(
        True, "reuse cached KV blocks of shared prefixes", action=argparse.BooleanOptionalAction
    )
    seed: int = _flag(0, "seed of the engine's random sampling", type=int)
    generation_config: str = _flag(
        "auto", "defaults of the sampling fields a request leaves unset: auto (an HF checkpoint's generation_config.json "
        "recommendations: temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens caps every request's "
        "output) | vllm (SamplingParams' own) | a folder holding a generation_config.json (its recommendations)",
        serve_only=True,  # generate, chat and bench set every sampling field from their own flags
    )
    speculative_config: str | None = _flag(
        None, 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\''
    )
    quantization: str | None = _flag(
        None,
        "quantization of the linear layers: none | int8 (per channel) | int4 (group-wise), weight-only; "
        "w8a8 (int8 weights per output feature, int8 activations in groups of 32); w4a8 (4-bit weights, GGUF Q4_0/Q4_1 kept, "
        "int8 activations in groups of 32, the lm_head w8a8) (default: as --dtype decides)",
    )
    quantization_group_size: int = _flag(32, "int4 group size for weights requantized from float: 32 | 64 | 128", type=int)
    quantize_lm_head: bool | None = _flag(
        None, "quantize the lm_head too (tied embeddings: the lookup stays float) (default: as --dtype decides: "
        "auto quantizes it)", action="store_true",
    )
    tensor_parallel_size: int = _flag(
        1, "ranks splitting the model (Megatron-LM style, torch.distributed gloo); each pins its share of the cores",
        type=positive_int, short="-tp",
    )
    distributed_executor_backend: str | None = _flag(
        None,
        "where the tensor-parallel ranks run: mp (local processes) | ray (actors of a Ray cluster: pip install "
        "'pagedllm[ray]') | uni (this process, one rank) (default: uni at one rank, else mp)",
        choices=("uni", "mp", "ray"),
    )
    ray_placement_strategy: str = _flag(
        "STRICT_PACK", "Ray placement group strategy for the ranks (one bundle each)",
        choices=("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"),
    )
    # LoRA: serve only, where requests name adapters (generate, chat and bench throughput have
    # no way to pick one; bench lora sets these itself).
    enable_lora: bool = _flag(
        False, "serve LoRA adapters (PEFT folders, llama.cpp GGUF files) on top of the model", action="store_true",
        serve_only=True,
    )
    max_loras: int = _flag(1, "most distinct LoRA adapters in one engine step", type=positive_int, serve_only=True)
    max_lora_rank: int = _flag(16, "largest LoRA rank an adapter may have", type=positive_int, serve_only=True)
    max_cpu_loras: int | None = _flag(
        None, "LoRA adapters kept loaded, least recently used dropped beyond (default: --max-loras)", type=positive_int,
        serve_only=True,
    )
    lora_dtype: str = _flag(
        "auto", "LoRA adapters' A and B in memory: auto (bfloat16 with --dtype auto on the native kernels, else the "
        "model's dtype) | float32 | bfloat16", choices=("auto", "float32", "bfloat16"), serve_only=True,
    )
    worker_timeout_s: float = _flag(
        120.0, "seconds the tensor-parallel ranks wait for a hung rank in a collective before the engine fails",
        type=finite_float,
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, serve: bool = False) -> None:
        """Add one flag per field. ``serve``: the model is also an optional positional
        (``pagedllm serve MODEL``, and ``--model`` as vLLM still takes it), given once, and the
        fields marked ``serve_only`` (what only requests read: defaults of the fields they leave
        unset, the LoRA adapters they name) are flags too; other commands leave them at their
        defaults (``from_cli_args``)."""
        for f in dataclasses.fields(cls):
            spec = dict(f.metadata)
            if spec.pop("serve_only", False) and not serve:
                continue
            names = [f"--{f.name.replace('_', '-')}"]
            if short := spec.pop("short", None):
                names.append(short)
            if f.name == "model" and serve:
                # SUPPRESS: a missing positional must not overwrite --model with the default.
                parser.add_argument("model", nargs="?", default=argparse.SUPPRESS, action=_ModelOnce,
                                    help="model path or alias (as --model)")
                spec["action"] = _ModelOnce
            parser.add_argument(*names, default=f.default, **spec)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The fields' values from parsed flags (a field without a flag here: its default)."""
        return cls(**{f.name: getattr(args, f.name, f.default) for f in dataclasses.fields(cls)})

    def check(self) -> None:
        """The values that need no torch to check, checked as ``EngineConfig`` checks them, so
        that the command line refuses them before it loads torch (seconds).

        Raises:
            ValueError: for a bad value, the message opening with its setting's name (or its flag).
        """
        check_model_path(self.model)
        check_dtype(self.dtype)
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_block_size(self.block_size)
        try:
            parse_memory(self.kv_cache_memory)
        except ValueError as e:
            raise ValueError(f"--kv-cache-memory: {e}") from None
        QuantizationConfig.parse(self.quantization, self.quantization_group_size)
        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is not None and speculative.model is not None:
            try:
                check_model_path(speculative.model)
            except ValueError as e:
                raise ValueError(f"--speculative-config: the draft {e}") from None
        if not self.worker_timeout_s > 0:
            raise ValueError(f"--worker-timeout-s must be above 0, got {self.worker_timeout_s}")

    def kwargs(self) -> dict[str, Any]:
        """``LLM(**kwargs)``: every field, but ``quantize_lm_head`` only where the flag was given
        (a keyword given to ``LLM`` wins over what the dtype implies)."""
        kwargs = dataclasses.asdict(self)
        if kwargs["quantize_lm_head"] is None:
            del kwargs["quantize_lm_head"]
        return kwargs
