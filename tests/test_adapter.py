"""The adapter: span forest with timing repair, LLM calls -> triplets (both shapes, every reward policy and
every reported problem), chat transcripts, and `adapt_rollouts` against a real SQLite store."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from lightning import semconv
from lightning.adapter import (
    AdaptReport,
    SpanNode,
    TraceToMessages,
    adapt_rollouts,
    build_forest,
    iter_forest,
    spans_to_messages,
    spans_to_triplets,
)
from lightning.store import SqlLightningStore
from lightning.tracing import Tracer, emit_reward, operation
from lightning.types import Span, TraceStatus, Triplet

ROLLOUT = "ro-test"
ATTEMPT = "at-test"


# --- spans as the proxy and the tracer write them ----------------------------------------------------


def llm_span(
    seq: int,
    span_id: str,
    start: float,
    end: float,
    *,
    prompt: list[int] | None,
    responses: list[list[int]] | None,
    parent_id: str | None = None,
    finish_reasons: list[str] | None = None,
    weight_version: int | None = None,
    logprobs: list[list[float]] | None = None,
    messages: Any = None,
    outputs: list[dict[str, Any]] | None = None,
    rollout_id: str = ROLLOUT,
    attempt_id: str = ATTEMPT,
) -> Span:
    """An LLM call span as the proxy's `_record` writes it: GenAI name and attributes, token ids encoded."""
    attributes: dict[str, Any] = {
        semconv.GEN_AI_OPERATION: "chat",
        semconv.GEN_AI_REQUEST_MODEL: "tiny",
        semconv.GEN_AI_INPUT_MESSAGES: json.dumps(messages or [{"role": "user", "content": "hi"}]),
        semconv.LLM_BACKEND: "http://127.0.0.1:8000",
    }
    if responses is not None:
        reasons = finish_reasons or ["stop"] * len(responses)
        attributes[semconv.GEN_AI_FINISH_REASONS] = reasons
        attributes[semconv.GEN_AI_OUTPUT_MESSAGES] = json.dumps(
            outputs
            or [{"role": "assistant", "content": f"answer {i}", "finish_reason": r} for i, r in enumerate(reasons)]
        )
        attributes[semconv.LLM_RESPONSE_TOKEN_IDS] = [semconv.encode_token_ids(ids) for ids in responses]
    if prompt is not None:
        attributes[semconv.LLM_PROMPT_TOKEN_IDS] = semconv.encode_token_ids(prompt)
    if weight_version is not None:
        attributes[semconv.LLM_WEIGHT_VERSION] = weight_version
    if logprobs is not None:
        attributes[semconv.LLM_RESPONSE_LOGPROBS] = [semconv.encode_logprobs(values) for values in logprobs]
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=seq,
        trace_id="t" * 32,
        span_id=span_id,
        parent_id=parent_id,
        name="chat tiny",
        status=TraceStatus(status_code="OK"),
        attributes=attributes,
        start_time=start,
        end_time=end,
    )


def reward_span(seq: int, span_id: str, value: float, at: float, *, parent_id: str | None = None) -> Span:
    """A reward span as `emit_reward` records it: a zero-length span with the primary value."""
    return Span(
        rollout_id=ROLLOUT,
        attempt_id=ATTEMPT,
        sequence_id=seq,
        trace_id="t" * 32,
        span_id=span_id,
        parent_id=parent_id,
        name=semconv.REWARD_SPAN,
        attributes={semconv.REWARD_VALUE: value},
        start_time=at,
        end_time=at,
    )


def op_span(
    seq: int,
    span_id: str,
    start: float,
    end: float,
    *,
    name: str = semconv.OPERATION_SPAN,
    operation_name: str | None = None,
    parent_id: str | None = None,
    attributes: dict[str, Any] | None = None,
) -> Span:
    attrs = dict(attributes or {})
    if operation_name is not None:
        attrs[semconv.OPERATION_NAME] = operation_name
    return Span(
        rollout_id=ROLLOUT,
        attempt_id=ATTEMPT,
        sequence_id=seq,
        trace_id="t" * 32,
        span_id=span_id,
        parent_id=parent_id,
        name=name,
        attributes=attrs,
        start_time=start,
        end_time=end,
    )


