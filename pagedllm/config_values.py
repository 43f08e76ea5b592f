"""The values some engine settings take, declared without torch: the command line refuses a
wrong ``--dtype``, ``--kv-cache-dtype``, ``--block-size`` or memory size before it loads torch
(``EngineArgs.check``), and config.py maps and checks the same values.

Its own module, importing nothing (as ``scheduler_defaults``).
"""

# --dtype's names -> the torch dtype each stands for (an attribute of torch). "auto": float32
# activations (the faster float matmuls on the CPUs we target; the linear layers as
# platforms/cpu.py picks; docs/benchmarks.md, dtype and instruction rates).
DTYPES = {
    "auto": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
}

# --kv-cache-dtype's names beyond DTYPES' (where "auto" means: as the engine's dtype decides):
# the 8-bit caches (vLLM's names for fp8, and torch's).
KV_CACHE_DTYPES = {
    "int8": "int8",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3fn": "float8_e4m3fn",
}

# Tokens per KV block the engine takes.
BLOCK_SIZES = (8, 16, 32, 64, 128)


def check_dtype(name: object) -> str:
    """``name`` lower-cased, one of ``DTYPES``.

    Raises:
        ValueError: for another name, or a value that is not a str.
    """
    if not isinstance(name, str) or name.lower() not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return name.lower()


def check_kv_cache_dtype(name: object) -> str:
    """``name`` lower-cased, one of ``KV_CACHE_DTYPES`` or ``DTYPES``.

    Raises:
        ValueError: for another name, or a value that is not a str.
    """
    if not isinstance(name, str) or (name.lower() not in KV_CACHE_DTYPES and name.lower() not in DTYPES):
        raise ValueError(
            f"kv_cache_dtype must be auto, float32, bfloat16, float16, int8 or fp8 (fp8_e4m3), got {name!r}"
        )
    return name.lower()


def check_block_size(block_size: object) -> None:
    """Raises ValueError unless ``block_size`` is one of ``BLOCK_SIZES``."""
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {block_size}")


def parse_memory(value: str | int | float) -> int:
    """Parse a memory size: bytes as a number, or with a unit ("4GiB", "512MiB", "2G").

    Raises:
        ValueError: when the value cannot be parsed, or is not a finite size of at least one byte
            ("0", "-1GiB", "inf").
    """
    units = {"k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
    if isinstance(value, (int, float)):
        size = value
    else:
        s = value.strip().lower().removesuffix("b").removesuffix("i")
        scale = units[s[-1]] if s and s[-1] in units else 1
        try:
            size = float(s[:-1] if scale > 1 else s) * scale
        except ValueError:
            raise ValueError(f"cannot parse memory size {value!r}; use e.g. 4GiB or 512MiB") from None
    if not 1 <= size < float("inf"):  # NaN fails too
        raise ValueError(f"memory size must be at least one byte and finite, got {value!r}")
    return int(size)
