"""Spans -> chat transcripts (request messages, the model's answer, reward) for prompt optimisation and SFT."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field

from lightning import semconv
from lightning.adapter.base import TraceAdapter
from lightning.adapter.triplets import DEFAULT_LLM_SPAN_NAME, AdaptReport, RewardMatch, select_llm_calls
from lightning.types import Span


class Transcript(BaseModel):
    """One LLM call as chat messages: the request's messages, then the model's answer (first choice)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    """The tools the request offered (OpenAI's shape), or None when it offered none."""
    reward: float | None = None
    """The reward the policy matched; None when there is none (kept: SFT may not need one)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """rollout_id, attempt_id, turn_index, span_id, sequence_id, operation, model, finish_reason."""


def spans_to_messages(
    spans: Sequence[Span],
    *,
    reward_match: RewardMatch = "final",
    agent_name: str | re.Pattern[str] | None = None,
    llm_span_name: str = DEFAULT_LLM_SPAN_NAME,
) -> list[Transcript]:
    """One transcript per LLM call of these spans, chosen and rewarded by the same rules as the triplets
    (see lightning.adapter.triplets). A call without `gen_ai.output.messages` (it failed) or whose messages
    are not JSON gives no transcript. A text completion's prompt string becomes one user message. Messages recorded in
    GenAI's `parts` shape (by OpenTelemetry's instrumentation of an agent's own OpenAI client) come out in OpenAI's."""
    calls = select_llm_calls(
        spans, AdaptReport(), reward_match=reward_match, agent_name=agent_name, pattern=llm_span_name
    )
    transcripts = []
    for call in calls:
        span = call.span
        request = _json_attribute(span, semconv.GEN_AI_INPUT_MESSAGES)
        outputs = _json_attribute(span, semconv.GEN_AI_OUTPUT_MESSAGES)
        if not isinstance(outputs, list) or not outputs or not isinstance(outputs[0], dict):
            continue
        if isinstance(request, str):
            request = [{"role": "user", "content": request}]
        if not isinstance(request, list) or not all(isinstance(message, dict) for message in request):
            continue
        request = [_openai_message(message) for message in request]
        answer = _openai_message(outputs[0])
        finish_reason = answer.pop("finish_reason", None)
        metadata = {
            "rollout_id": span.rollout_id,
            "attempt_id": span.attempt_id,
            "turn_index": call.turn_index,
            "span_id": span.span_id,
            "sequence_id": span.sequence_id,
            "operation": span.attributes.get(semconv.GEN_AI_OPERATION),
            "model": span.attributes.get(semconv.GEN_AI_RESPONSE_MODEL)
            or span.attributes.get(semconv.GEN_AI_REQUEST_MODEL),
            "finish_reason": finish_reason,
        }
        tools = _json_attribute(span, semconv.GEN_AI_TOOL_DEFINITIONS)
        transcripts.append(
            Transcript(
                messages=[*request, answer],
                tools=[_openai_tool(tool) for tool in tools] if isinstance(tools, list) else None,
                reward=call.reward,
                metadata=metadata,
            )
        )
    return transcripts


class TraceToMessages(TraceAdapter[list[dict[str, Any]]]):
    """agent-lightning's messages adapter: `TraceToMessages().adapt(spans)` (or called) -> one
    `{"messages": [...], "tools": [...] | None}` per LLM call, the request's messages then the model's answer, in
    OpenAI's fine-tuning shape. Over `spans_to_messages`: the calls are those the run's LLM proxy recorded (agl's
    reads its tracer's `gen_ai.prompt.*` attributes instead)."""

    def adapt(self, source: Sequence[Span], /) -> list[dict[str, Any]]:
        return [{"messages": t.messages, "tools": t.tools} for t in spans_to_messages(source)]


def _openai_message(message: dict[str, Any]) -> dict[str, Any]:
    """`message` in OpenAI's chat shape. GenAI's semantic conventions give a message a list of `parts` instead: text,
    tool calls (their arguments as JSON values) and tool call responses."""
    parts = message.get("parts")
    if not isinstance(parts, list):
        return dict(message)
    converted: dict[str, Any] = {"role": message.get("role")}
    texts = [str(part.get("content", "")) for part in parts if part.get("type") == "text"]
    responses = [part for part in parts if part.get("type") == "tool_call_response"]
    calls = [part for part in parts if part.get("type") == "tool_call"]
    if responses:
        converted["tool_call_id"] = responses[0].get("id")
        converted["content"] = _text(responses[0].get("response"))
    else:
        converted["content"] = "".join(texts) if texts else None
    if calls:
        converted["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": call.get("name"), "arguments": _text(call.get("arguments", {}))},
            }
            for call in calls
        ]
    if "finish_reason" in message:
        converted["finish_reason"] = message["finish_reason"]
    return converted


def _openai_tool(tool: Any) -> Any:
    """A tool definition in OpenAI's shape (`{"type": "function", "function": {...}}`); GenAI's conventions flatten
    the function into the tool."""
    if not isinstance(tool, dict) or "function" in tool or "name" not in tool:
        return tool
    return {"type": tool.get("type", "function"), "function": {k: v for k, v in tool.items() if k != "type"}}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _json_attribute(span: Span, attribute: str) -> Any:
    raw = span.attributes.get(attribute)
    if not isinstance(raw, str):
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return None
