"""What a tool-call parser does: find the calls a model wrote in its own format."""

from __future__ import annotations

import abc
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


class ToolParser(abc.ABC):
    """Reads one output's tool calls; a new instance per output (streaming keeps state).

    ``extract`` takes the whole text (non-streamed); ``feed`` and ``finish`` take it in deltas
    and return what became certain: content text to stream and whole calls. Fed the same text,
    the two agree: the contents joined equal ``extract``'s content and the calls are the same.
    """

    @abc.abstractmethod
    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content outside the calls, None if empty; the calls in order)."""

    @abc.abstractmethod
    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        """Take the next piece of text; return (content now certain, calls now complete)."""

    @abc.abstractmethod
    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """The end of the text: whatever ``feed`` still held back."""
