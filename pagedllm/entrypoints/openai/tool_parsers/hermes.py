"""Hermes / Qwen2.5 tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
each on its own, anywhere in the text; or, as small models (Qwen2.5-Coder-0.5B) write them,
the whole reply one bare ``{"name": ..., "arguments": {...}}`` object without the tags."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser

START, END = "<tool_call>", "</tool_call>"


def _call(body: str) -> ParsedToolCall | None:
    """The call in a tag's body; None if it is not a JSON object with a str name."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return ParsedToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


def _bare_call(text: str) -> ParsedToolCall | None:
    """A whole reply that is one call object and nothing else (only the call's keys)."""
    try:
        keys = json.loads(text).keys()
    except (ValueError, AttributeError):
        return None
    return _call(text) if "name" in keys and keys <= {"name", "arguments", "parameters"} else None


class HermesToolParser(ToolParser):
    """Text outside the tags is content; a tag whose body is not a call stays content too. A
    reply whose first non-space character is ``{`` is held back to its end (streaming too),
    then is one bare call or, if not, content."""

    def __init__(self) -> None:
        self._buffer = ""  # text not yet certain: a possible start tag, or an open call
        self._bare: bool | None = None  # whether the reply opens with "{": None until known

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        content, calls = self.feed(text)
        rest, more = self.finish()
        content += rest
        return (content if content.strip() else None), calls + more

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        self._buffer += delta
        if self._bare is None and self._buffer.strip():
            self._bare = self._buffer.lstrip().startswith("{")
        if self._bare is not False:  # undecided (only spaces so far), or a bare object: hold all
            return "", []
        content, calls = "", []
        while True:
            start = self._buffer.find(START)
            if start < 0:
                # Keep a tail that may be the start of a tag split across deltas.
                keep = next((k for k in range(min(len(START) - 1, len(self._buffer)), 0, -1)
                             if START.startswith(self._buffer[-k:])), 0)
                cut = len(self._buffer) - keep
                content += self._buffer[:cut]
                self._buffer = self._buffer[cut:]
                return content, calls
            end = self._buffer.find(END, start)
            if end < 0:
                content += self._buffer[:start]
                self._buffer = self._buffer[start:]
                return content, calls
            body = self._buffer[start + len(START) : end]
            call = _call(body.strip())
            if call is None:
                content += self._buffer[: end + len(END)]
            else:
                content += self._buffer[:start]
                calls.append(call)
            self._buffer = self._buffer[end + len(END) :]

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        if self._bare:
            call = _bare_call(self._buffer.strip())
            if call is not None:
                self._buffer = ""
                return "", [call]
            self._bare = False  # not a call: ordinary text, tags and all
            content, calls = self.feed("")
            more, last = self.finish()
            return content + more, calls + last
        rest, self._buffer = self._buffer, ""
        if rest.startswith(START):  # an unclosed call: a model cut off, or one that omits the end tag
            call = _call(rest[len(START) :].strip())
            if call is not None:
                return "", [call]
        return rest, []