def shape_of(roots: list[SpanNode]) -> dict[str, list[str]]:
    """span id -> child span ids, for every node of the forest."""
    return {node.span.span_id: [child.span.span_id for child in node.children] for node in iter_forest(roots)}


# --- the forest --------------------------------------------------------------------------------------


def test_children_are_ordered_by_start_time_then_sequence_id() -> None:
    spans = [
        op_span(1, "root", 0, 10),
        op_span(4, "c", 2, 3, parent_id="root"),
        op_span(3, "b", 1, 3, parent_id="root"),
        op_span(2, "a", 1, 2, parent_id="root"),
    ]
    (root,) = build_forest(spans)
    assert [child.span.span_id for child in root.children] == ["a", "b", "c"]
    assert [node.span.span_id for node in root.walk()] == ["root", "a", "b", "c"]


def test_orphans_are_attached_under_the_innermost_span_containing_them() -> None:
    spans = [
        op_span(1, "outer", 0, 10),
        op_span(2, "inner", 1, 5, parent_id="outer"),
        # The proxy's span when the agent's client sent no traceparent: no parent at all.
        llm_span(3, "call", 2, 3, prompt=[1], responses=[[2]]),
        # A span whose parent was lost, in another trace.
        op_span(4, "lost-parent", 6, 7, parent_id="gone").model_copy(update={"trace_id": "u" * 32}),
        op_span(5, "after", 11, 12),
        op_span(6, "untimed", 0, 0).model_copy(update={"start_time": None, "end_time": None}),
    ]
    roots = build_forest(spans)
    assert [root.span.span_id for root in roots] == ["outer", "after", "untimed"]
    assert shape_of(roots)["outer"] == ["inner", "lost-parent"]
    assert shape_of(roots)["inner"] == ["call"]
    by_id = {node.span.span_id: node for node in iter_forest(roots)}
    assert by_id["call"].attached_by_time and by_id["lost-parent"].attached_by_time
    assert not by_id["inner"].attached_by_time
    assert [node.span.span_id for node in by_id["call"].ancestors()] == ["inner", "outer"]


def test_repair_never_closes_a_cycle() -> None:
    spans = [
        # Two orphans with the same interval: one goes under the other (a ended first: it is the inner one).
        op_span(1, "a", 0, 5),
        op_span(2, "b", 0, 5),
        op_span(3, "x", 6, 7, parent_id="y"),  # parent ids naming each other
        op_span(4, "y", 6, 7, parent_id="x"),
    ]
    roots = build_forest(spans)
    nodes = list(iter_forest(roots))
    assert len(nodes) == 4  # every span reachable from a root: no cycle
    assert shape_of(roots)["b"] == ["a"]
    assert shape_of(roots)["y"] == ["x"]
    assert [root.span.span_id for root in roots] == ["b", "y"]


# --- reward policies ---------------------------------------------------------------------------------


def policy_spans() -> list[Span]:
    """agent [0,10]: call1, a tool op holding reward 0.1, call2, reward 0.7; then a top-level reward 0.9."""
    return [
        op_span(1, "agent", 0, 10, operation_name="agent"),
        llm_span(2, "call1", 1, 2, prompt=[1, 2], responses=[[3]], parent_id="agent"),
        op_span(3, "tool", 2.2, 2.8, operation_name="lookup", parent_id="agent"),
        reward_span(4, "r-tool", 0.1, 2.5, parent_id="tool"),
        llm_span(5, "call2", 3, 4, prompt=[1, 2, 3, 4], responses=[[5]], parent_id="agent"),
        reward_span(6, "r-agent", 0.7, 5, parent_id="agent"),
        reward_span(7, "r-final", 0.9, 11),
    ]


