"""What a tool-call parser does: find the calls a model wrote in its own format."""

from __future__ import annotations

import abc
import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of an object


class ToolParser(abc.ABC):
    """Reads one output's tool calls; a new instance per output (streaming keeps state).

    ``extract`` takes the whole text (non-streamed); ``feed`` and ``finish`` take it in deltas
    and return what became certain: content text to stream and whole calls. Fed the same text,
    the two agree: the contents joined equal ``extract``'s content and the calls are the same.
    Only a call that names one of ``tool_names`` with a JSON object for arguments is a call;
    any other text, JSON nested deeper than ``model_json.MAX_DEPTH`` included, is content.
    The work is linear in the text, however it is split into deltas.

    Args:
        tool_names: the functions the request declares.
    """

    def __init__(self, tool_names: Collection[str]) -> None:
        self.tool_names = frozenset(tool_names)

    def call(self, name: Any, arguments: Any) -> ParsedToolCall | None:
        """The call of ``name`` with ``arguments`` (as parsed from the model's JSON), or None
        unless ``name`` is a declared function and ``arguments`` an object."""
        if not isinstance(name, str) or name not in self.tool_names or not isinstance(arguments, dict):
            return None
        return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content outside the calls, None if empty; the calls in order): the whole text fed
        at once, so the two ways agree by construction."""
        content, calls = self.feed(text)
        rest, more = self.finish()
        content += rest
        return (content if content.strip() else None), calls + more

    @abc.abstractmethod
    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        """Take the next piece of text; return (content now certain, calls now complete)."""

    @abc.abstractmethod
    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """The end of the text: whatever ``feed`` still held back."""
