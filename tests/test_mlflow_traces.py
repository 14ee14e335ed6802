"""Rollouts as MLflow traces on a local MLflow store: the span tree (parents kept, dangling ones under the rollout),
LLM calls as chats with token usage, rewards, original timestamps, tags; an attempt is written once. The same
against a real `mlflow server` after a training flow: tests/test_mlflow_server.py."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest

from lightning import mlflow_traces, semconv
from lightning.metrics import MlflowTracker
from lightning.mlflow_traces import TraceWriter, choose, trace_tags, write_traces
from lightning.types import Attempt, AttemptedRollout, Span


def test_choose_spreads_the_sample_over_the_rollouts() -> None:
    ids = [f"r{i}" for i in range(32)]
    assert choose(ids, 4) == ["r0", "r8", "r16", "r24"]
    assert choose(ids, "all") == ids and choose(ids, 100) == ids and choose(ids, 0) == []


def test_a_held_out_trace_is_placed_by_its_checkpoint_not_an_iteration() -> None:
    """`tags.iteration = '3'` finds iteration 3's training rollouts; a held-out rollout of checkpoint 3 is tagged
    `checkpoint` (it was tagged `iteration` with the step, and the filter found it instead)."""
    trained, _ = rollout(0.0)
    held_out = trained.model_copy(update={"mode": "val"})
    assert trace_tags(trained, 1.0)["iteration"] == "2" and "checkpoint" not in trace_tags(trained, 1.0)
    assert trace_tags(held_out, 1.0)["checkpoint"] == "2" and "iteration" not in trace_tags(held_out, 1.0)


def rollout(start: float) -> tuple[AttemptedRollout, list[Span]]:
    attempt = Attempt(rollout_id="ro-1", attempt_id="at-1", sequence_id=1, start_time=start, end_time=start + 3,
                      status="succeeded", worker_id="runner-0")  # fmt: skip
    rolled = AttemptedRollout(
        rollout_id="ro-1", input={"word": "abcd"}, start_time=start, mode="train", status="succeeded", attempt=attempt,
        metadata={"run_name": "r", "iteration": 2, "task_index": 0, "group_id": "r/train/2/0"},
    )  # fmt: skip
    common = {"rollout_id": "ro-1", "attempt_id": "at-1", "trace_id": "a" * 32}
    agent = Span(**common, sequence_id=1, span_id="1" * 16, name=semconv.OPERATION_SPAN, start_time=start + 0.1,
                 end_time=start + 2.5, attributes={semconv.OPERATION_NAME: "solve"})  # fmt: skip
    call = Span(
        **common, sequence_id=2, span_id="2" * 16, parent_id="1" * 16, name="chat policy", start_time=start + 0.5,
        end_time=start + 1.0, status={"status_code": "OK"},
        attributes={
            semconv.GEN_AI_OPERATION: "chat", semconv.GEN_AI_REQUEST_MODEL: "policy",
            semconv.GEN_AI_INPUT_MESSAGES: json.dumps([{"role": "user", "content": "last letter of abcd?"}]),
            semconv.GEN_AI_OUTPUT_MESSAGES: json.dumps([{"role": "assistant", "content": "d", "finish_reason": "end"}]),
            semconv.GEN_AI_INPUT_TOKENS: 7, semconv.GEN_AI_OUTPUT_TOKENS: 1, semconv.LLM_PROMPT_TOKEN_IDS: "AAAA",
            "gen_ai.request.temperature": 1.0, semconv.LLM_LATENCY_MS: 500.0,
        },
    )  # fmt: skip
    reward = Span(**common, sequence_id=3, span_id="3" * 16, parent_id="9" * 16, name=semconv.REWARD_SPAN,
                  start_time=start + 2.6, end_time=start + 2.6, attributes={semconv.REWARD_VALUE: 1.0})  # fmt: skip
    return rolled, [reward, call, agent]


@pytest.mark.slow  # about 20 s: MLflow's store imports LiteLLM to price the LLM call
def test_a_rollout_becomes_one_trace_of_the_run_once(tmp_path: Path) -> None:
    tracker = MlflowTracker(f"sqlite:///{tmp_path}/mlflow.db", experiment="traces", run_name="r")
    tracker.start()
    start = time.time() - 3600
    record = rollout(start)
    [trace_id] = write_traces(tracker, [record])
    assert write_traces(tracker, [record]) == []  # a retried stage, a resumed run

    [trace] = tracker.client.search_traces(
        locations=[tracker.experiment_id], run_id=tracker.run_id,
        filter_string="tags.iteration = '2' AND tags.reward = '1.0' AND tags.mode = 'train'",
    )  # fmt: skip
    assert trace.info.trace_id == trace_id and trace.info.request_time == int(start * 1000)
    assert {key: trace.info.tags[key] for key in ("rollout_id", "attempt", "attempt_id", "task", "status")} == {
        "rollout_id": "ro-1", "attempt": "1", "attempt_id": "at-1", "task": '{"word": "abcd"}', "status": "succeeded"
    }  # fmt: skip
    spans = {span.name: span for span in trace.data.spans}
    root, solve, chat, reward = spans["rollout"], spans["solve"], spans["chat policy"], spans[semconv.REWARD_SPAN]
    assert root.parent_id is None and root.inputs == {"word": "abcd"} and root.outputs["reward"] == 1.0
    assert solve.parent_id == root.span_id and chat.parent_id == solve.span_id and reward.parent_id == root.span_id
    assert chat.span_type == "CHAT_MODEL" and reward.span_type == "EVALUATOR"
    assert chat.start_time_ns == int((start + 0.5) * 1e9) and chat.end_time_ns == int((start + 1.0) * 1e9)
    assert chat.inputs == {"messages": [{"role": "user", "content": "last letter of abcd?"}], "model": "policy",
                           "temperature": 1.0}  # fmt: skip
    assert chat.outputs["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "d"},
                                        "finish_reason": "end"}]  # fmt: skip
    assert chat.attributes["mlflow.chat.tokenUsage"] == {"input_tokens": 7, "output_tokens": 1, "total_tokens": 8}
    assert chat.attributes[semconv.LLM_LATENCY_MS] == 500.0 and semconv.LLM_PROMPT_TOKEN_IDS not in chat.attributes
    # The reward as an assessment too: the Traces tab's score column.
    [assessment] = [each for each in trace.info.assessments if each.name == "reward"]
    assert assessment.value == 1.0 and assessment.source.source_type == "CODE"
    tracker.end()


def test_the_trace_writer_writes_in_the_background_in_order_and_logs_failures(monkeypatch, caplog) -> None:
    """The writer's thread (not the caller's) writes each batch, in order; `flush` waits for them all; a batch that
    fails is logged and counted, and the ones after it are still written; `close` writes what is left."""
    written: list[tuple[str, str]] = []
    release = threading.Event()

    def fake_write(tracker, records):
        release.wait(5)
        if records == ["bad"]:
            raise RuntimeError("MLflow is down")
        written.extend((threading.current_thread().name, record) for record in records)
        return list(records)

    monkeypatch.setattr(mlflow_traces, "write_traces", fake_write)
    writer = TraceWriter(tracker=object())
    writer.submit(["a", "b"])
    writer.submit(["bad"])
    writer.submit(["c"])
    assert written == []  # submitting did not wait for the writes
    with caplog.at_level(logging.ERROR, logger="lightning.mlflow_traces"):
        release.set()
        writer.flush()
    assert [record for _, record in written] == ["a", "b", "c"]
    assert {thread for thread, _ in written} == {"mlflow-trace-writer"}
    assert writer.written == 3 and writer.failures == 1
    assert "MLflow is down" in caplog.text
    writer.submit(["d"])
    writer.close()
    assert written[-1][1] == "d"
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(["e"])