@pytest.mark.parametrize(
    ("reward_match", "expected"),
    [("final", [0.9, 0.9]), ("first_after", [0.1, 0.7]), ("first_sibling", [0.7, 0.7])],
)
def test_each_reward_policy(reward_match: Any, expected: list[float]) -> None:
    result = spans_to_triplets(policy_spans(), reward_match=reward_match)
    assert [t.reward for t in result.triplets] == expected
    assert [t.metadata["span_id"] for t in result.triplets] == ["call1", "call2"]
    assert result.report.triplets_without_matched_reward == 0


def test_a_call_with_no_reward_after_it_is_dropped_and_counted() -> None:
    spans = [
        llm_span(1, "call1", 1, 2, prompt=[1], responses=[[2]]),
        reward_span(2, "r", 0.5, 3),
        llm_span(3, "call2", 4, 5, prompt=[1, 2, 9], responses=[[3]]),
    ]
    result = spans_to_triplets(spans, reward_match="first_after")
    assert [t.metadata["span_id"] for t in result.triplets] == ["call1"]
    assert result.report.triplets_without_matched_reward == 1
    assert any(ROLLOUT in line and "first_after" in line for line in result.report.problems)


def test_an_unknown_reward_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="reward_match"):
        spans_to_triplets(policy_spans(), reward_match="nearest")  # type: ignore[arg-type]


# --- which calls count ----------------------------------------------------------------------------


def test_calls_in_reward_code_are_skipped() -> None:
    spans = [
        llm_span(1, "agent-call", 1, 2, prompt=[1], responses=[[2]]),
        # A judge written with `operation("judge")`: its call names the operation as parent.
        op_span(2, "judge", 3, 6, operation_name="judge"),
        llm_span(3, "judge-call", 4, 5, prompt=[7], responses=[[8]], parent_id="judge"),
        # A grader's call through the proxy without traceparent: found inside the operation by timing.
        op_span(4, "grade", 7, 10, operation_name="compute_reward"),
        llm_span(5, "grader-call", 8, 9, prompt=[7], responses=[[8]]),
        # A call under a reward span itself (agent-lightning reward spans can have children).
        op_span(6, "peer-reward", 11, 14, name=semconv.PEER_REWARD_SPAN, attributes={"reward": 1.0}),
        llm_span(7, "peer-call", 12, 13, prompt=[7], responses=[[8]], parent_id="peer-reward"),
        reward_span(8, "r", 1.0, 15),
    ]
    result = spans_to_triplets(spans)
    assert [t.metadata["span_id"] for t in result.triplets] == ["agent-call"]
    assert result.report.calls_in_reward_code_skipped == 3
    assert result.report.llm_calls == 1


def test_agent_filter_uses_the_nearest_agent_span() -> None:
    spans = [
        op_span(1, "planner", 0, 20, name="planning", attributes={"agent.name": "planner"}),
        llm_span(2, "plan-call", 1, 2, prompt=[1], responses=[[2]], parent_id="planner"),
        op_span(3, "coder", 3, 10, name="agent coder", parent_id="planner"),
        llm_span(4, "code-call", 4, 5, prompt=[3], responses=[[4]], parent_id="coder"),
        op_span(5, "reviewer", 11, 15, attributes={"lightning.agent.name": "reviewer"}, parent_id="planner"),
        llm_span(6, "review-call", 12, 13, prompt=[5], responses=[[6]], parent_id="reviewer"),
        llm_span(7, "loose-call", 21, 22, prompt=[7], responses=[[8]]),
        reward_span(8, "r", 1.0, 23),
    ]
    planner = spans_to_triplets(spans, agent_name="planner")
    assert [t.metadata["span_id"] for t in planner.triplets] == ["plan-call"]
    assert planner.report.calls_filtered_by_agent == 3
    coder = spans_to_triplets(spans, agent_name="coder")
    assert [t.metadata["span_id"] for t in coder.triplets] == ["code-call"]
    reviewer = spans_to_triplets(spans, agent_name="reviewer")
    assert [t.metadata["span_id"] for t in reviewer.triplets] == ["review-call"]
    assert len(spans_to_triplets(spans).triplets) == 4


