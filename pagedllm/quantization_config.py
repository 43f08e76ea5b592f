"""Settings of quantization: the mode, int4's group size, whether the lm_head too."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("none", "int8", "int4", "w8a8", "w4a8")
GROUP_SIZES = (32, 64, 128)


def _check_group_size(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(
            f"quantization_group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size!r}"
        )


@dataclass(frozen=True)
class QuantizationConfig:
    """How the linear layers are quantized.

    Attributes:
        mode: "int8" (symmetric, per output channel) or "int4" (asymmetric, in groups along
            the input dimension). GGUF blocks no more precise than the mode are kept in their
            own layout instead (Q8_0, Q4_0, Q4_1; see ``gguf.py``). "w8a8": int8 weights
            symmetric per output feature, int8 activations symmetric per group of 32 input
            features (an integer matmul; every weight is requantized from float). "w4a8": 4-bit weights (d q + m
            per group of 32; GGUF Q4_0 / Q4_1 kept, the rest requantized from float) with
            activations as w8a8's, the lm_head as w8a8 (llama.cpp's Q4_1 x Q8_1).
        group_size: int4's group size, 32 (llama.cpp's block size), 64 or 128; int8 ignores it.
        lm_head: also quantize the logits matmul. With tied embeddings the embedding lookup
            stays float; the logits use a quantized copy of the same matrix.
        requantize_4bit: w4a8 and w8a8; False (``--dtype auto``): no weight loses precision
            it had in the file: GGUF Q8_0, Q5_0, Q4_K, Q5_K, Q6_K tensors run as stored
            (``layers/quantization/gguf.py``), Q4_0 / Q4_1 as w4a8, the others as w8a8 (what
            requantizing Q5_0 or Q6_K tensors to 4 bits costs in perplexity: docs/benchmarks.md).

    Raises:
        ValueError: unknown mode or group size.
    """

    mode: str
    group_size: int = 32
    lm_head: bool = False
    requantize_4bit: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES[1:]:
            raise ValueError(f"quantization must be one of {', '.join(MODES)}, got {self.mode!r}")
        _check_group_size(self.group_size)

    @classmethod
    def parse(
        cls, mode: str | None, group_size: int = 32, lm_head: bool = False, requantize_4bit: bool = True
    ) -> QuantizationConfig | None:
        """The config of the engine flags; None for mode "none" (or None).

        Raises:
            ValueError: unknown mode or group size, or ``lm_head`` without a mode.
        """
        if mode is None or mode == "none":
            _check_group_size(group_size)  # a bad flag is an error even where unused
            if lm_head:
                raise ValueError("quantize_lm_head needs quantization int8, int4, w8a8 or w4a8")
            return None
        return cls(mode, group_size, lm_head, requantize_4bit)

    def describe(self) -> str:
        """Short label for logs and benchmarks, e.g. ``int4 g32 +lm_head``."""
        label = f"int4 g{self.group_size}" if self.mode == "int4" else self.mode
        if self.mode in ("w4a8", "w8a8") and not self.requantize_4bit:
            label += " (GGUF blocks as stored, other weights w8a8)"
        return label + (" +lm_head" if self.lm_head else "")
