"""Streamed tool calls, as OpenAI sends them: per call, a ``delta.tool_calls[i]`` with the id,
type and name, then ``function.arguments`` (the pieces joined equal the non-streamed
arguments); text outside the calls stays ``delta.content``."""

from __future__ import annotations

from pagedllm.entrypoints.openai.response_bodies import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from pagedllm.entrypoints.openai.tool_parsers import ParsedToolCall, ToolParser
from pagedllm.entrypoints.openai.tools import required_calls, tool_call_id


class ToolStream:
    """One choice's stream under a tool mode.

    Args:
        mode: "auto" (calls parsed out of free text by ``parser``), "required" (the
            constrained output is a JSON array of calls, sent once complete) or "named" (the
            constrained output is the arguments of ``name``, sent as it comes).
        parser: a fresh tool parser, for "auto".
        name: the function of "named".
        max_calls: the most calls sent (``parallel_tool_calls: false``: 1, as vLLM, which keeps
            the first); None: all.
    """

    def __init__(self, mode: str, parser: ToolParser | None = None, name: str | None = None,
                 max_calls: int | None = None) -> None:
        self.mode = mode
        self.parser = parser
        self.name = name
        self.max_calls = max_calls
        self.num_calls = 0
        self._pieces: list[str] = []  # "required": the output so far
        # "auto": content held back while all of it is whitespace: the non-streamed message's
        # content is None then (``ToolParser.extract``), so such a stream sends none either.
        self._blank: str | None = ""

    def update(self, delta: str, finished: bool) -> list[DeltaMessage]:
        """The deltas to send for this piece of output text (``finished``: it is the last)."""
        if self.mode == "named":
            if self.num_calls == 0:
                self.num_calls = 1
                call = DeltaToolCall(index=0, id=tool_call_id(), type="function",
                                     function=DeltaFunctionCall(name=self.name, arguments=delta))
                return [DeltaMessage(tool_calls=[call])]
            return [DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))])] if delta else []
        if self.mode == "required":
            self._pieces.append(delta)
            if not finished:
                return []
            text = "".join(self._pieces)
            calls = required_calls(text)
            if calls is None:  # cut off: what there is, as text
                return [DeltaMessage(content=text)]
            return self._calls([ParsedToolCall(name, arguments) for name, arguments in calls])
        content, calls = self.parser.feed(delta)
        if finished:
            rest, more = self.parser.finish()
            content, calls = content + rest, calls + more
        if self._blank is not None:
            if content.strip():
                content, self._blank = self._blank + content, None
            else:
                content, self._blank = "", self._blank + content
        return ([DeltaMessage(content=content)] if content else []) + self._calls(calls)

    def _calls(self, calls: list[ParsedToolCall]) -> list[DeltaMessage]:
        out = []
        if self.max_calls is not None:
            calls = calls[: max(self.max_calls - self.num_calls, 0)]
        for call in calls:
            index = self.num_calls
            self.num_calls += 1
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=index, id=tool_call_id(), type="function", function=DeltaFunctionCall(name=call.name, arguments=""),
            )]))
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments))]))
        return out
