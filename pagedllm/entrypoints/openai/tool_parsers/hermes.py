"""Hermes / Qwen2.5 tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
each on its own, anywhere in the text; or, as small models (Qwen2.5-Coder-0.5B) write them,
the whole reply one bare ``{"name": ..., "arguments": {...}}`` object without the tags."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pagedllm.entrypoints.openai.model_json import loads
from pagedllm.entrypoints.openai.tool_parsers.base import ParsedToolCall, ToolParser

START, END = "<tool_call>", "</tool_call>"


def _object(text: str) -> dict[str, Any] | None:
    """``text`` as a JSON object; None if it is not one (or is nested too deeply)."""
    try:
        value = loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _partial_start(text: str) -> int:
    """The length of the longest end of ``text`` that begins ``START`` (a tag split across deltas)."""
    return next((k for k in range(min(len(START) - 1, len(text)), 0, -1) if START.startswith(text[-k:])), 0)


class HermesToolParser(ToolParser):
    """Text outside the tags is content; a tag whose body is not a call stays content too. A
    reply whose first non-space character is ``{`` is held back to its end (streaming too),
    then is one bare call or, if not, content."""

    def __init__(self, tool_names: Collection[str]) -> None:
        super().__init__(tool_names)
        self._bare: bool | None = None  # whether the reply opens with "{": None until known
        self._held: list[str] = []  # the reply so far while undecided or bare
        self._tail = ""  # outside a call: an end that may begin a start tag
        self._body: list[str] | None = None  # inside a call: its text after the start tag, in pieces
        self._body_tail = ""  # inside a call: the last len(END) - 1 characters of its body

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        if self._bare is not False:  # undecided (only spaces so far), or a bare object: hold all
            self._held.append(delta)
            if self._bare is None and delta.strip():
                text = "".join(self._held)
                self._bare = text.lstrip().startswith("{")
                if not self._bare:
                    self._held = []
                    return self._tagged(text)
            return "", []
        return self._tagged(delta)

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        text, self._held = "".join(self._held), []
        if self._bare:
            call = self._bare_call(text.strip())
            if call is not None:
                return "", [call]
            self._bare = False  # not a call: ordinary text, tags and all
            content, calls = self._tagged(text)
            rest, more = self.finish()
            return content + rest, calls + more
        if self._bare is None:  # spaces only
            return text, []
        rest, self._tail = self._tail, ""
        if self._body is not None:  # an unclosed call: a model cut off, or one that omits the end tag
            body, self._body = "".join(self._body), None
            call = self._call(body)
            if call is not None:
                return rest, [call]
            rest += START + body
        return rest, []

    def _tagged(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """Read ``text`` after what came before it: each character is looked at a bounded
        number of times, and a call's body is joined once, when its end tag comes."""
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        while text:
            if self._body is None:
                text, self._tail = self._tail + text, ""
                start = text.find(START)
                if start < 0:
                    cut = len(text) - _partial_start(text)
                    content.append(text[:cut])
                    self._tail = text[cut:]
                    break
                content.append(text[:start])
                self._body, self._body_tail = [], ""
                text = text[start + len(START) :]
                continue
            window = self._body_tail + text
            found = window.find(END)
            if found < 0:
                self._body.append(text)
                self._body_tail = window[-(len(END) - 1) :]
                break
            body = "".join(self._body) + text
            end = len(body) - len(window) + found
            body, text = body[:end], body[end + len(END) :]
            self._body = None
            call = self._call(body)
            if call is None:
                content.append(START + body + END)
            else:
                calls.append(call)
        return "".join(content), calls

    def _call(self, body: str) -> ParsedToolCall | None:
        """The call in a tag's body; None if it is not an object naming a declared function."""
        call = _object(body.strip())
        if call is None:
            return None
        return self.call(call.get("name"), call.get("arguments", call.get("parameters", {})))

    def _bare_call(self, text: str) -> ParsedToolCall | None:
        """A whole reply that is one call object and nothing else (only the call's keys)."""
        call = _object(text)
        if call is None or "name" not in call or not call.keys() <= {"name", "arguments", "parameters"}:
            return None
        return self.call(call["name"], call.get("arguments", call.get("parameters", {})))
