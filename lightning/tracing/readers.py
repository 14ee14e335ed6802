"""Reading what emitters recorded back from spans (agent-lightning's `get_message_value` / `get_object_value`):
ours, and agl's spans (`agentlightning.message.body`, `agentlightning.object.json` / `.literal`)."""

from __future__ import annotations

import base64
import json
from typing import Any

from lightning import semconv
from lightning.types import Span


def get_message_value(span: Span) -> str | None:
    """A message span's text (`emit_message`), or None for a span that holds none."""
    attributes = span.attributes or {}
    for key in (semconv.MESSAGE_BODY, semconv.PEER_MESSAGE_BODY):
        if key in attributes:
            message = attributes[key]
            if not isinstance(message, str):
                raise TypeError(f"get_message_value: {key} is a {type(message).__name__}, not a str")
            return message
    return None


_LITERALS: dict[str, Any] = {
    "str": str,
    "int": int,
    "float": float,
    "bool": lambda literal: literal.lower() == "true",
    "bytes": lambda literal: base64.b64decode(literal.encode("utf-8")),
}


def get_object_value(span: Span) -> Any:
    """An object span's value (`emit_object`), decoded from its JSON (or from agl's literal and type), or None for a
    span that holds none."""
    attributes = span.attributes or {}
    for key in (semconv.OBJECT_JSON, semconv.PEER_OBJECT_JSON):
        if key in attributes:
            try:
                return json.loads(attributes[key])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"get_object_value: {key} is not JSON: {exc}") from exc
    if semconv.PEER_OBJECT_LITERAL in attributes:
        kind = attributes.get(semconv.PEER_OBJECT_TYPE, "str")
        if kind not in _LITERALS:
            raise ValueError(f"get_object_value: an object literal of type {kind!r} cannot be decoded")
        return _LITERALS[kind](attributes[semconv.PEER_OBJECT_LITERAL])
    return None