def test_agent_lightning_spans_and_client_wrappers() -> None:
    spans = [
        # 0.3 style: the client's span carries plain int lists.
        op_span(
            1,
            "peer-call",
            1,
            2,
            name="openai.chat.completion",
            attributes={"prompt_token_ids": [1, 2], "response_token_ids": [3, 4]},
        ),
        # A client-side span around the proxy's span: the proxy's (inner) one is used.
        op_span(2, "wrapper", 3, 6, name="openai.chat.completion"),
        llm_span(3, "proxy-call", 4, 5, prompt=[1, 2, 3, 4, 5], responses=[[6]], parent_id="wrapper"),
        op_span(4, "peer-reward", 7, 7, name=semconv.PEER_REWARD_SPAN, attributes={"reward": 0.5}),
    ]
    result = spans_to_triplets(spans)
    assert [(t.prompt, t.response, t.reward) for t in result.triplets] == [
        ([1, 2], [3, 4], 0.5),
        ([1, 2, 3, 4, 5], [6], 0.5),
    ]
    assert result.report.wrapper_llm_spans_skipped == 1
    assert result.report.calls_without_token_ids == 0


# --- transitions -------------------------------------------------------------------------------------


def test_transitions_one_per_choice_with_metadata() -> None:
    spans = [
        llm_span(1, "c0", 1, 2, prompt=[1, 2], responses=[[3, 4]], weight_version=7),
        llm_span(2, "c1", 3, 4, prompt=[5], responses=[[6], [7, 8]], finish_reasons=["stop", "length"]),
        reward_span(3, "r", 1.5, 5),
    ]
    result = spans_to_triplets(spans, group_id="task-3")
    assert [(t.prompt, t.response) for t in result.triplets] == [([1, 2], [3, 4]), ([5], [6]), ([5], [7, 8])]
    assert all(t.reward == 1.5 and t.response_mask is None for t in result.triplets)
    first, second, third = (t.metadata for t in result.triplets)
    assert first == {
        "rollout_id": ROLLOUT,
        "attempt_id": ATTEMPT,
        "group_id": "task-3",
        "advantage_group": "task-3/turn-0",
        "turn_index": 0,
        "choice_index": 0,
        "sequence_id": 1,
        "span_id": "c0",
        "finish_reason": "stop",
        "weight_version": 7,
    }
    assert (second["turn_index"], second["choice_index"], second["finish_reason"]) == (1, 0, "stop")
    assert (third["turn_index"], third["choice_index"], third["finish_reason"]) == (1, 1, "length")
    assert "weight_version" not in second
    assert result.report.llm_calls == 2 and result.report.rollouts_with_triplets == 1


def test_group_id_defaults_to_the_rollout_id() -> None:
    (triplet,) = spans_to_triplets(
        [llm_span(1, "c", 1, 2, prompt=[1], responses=[[2]]), reward_span(2, "r", 1, 3)]
    ).triplets
    assert triplet.metadata["group_id"] == ROLLOUT


def test_spans_of_several_attempts_are_refused() -> None:
    spans = [
        llm_span(1, "c", 1, 2, prompt=[1], responses=[[2]]),
        llm_span(1, "d", 1, 2, prompt=[1], responses=[[2]], attempt_id="at-other"),
    ]
    with pytest.raises(ValueError, match="one attempt"):
        spans_to_triplets(spans)
    assert spans_to_triplets([]).report == AdaptReport()


# --- trajectories ------------------------------------------------------------------------------------

P0, R0 = [1, 2, 3], [10, 11]
TOOL1, R1 = [20, 21], [12]
TOOL2, R2 = [22], [13, 14]
P1 = P0 + R0 + TOOL1
P2 = P1 + R1 + TOOL2


