"""pagedllm's generic tool calls (``entrypoints.generic_tools``), for chat templates without
tool support: the whole reply is one ``{"name": ..., "arguments": {...}}`` object or a JSON
list of them; any other reply is content."""

from __future__ import annotations

from collections.abc import Collection

from pagedllm.entrypoints.openai.model_json import loads
from pagedllm.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser


class GenericToolParser(ToolParser):
    """A reply whose first non-space character is ``{`` or ``[`` is held back to its end
    (streaming too), then is calls if every object in it is a call of a declared function
    (only the keys ``name`` and ``arguments``), else content as it came; any other reply is
    content as it comes."""

    def __init__(self, tool_names: Collection[str]) -> None:
        super().__init__(tool_names)
        self._json: bool | None = None  # whether the reply opens with "{" or "[": None until known
        self._held: list[str] = []  # the reply so far while undecided or JSON

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        if self._json is False:
            return delta, []
        self._held.append(delta)
        if self._json is None and delta.strip():
            text = "".join(self._held)
            self._json = text.lstrip()[0] in "{["
            if not self._json:
                self._held = []
                return text, []
        return "", []

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        text, self._held = "".join(self._held), []
        if not self._json:
            return text, []
        calls = self._calls(text)
        return ("", calls) if calls else (text, [])

    def _calls(self, text: str) -> list[ParsedToolCall]:
        """The calls ``text`` is, or [] if it is not only calls."""
        try:
            value = loads(text)
        except ValueError:
            return []
        objects = value if isinstance(value, list) else [value]
        calls = []
        for obj in objects:
            if not isinstance(obj, dict) or not obj.keys() <= {"name", "arguments"}:
                return []
            call = self.call(obj.get("name"), obj.get("arguments", {}))
            if call is None:
                return []
            calls.append(call)
        return calls
