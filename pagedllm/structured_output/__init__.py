"""Structured outputs: constrained decoding with llguidance grammars (docs in README)."""

from pagedllm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
