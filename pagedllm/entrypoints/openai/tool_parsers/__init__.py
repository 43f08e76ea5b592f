"""Tool-call parsers by name (``--tool-call-parser``): adding a model family's format is one
module with a ``ToolParser`` subclass and one line here."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,  # Hermes 2 Pro / 3, Qwen2.5 (and Qwen2.5-Coder)
}

__all__ = ["TOOL_PARSERS", "ParsedToolCall", "ToolParser"]