def test_trajectory_of_three_turns_masks_what_the_model_did_not_say() -> None:
    spans = [
        llm_span(1, "t0", 1, 2, prompt=P0, responses=[R0], weight_version=3),
        llm_span(2, "t1", 3, 4, prompt=P1, responses=[R1], weight_version=3),
        llm_span(3, "t2", 5, 6, prompt=P2, responses=[R2], finish_reasons=["length"], weight_version=3),
        reward_span(4, "r", 1.0, 7),
    ]
    result = spans_to_triplets(spans, shape="trajectory")
    (row,) = result.triplets
    assert row.prompt == [1, 2, 3]
    assert row.response == [10, 11, 20, 21, 12, 22, 13, 14]
    assert row.response_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert row.reward == 1.0
    assert row.metadata == {
        "rollout_id": ROLLOUT,
        "attempt_id": ATTEMPT,
        "group_id": ROLLOUT,
        "turn_index": 0,
        "turn_count": 3,
        "segment_index": 0,
        "sequence_id": 1,
        "span_ids": ["t0", "t1", "t2"],
        "finish_reason": "length",
        "weight_version": 3,
    }
    assert result.report.trajectory_splits == 0


def test_the_sampler_s_log_probs_go_with_each_row_zero_where_the_model_did_not_speak() -> None:
    sampled = {"t0": [-0.5, -1.0], "t1": [-0.25], "t2": [-1.5, -0.125]}
    spans = [
        llm_span(1, "t0", 1, 2, prompt=P0, responses=[R0], logprobs=[sampled["t0"]]),
        llm_span(2, "t1", 3, 4, prompt=P1, responses=[R1], logprobs=[sampled["t1"]]),
        llm_span(3, "t2", 5, 6, prompt=P2, responses=[R2], logprobs=[sampled["t2"]]),
        reward_span(4, "r", 1.0, 7),
    ]
    (row,) = spans_to_triplets(spans, shape="trajectory").triplets
    assert row.response_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert row.metadata["response_log_probs"] == [-0.5, -1.0, 0.0, 0.0, -0.25, 0.0, -1.5, -0.125]
    transitions = spans_to_triplets(spans, shape="transition").triplets
    assert [t.metadata["response_log_probs"] for t in transitions] == [sampled["t0"], sampled["t1"], sampled["t2"]]
    # One call without them: the row has none (a batch takes the sampler's log-probs only when every row has them).
    spans[1] = llm_span(2, "t1", 3, 4, prompt=P1, responses=[R1])
    (row,) = spans_to_triplets(spans, shape="trajectory").triplets
    assert "response_log_probs" not in row.metadata


def test_trajectory_splits_where_the_history_was_rewritten() -> None:
    rewritten = [1, 2, 99, 12, 22]  # turn 2's prompt no longer starts with turn 1's prompt + response
    spans = [
        llm_span(1, "t0", 1, 2, prompt=P0, responses=[R0]),
        llm_span(2, "t1", 3, 4, prompt=P1, responses=[R1]),
        llm_span(3, "t2", 5, 6, prompt=rewritten, responses=[R2]),
        reward_span(4, "r", 0.5, 7),
    ]
    result = spans_to_triplets(spans, shape="trajectory")
    first, second = result.triplets
    assert (first.prompt, first.response, first.response_mask) == (P0, R0 + TOOL1 + R1, [1, 1, 0, 0, 1])
    assert (second.prompt, second.response, second.response_mask) == (rewritten, R2, [1, 1])
    assert (second.metadata["turn_index"], second.metadata["segment_index"]) == (2, 1)
    assert first.reward == second.reward == 0.5
    assert result.report.trajectory_splits == 1
    assert any("turn 2" in line and ROLLOUT in line for line in result.report.problems)


def test_trajectory_follows_the_choice_the_next_turn_continues() -> None:
    spans = [
        llm_span(1, "t0", 1, 2, prompt=P0, responses=[[50], R0]),
        llm_span(2, "t1", 3, 4, prompt=P1, responses=[R1]),
        reward_span(3, "r", 1.0, 5),
    ]
    result = spans_to_triplets(spans, shape="trajectory")
    (row,) = result.triplets
    assert row.response == R0 + TOOL1 + R1
    assert result.report.unused_choices == 1


# --- reported problems ------------------------------------------------------------------------------


def test_a_rollout_without_reward_is_dropped_and_counted() -> None:
    result = spans_to_triplets([llm_span(1, "c", 1, 2, prompt=[1], responses=[[2]])])
    assert result.triplets == []
    assert result.report.rollouts_without_reward == 1
    assert result.report.rollouts_with_triplets == 0
    assert any(ROLLOUT in line and "no reward" in line for line in result.report.problems)


