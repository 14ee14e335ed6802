"""Tool calls in the model's text, Hermes/Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
turned into OpenAI's `tool_calls`. The tiny model's chat template (and Qwen's, and Hermes') asks for this form.

A block whose body is not a JSON object with a string `name` stays in the content as the model wrote it, and so
does a block the generation never closed.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


def parse_tool_call(body: str) -> ToolCall | None:
    """The tool call a block's body holds, or None when it is not one (then the block stays text)."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments: Any = data.get("arguments", data.get("parameters", {}))
    if not isinstance(arguments, str):  # a JSON object in the text: OpenAI's field is its JSON text
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(function=FunctionCall(name=data["name"], arguments=arguments))


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the text outside the well-formed tool-call blocks, the tool calls in order)."""
    parser = ToolCallParser()
    pieces = parser.feed(text) + parser.finish()
    content = "".join(piece for piece in pieces if isinstance(piece, str))
    return content, [piece for piece in pieces if isinstance(piece, ToolCall)]


class ToolCallParser:
    """Splits streamed text into content and tool calls as it arrives.

    `feed` returns what is final: text that cannot be part of a tool-call block, and each block as soon as it is
    closed. It holds back the text of an open block, and a tail that may be the start of `<tool_call>`; `finish`
    gives back whatever is held, as text.
    """

    def __init__(self) -> None:
        self._held = ""
        self._in_block = False

    def feed(self, text: str) -> list[str | ToolCall]:
        self._held += text
        pieces: list[str | ToolCall] = []
        while True:
            if self._in_block:
                end = self._held.find(TOOL_CALL_END)
                if end < 0:
                    return pieces
                body = self._held[len(TOOL_CALL_START) : end]
                block, self._held = self._held[: end + len(TOOL_CALL_END)], self._held[end + len(TOOL_CALL_END) :]
                self._in_block = False
                call = parse_tool_call(body)
                pieces.append(call if call is not None else block)
                continue
            start = self._held.find(TOOL_CALL_START)
            if start >= 0:
                if start:
                    pieces.append(self._held[:start])
                self._held = self._held[start:]
                self._in_block = True
                continue
            # No block starts here; keep back a tail that the next text may complete into `<tool_call>`.
            keep = _partial_start(self._held)
            if len(self._held) > keep:
                pieces.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
            return pieces

    def finish(self) -> list[str | ToolCall]:
        """The held text (an unclosed block or a partial start tag), as text."""
        held, self._held, self._in_block = self._held, "", False
        return [held] if held else []


def _partial_start(text: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `<tool_call>`."""
    for size in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_START[:size]):
            return size
    return 0
