"""What one LLM call said, gathered from its request and its response (JSON or SSE stream), and
turned into the attributes of its span."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from lightning import fastjson, semconv

# Sampling parameters copied onto the span as `gen_ai.request.<name>` when the request sets them.
_REQUEST_PARAMETERS = (
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "n",
    "stop",
    "frequency_penalty",
    "presence_penalty",
    "tool_choice",  # "auto", "none", "required" (a named function is an object: not copied)
)


@dataclass
class Choice:
    """One choice of a response, put together from a whole body or from stream deltas."""

    role: str = "assistant"
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    """The sampler's log-prob of each response token (from the response's `logprobs`), when it sent them."""
    finish_reason: str | None = None
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass
class Call:
    """One call through the proxy: the request as the agent sent it and what came back."""

    operation: str
    """"chat" or "text_completion"."""
    request: dict[str, Any]
    stream: bool
    status_code: int = 0
    error: str | None = None
    response_id: str | None = None
    response_model: str | None = None
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    choices: dict[int, Choice] = field(default_factory=dict)
    continuation: str | None = None
    """A call that continues an earlier one of its attempt: "joined", or why its ids could not be (see semconv)."""

    def choice(self, index: int) -> Choice:
        if index not in self.choices:
            self.choices[index] = Choice()
        return self.choices[index]

    # --- A whole (non-streamed) response --------------------------------------------------------

    def read_body(self, body: dict[str, Any]) -> None:
        self._read_header(body)
        for raw in body.get("choices") or []:
            choice = self.choice(int(raw.get("index", 0)))
            choice.finish_reason = raw.get("finish_reason")
            choice.token_ids = raw.get("token_ids")
            choice.prompt_token_ids = raw.get("prompt_token_ids")
            choice.logprobs = _sampled_logprobs(raw.get("logprobs"))
            message = raw.get("message")
            if message is not None:  # chat
                choice.role = message.get("role") or "assistant"
                if message.get("content"):
                    choice.text_parts.append(message["content"])
                for i, call in enumerate(message.get("tool_calls") or []):
                    choice.tool_calls[i] = call
            elif raw.get("text"):
                choice.text_parts.append(raw["text"])

    # --- A stream, one SSE event at a time -------------------------------------------------------

    def read_chunk(self, chunk: dict[str, Any]) -> None:
        self._read_header(chunk)
        for raw in chunk.get("choices") or []:
            choice = self.choice(int(raw.get("index", 0)))
            if raw.get("finish_reason"):
                choice.finish_reason = raw["finish_reason"]
            if raw.get("token_ids"):
                choice.token_ids = (choice.token_ids or []) + list(raw["token_ids"])
            if raw.get("prompt_token_ids"):
                choice.prompt_token_ids = raw["prompt_token_ids"]
            logprobs = _sampled_logprobs(raw.get("logprobs"))
            if logprobs:
                choice.logprobs = (choice.logprobs or []) + logprobs
            delta = raw.get("delta")
            if delta is not None:  # chat
                if delta.get("role"):
                    choice.role = delta["role"]
                if delta.get("content"):
                    choice.text_parts.append(delta["content"])
                for part in delta.get("tool_calls") or []:
                    _merge_tool_call(choice.tool_calls, part)
            elif raw.get("text"):
                choice.text_parts.append(raw["text"])

    def _read_header(self, body: dict[str, Any]) -> None:
        self.response_id = self.response_id or body.get("id")
        self.response_model = self.response_model or body.get("model")
        if body.get("prompt_token_ids"):  # chat: top level (vLLM)
            self.prompt_token_ids = body["prompt_token_ids"]
        if body.get("usage"):
            self.usage = body["usage"]

    # --- The span ----------------------------------------------------------------------------------

    def attributes(self) -> dict[str, Any]:
        """The span's attributes: GenAI conventions, plus token ids in the compact encoding."""
        request = self.request
        attrs: dict[str, Any] = {
            semconv.GEN_AI_OPERATION: self.operation,
            semconv.LLM_STREAM: self.stream,
            semconv.LLM_HTTP_STATUS: self.status_code,
        }
        if isinstance(request.get("model"), str):
            attrs[semconv.GEN_AI_REQUEST_MODEL] = request["model"]
        for name in _REQUEST_PARAMETERS:
            value = request.get(name)
            scalar = isinstance(value, bool | int | float | str)
            if scalar or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                attrs[semconv.GEN_AI_REQUEST_PREFIX + name] = value
        prompt = request.get("messages") if self.operation == "chat" else request.get("prompt")
        attrs[semconv.GEN_AI_INPUT_MESSAGES] = fastjson.dumps(prompt).decode()
        if request.get("tools"):
            attrs[semconv.GEN_AI_TOOL_DEFINITIONS] = fastjson.dumps(request["tools"]).decode()
        if self.continuation is not None:
            attrs[semconv.LLM_CONTINUATION] = self.continuation
        if self.response_id:
            attrs[semconv.GEN_AI_RESPONSE_ID] = self.response_id
        if self.response_model:
            attrs[semconv.GEN_AI_RESPONSE_MODEL] = self.response_model
        if self.usage:
            if self.usage.get("prompt_tokens") is not None:
                attrs[semconv.GEN_AI_INPUT_TOKENS] = self.usage["prompt_tokens"]
            if self.usage.get("completion_tokens") is not None:
                attrs[semconv.GEN_AI_OUTPUT_TOKENS] = self.usage["completion_tokens"]
        choices = [self.choices[i] for i in sorted(self.choices)]
        if choices:
            attrs[semconv.GEN_AI_FINISH_REASONS] = [c.finish_reason or "" for c in choices]
            attrs[semconv.GEN_AI_OUTPUT_MESSAGES] = fastjson.dumps([_output_message(c) for c in choices]).decode()
        prompt_ids = self.prompt_token_ids
        choice_prompts = [c.prompt_token_ids for c in choices if c.prompt_token_ids is not None]
        if prompt_ids is None and choice_prompts:
            prompt_ids = choice_prompts[0]
        if prompt_ids is not None:
            attrs[semconv.LLM_PROMPT_TOKEN_IDS] = semconv.encode_token_ids(prompt_ids)
        if len(choice_prompts) == len(choices) and any(p != prompt_ids for p in choice_prompts):
            attrs[semconv.LLM_CHOICE_PROMPT_TOKEN_IDS] = [semconv.encode_token_ids(p) for p in choice_prompts]
        if choices and all(c.token_ids is not None for c in choices):
            attrs[semconv.LLM_RESPONSE_TOKEN_IDS] = [semconv.encode_token_ids(c.token_ids or []) for c in choices]
            # A stream without `stream_options.include_usage` has no usage: the token ids tell it.
            attrs.setdefault(semconv.GEN_AI_OUTPUT_TOKENS, sum(len(c.token_ids or []) for c in choices))
            if prompt_ids is not None:
                attrs.setdefault(semconv.GEN_AI_INPUT_TOKENS, len(prompt_ids))
            if all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids or []) for c in choices):
                attrs[semconv.LLM_RESPONSE_LOGPROBS] = [semconv.encode_logprobs(c.logprobs or []) for c in choices]
        return attrs


