"""agent-lightning's emitter and reader names: `emit_annotation`, `get_rewards_from_span`, `get_message_value`,
`get_object_value`, `get_active_tracer`, and the `SpanNames` / `SpanAttributeNames` enums, on the spans our runner
stores and on spans as agl writes them."""

from __future__ import annotations

import base64
from typing import Any

import lightning as agl
from lightning.emitter import emit_annotation, get_message_value, get_object_value, get_rewards_from_span
from lightning.runner import LitAgentRunner
from lightning.store import InMemoryLightningStore
from lightning.tracer import get_active_tracer
from lightning.types import Span, SpanAttributeNames, SpanNames

SEEN: dict[str, Any] = {}


@agl.rollout
def annotating(task: str) -> None:
    SEEN["tracer"] = get_active_tracer()
    emit_annotation({"tag": "debug", "meta": {"turns": 2}, "agentlightning.reward": [{"name": "judge", "value": 0.5}]})
    agl.emit_message("thinking", attributes={"step": 1})
    agl.emit_object({"rooms": ["Orion"], "n": 1})
    agl.emit_reward({"correct": 1.0, "short": 0.25}, primary_key="correct")


async def test_what_an_agent_emitted_reads_back_with_agl_s_readers() -> None:
    runner = LitAgentRunner[str](agl.OtelTracer())
    store = InMemoryLightningStore(watchdog_interval=None)
    assert agl.get_active_tracer() is None  # outside any rollout
    with runner.run_context(agent=annotating, store=store):
        finished = await runner.step("go")
    assert SEEN["tracer"] is runner.tracer

    spans = {span.name: span for span in await store.query_spans(finished.rollout_id)}
    annotation = spans["lightning.annotation"]
    assert (annotation.attributes["tag"], annotation.attributes["meta.turns"]) == ("debug", 2)
    assert [(r.name, r.value) for r in get_rewards_from_span(annotation)] == [("judge", 0.5)]
    assert get_message_value(spans[SpanNames.MESSAGE]) == "thinking"
    assert SpanAttributeNames.MESSAGE in spans[SpanNames.MESSAGE].attributes
    assert get_object_value(spans[SpanNames.OBJECT]) == {"rooms": ["Orion"], "n": 1}
    assert [(r.name, r.value) for r in get_rewards_from_span(spans[SpanNames.REWARD])] == [
        ("correct", 1.0),
        ("short", 0.25),
    ]
    assert get_message_value(spans[SpanNames.REWARD]) is None and get_object_value(spans[SpanNames.REWARD]) is None
    assert emit_annotation({"x": 1}, propagate=False).attributes == {"x": 1}
    await store.close()


def agl_span(name: str, attributes: dict[str, Any]) -> Span:
    return Span(
        rollout_id="ro-1", attempt_id="at-1", sequence_id=1, trace_id="t" * 32, span_id="s1", name=name,
        attributes=attributes,
    )  # fmt: skip


def test_spans_as_agl_writes_them_read_too() -> None:
    assert get_message_value(agl_span("agentlightning.message", {"agentlightning.message.body": "hi"})) == "hi"
    literal = {"agentlightning.object.literal": "42", "agentlightning.object.type": "int"}
    assert get_object_value(agl_span("agentlightning.object", literal)) == 42
    raw = {
        "agentlightning.object.literal": base64.b64encode(b"\x00\x01").decode(),
        "agentlightning.object.type": "bytes",
    }
    assert get_object_value(agl_span("agentlightning.object", raw)) == b"\x00\x01"
    rewards = {"agentlightning.reward.1.name": "b", "agentlightning.reward.1.value": 0.0,
               "agentlightning.reward.0.name": "a", "agentlightning.reward.0.value": 1.0}  # fmt: skip
    assert [r.name for r in get_rewards_from_span(agl_span("agentlightning.annotation", rewards))] == ["a", "b"]
    assert get_rewards_from_span(agl_span("other", {})) == []