def test_a_call_without_token_ids_is_dropped_and_counted() -> None:
    spans = [
        llm_span(1, "no-ids", 1, 2, prompt=None, responses=None),  # e.g. a failed call
        llm_span(2, "ok", 3, 4, prompt=[1], responses=[[2]]),
        reward_span(3, "r", 1.0, 5),
    ]
    result = spans_to_triplets(spans)
    assert [t.metadata["span_id"] for t in result.triplets] == ["ok"]
    assert result.triplets[0].metadata["turn_index"] == 1
    assert result.report.calls_without_token_ids == 1 and result.report.llm_calls == 2
    assert any("no-ids" in line and ROLLOUT in line for line in result.report.problems)


def test_an_empty_response_is_kept_and_counted_unless_the_prompt_is_empty_too() -> None:
    spans = [
        llm_span(1, "empty", 1, 2, prompt=[1, 2], responses=[[]]),
        llm_span(2, "nothing", 3, 4, prompt=[], responses=[[]]),
        reward_span(3, "r", 0.25, 5),
    ]
    result = spans_to_triplets(spans)
    assert [(t.prompt, t.response, t.reward) for t in result.triplets] == [([1, 2], [], 0.25)]
    assert result.report.empty_responses == 2


def test_a_rollout_without_llm_calls_is_counted() -> None:
    result = spans_to_triplets([op_span(1, "agent", 0, 1), reward_span(2, "r", 1.0, 2)])
    assert result.triplets == []
    assert result.report.rollouts_without_llm_calls == 1 and result.report.rollouts == 1
    assert result.report.problems == [f"rollout {ROLLOUT} (attempt {ATTEMPT}): no LLM call spans"]


def test_reports_add_up_and_keep_a_bounded_list_of_problems() -> None:
    total = AdaptReport()
    for _ in range(30):
        total.add(spans_to_triplets([llm_span(1, "c", 1, 2, prompt=[1], responses=[[2]])]).report)
    assert total.rollouts == total.rollouts_without_reward == 30
    assert len(total.problems) == 20


def test_response_mask_must_fit_the_response() -> None:
    assert Triplet(prompt=[1], response=[2]).response_mask is None
    with pytest.raises(ValidationError, match="entries"):
        Triplet(prompt=[1], response=[2, 3], response_mask=[1])
    with pytest.raises(ValidationError, match="only 0 and 1"):
        Triplet(prompt=[1], response=[2], response_mask=[2])


# --- messages ----------------------------------------------------------------------------------------


def test_spans_to_messages() -> None:
    request = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    spans = [
        llm_span(
            1,
            "c",
            1,
            2,
            prompt=None,  # transcripts need no token ids
            responses=None,
            messages=request,
        ).model_copy(
            update={
                "attributes": {
                    semconv.GEN_AI_OPERATION: "chat",
                    semconv.GEN_AI_REQUEST_MODEL: "tiny",
                    semconv.GEN_AI_INPUT_MESSAGES: json.dumps(request),
                    semconv.GEN_AI_OUTPUT_MESSAGES: json.dumps(
                        [
                            {"role": "assistant", "content": "4", "finish_reason": "stop"},
                            {"role": "assistant", "content": "four", "finish_reason": "stop"},
                        ]
                    ),
                }
            }
        ),
        op_span(2, "judge", 3, 6, operation_name="judge"),
        llm_span(3, "judge-call", 4, 5, prompt=[1], responses=[[2]], parent_id="judge"),
        llm_span(4, "failed", 7, 8, prompt=None, responses=None),
        reward_span(5, "r", 1.0, 9),
    ]
    (transcript,) = spans_to_messages(spans)
    assert transcript.messages == [*request, {"role": "assistant", "content": "4"}]
    assert transcript.reward == 1.0
    assert transcript.metadata["finish_reason"] == "stop"
    assert (transcript.metadata["span_id"], transcript.metadata["turn_index"]) == ("c", 0)
    assert transcript.metadata["model"] == "tiny"