def _sampled_logprobs(logprobs: Any) -> list[float] | None:
    """The sampled tokens' log-probs from a choice's `logprobs`: chat's `content[i].logprob`, or completions'
    `token_logprobs`; None when absent or of another shape."""
    if not isinstance(logprobs, dict):
        return None
    if isinstance(logprobs.get("content"), list):
        values = [entry.get("logprob") if isinstance(entry, dict) else None for entry in logprobs["content"]]
    elif isinstance(logprobs.get("token_logprobs"), list):
        values = logprobs["token_logprobs"]
    else:
        return None
    if not all(isinstance(value, int | float) and not isinstance(value, bool) for value in values):
        return None
    return [float(value) for value in values]


def _merge_tool_call(calls: dict[int, dict[str, Any]], part: dict[str, Any]) -> None:
    """Streamed tool calls arrive in pieces: the id and name first, the arguments in fragments."""
    call = calls.setdefault(int(part.get("index", len(calls))), {"function": {"name": "", "arguments": ""}})
    for key in ("id", "type"):
        if part.get(key):
            call[key] = part[key]
    function = part.get("function") or {}
    if function.get("name"):
        call["function"]["name"] += function["name"]
    if function.get("arguments"):
        call["function"]["arguments"] += function["arguments"]


def _output_message(choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": choice.role, "content": choice.text, "finish_reason": choice.finish_reason}
    if choice.tool_calls:
        message["tool_calls"] = [choice.tool_calls[i] for i in sorted(choice.tool_calls)]
    return message


class SseReader:
    """Splits a byte stream of server-sent events into whole events, for a relay that passes each event on as soon
    as it is whole.

    `feed` returns the bytes of the events it completed (to pass on unchanged) and their JSON payloads. It holds
    back the end of an event not yet whole (no client acts on an event before its blank line), and everything from
    the `[DONE]` event on, however the reads split it: then `done` is true and `rest()` gives the held bytes.
    Comments and payloads that are not JSON pass on without a payload.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self.done = False

    def feed(self, data: bytes) -> tuple[bytes, list[dict[str, Any]]]:
        self._buffer += data
        if self.done:
            return b"", []
        events: list[dict[str, Any]] = []
        whole = 0  # the end of the whole events found so far
        while (end := _event_end(self._buffer, whole)) is not None:
            raw = self._buffer[whole : end[0]]
            payload = b"".join(line[5:].lstrip() for line in raw.splitlines() if line.startswith(b"data:"))
            if payload == b"[DONE]":
                self.done = True
                break
            whole = end[1]
            if payload:
                try:
                    events.append(json.loads(payload))
                except json.JSONDecodeError:
                    continue  # not ours to judge: the bytes are passed on to the agent unchanged
        passed, self._buffer = self._buffer[:whole], self._buffer[whole:]
        return passed, events

    def rest(self) -> bytes:
        """The bytes held back: from `[DONE]` on, or an event the stream never finished."""
        rest, self._buffer = self._buffer, b""
        return rest


def _event_end(buffer: bytes, start: int) -> tuple[int, int] | None:
    """(end of the first event from `start`, start of the next) if a whole event is buffered there."""
    positions = [(buffer.find(sep, start), len(sep)) for sep in (b"\n\n", b"\r\n\r\n")]
    found = [(pos, pos + size) for pos, size in positions if pos >= 0]
    return min(found) if found else None
