"""Spans -> chat transcripts (request messages, the model's answer, reward) for prompt optimisation and SFT."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field

from lightning import semconv
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
    agent_name: str | None = None,
    llm_span_name: str = DEFAULT_LLM_SPAN_NAME,
) -> list[Transcript]:
    """One transcript per LLM call of these spans, chosen and rewarded by the same rules as the triplets
    (see lightning.adapter.triplets). A call without `gen_ai.output.messages` (it failed) or whose messages
    are not JSON gives no transcript. A text completion's prompt string becomes one user message."""
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
        answer = dict(outputs[0])
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
                tools=tools if isinstance(tools, list) else None,
                reward=call.reward,
                metadata=metadata,
            )
        )
    return transcripts


class TraceToMessages:
    """agent-lightning's messages adapter: `TraceToMessages().adapt(spans)` (or called) -> one
    `{"messages": [...], "tools": [...] | None}` per LLM call, the request's messages then the model's answer, in
    OpenAI's fine-tuning shape. Over `spans_to_messages`: the calls are those the run's LLM proxy recorded (agl's
    reads its tracer's `gen_ai.prompt.*` attributes instead)."""

    def adapt(self, source: Sequence[Span], /) -> list[dict[str, Any]]:
        return [{"messages": t.messages, "tools": t.tools} for t in spans_to_messages(source)]

    __call__ = adapt


def _json_attribute(span: Span, attribute: str) -> Any:
    raw = span.attributes.get(attribute)
    if not isinstance(raw, str):
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return None