def test_trace_to_messages_gives_agl_s_shape_with_the_request_s_tools() -> None:
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    call = llm_span(1, "c", 1, 2, prompt=None, responses=[[1]], messages=[{"role": "user", "content": "hi"}])
    with_tools = call.model_copy(
        update={"attributes": {**call.attributes, semconv.GEN_AI_TOOL_DEFINITIONS: json.dumps([tool])}}
    )
    plain = llm_span(3, "d", 3, 4, prompt=None, responses=[[2]])
    adapter = TraceToMessages()
    assert adapter.adapt([with_tools, plain, reward_span(5, "r", 1.0, 5)]) == [
        {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "answer 0"}],
            "tools": [tool],
        },
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "answer 0"}], "tools": None},
    ]
    assert adapter([plain]) == adapter.adapt([plain])


# --- against a real store ----------------------------------------------------------------------------


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[SqlLightningStore]:
    store = SqlLightningStore(f"sqlite:///{tmp_path}/s.db", watchdog_interval=None)
    try:
        yield store
    finally:
        await store.close()


async def run_agent(store: SqlLightningStore, tracer: Tracer, reward: float | None) -> str:
    """Claim a rollout and trace one agent turn: an operation, a proxy call inside it (no traceparent,
    so only timing places it), then the reward."""
    claimed = await store.dequeue_rollout(worker_id="w")
    assert claimed is not None
    rollout_id, attempt_id = claimed.rollout_id, claimed.attempt.attempt_id
    async with tracer.trace_context(rollout_id, attempt_id):
        with operation("agent"):
            started = time.time()
            ended = time.time()
            sequence_id = await store.get_next_span_sequence_id(rollout_id, attempt_id)
            await store.add_span(
                llm_span(
                    sequence_id,
                    f"call-{rollout_id}",
                    started,
                    ended,
                    prompt=[1, 2],
                    responses=[[3]],
                    rollout_id=rollout_id,
                    attempt_id=attempt_id,
                )
            )
        if reward is not None:
            emit_reward(reward)
    return rollout_id


async def test_adapt_rollouts_reads_latest_attempts_from_a_sqlite_store(sqlite_store: SqlLightningStore) -> None:
    grouped = [await sqlite_store.enqueue_rollout({"task": 7}, metadata={"group_id": "task-7"}) for _ in range(2)]
    lone = await sqlite_store.enqueue_rollout({"task": 8})
    unrewarded = await sqlite_store.enqueue_rollout({"task": 9})
    never_run = await sqlite_store.enqueue_rollout({"task": 10})
    tracer = Tracer(sqlite_store, flush_interval=0.05)
    try:
        ran = [await run_agent(sqlite_store, tracer, reward) for reward in (1.0, 0.0, 0.5, None)]
    finally:
        tracer.shutdown()
    assert ran == [r.rollout_id for r in (*grouped, lone, unrewarded)]

    ids = [*ran, never_run.rollout_id, "ro-missing"]
    result = await adapt_rollouts(sqlite_store, ids)
    assert [(t.metadata["rollout_id"], t.metadata["group_id"], t.reward) for t in result.triplets] == [
        (grouped[0].rollout_id, "task-7", 1.0),
        (grouped[1].rollout_id, "task-7", 0.0),
        (lone.rollout_id, lone.rollout_id, 0.5),
    ]
    assert all((t.prompt, t.response) == ([1, 2], [3]) for t in result.triplets)
    report = result.report
    assert (report.rollouts, report.rollouts_with_triplets, report.llm_calls) == (5, 3, 4)
    assert (report.rollouts_without_reward, report.rollouts_without_llm_calls, report.rollouts_missing) == (1, 1, 1)

    # The proxy's call was placed inside the agent operation by timing, so a judge would have been caught too.
    spans = await sqlite_store.query_spans(grouped[0].rollout_id, "latest")
    roots = build_forest(spans)
    agent = next(node for node in iter_forest(roots) if node.span.name == semconv.OPERATION_SPAN)
    assert [child.span.name for child in agent.children] == ["chat tiny"]
    assert agent.children[0].attached_by_time
