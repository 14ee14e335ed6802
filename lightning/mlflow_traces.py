"""Rollouts as MLflow traces: what the agent did, where MLflow's UI shows it (the run's Traces tab).

Each exported rollout (its latest attempt) becomes one MLflow trace linked to the run: a root `rollout` span (the
task in, the reward and status out) over the attempt's spans from the store, with their original timestamps and
parent links. LLM calls through the proxy become CHAT_MODEL spans whose inputs and outputs are the request's
messages and the response's choices in OpenAI's format (tool calls included), with token usage and latency; reward
spans become EVALUATOR spans. The exact token ids and log-probs stay in the store, which remains the source of
truth; MLflow gets a copy of a sample (`TrainConfig.mlflow_traces`).

Trace tags, for filtering (`search_traces(filter_string="tags.iteration = '3' AND tags.reward = '1.0'")`, or the
Traces tab's Filters pop-up): `run_name`, `mode` (train or val), `iteration` (a training rollout's iteration) or
`checkpoint` (a held-out rollout's: the checkpoint step it evaluated), `rollout_id`, `attempt` (1 for the first),
`attempt_id`, `task` (its input, cut to 100 characters), `status` and `reward` (`none` when the rollout has none).
The reward is also the trace's `reward` assessment (feedback from CODE), which the Traces tab shows as a column.

Exporting is idempotent: an attempt already in the run's traces is not written again (a retried stage, a resumed
run). MLflow's tracing writes through its process-wide tracer, bound to the global tracking URI, so each export sets
that URI for its duration, under a lock, and puts the previous one back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

from lightning import semconv
from lightning.environment import MLFLOW_TRACKING_URI, litellm_offline
from lightning.store.base import LightningStore
from lightning.tracing import find_final_reward, get_reward_value
from lightning.types import AttemptedRollout, Rollout, Span

logger = logging.getLogger(__name__)

TASK_TAG_CHARS = 100
REWARD_ASSESSMENT = "reward"
"""The name of the assessment (MLflow's feedback) each trace with a reward carries: the Traces tab's score column."""
PAGE = 500
# Attributes that MLflow does not get: the token ids and log-probs (large; the store keeps them), and the messages,
# which become the span's inputs and outputs.
_LEFT_IN_STORE = {
    semconv.LLM_PROMPT_TOKEN_IDS,
    semconv.LLM_RESPONSE_TOKEN_IDS,
    semconv.LLM_RESPONSE_LOGPROBS,
    semconv.LLM_CHOICE_PROMPT_TOKEN_IDS,
    semconv.GEN_AI_INPUT_MESSAGES,
    semconv.GEN_AI_OUTPUT_MESSAGES,
}
_GLOBAL_URI = threading.Lock()
ASYNC_LOGGING = "MLFLOW_ENABLE_ASYNC_TRACE_LOGGING"
TRACKING_URI = MLFLOW_TRACKING_URI


def choose(rollout_ids: Sequence[str], count: int | Literal["all"]) -> list[str]:
    """`count` of the rollouts (all: every one), spread evenly over the list (so over the batch's tasks)."""
    ids = list(rollout_ids)
    if count == "all" or count >= len(ids):
        return ids
    if count <= 0:
        return []
    return [ids[(i * len(ids)) // count] for i in range(count)]


async def export_rollouts(
    store: LightningStore, tracker: Any, rollout_ids: Sequence[str], count: int | Literal["all"] = "all"
) -> list[str]:
    """Write `count` of the rollouts (their latest attempts) as traces of `tracker`'s MLflow run; the ids of the
    traces written (none for attempts already there)."""
    records = await read_rollouts(store, rollout_ids, count)
    return await asyncio.to_thread(write_traces, tracker, records)


async def read_rollouts(
    store: LightningStore, rollout_ids: Sequence[str], count: int | Literal["all"] = "all"
) -> list[tuple[AttemptedRollout, list[Span]]]:
    """The store half of `export_rollouts`: `count` of the rollouts with their latest attempts' spans (two
    requests), for `write_traces`."""
    chosen = choose(rollout_ids, count)
    if not chosen:
        return []
    found = {rollout.rollout_id: rollout for rollout in await store.query_rollouts(rollout_id_in=chosen)}
    spans = await store.query_latest_spans(chosen)
    # A rollout never attempted has nothing to show.
    return [
        (found[rollout_id], spans.get(rollout_id, []))
        for rollout_id in chosen
        if isinstance(found.get(rollout_id), AttemptedRollout)
    ]


def write_traces(tracker: Any, records: Sequence[tuple[AttemptedRollout, list[Span]]]) -> list[str]:
    """The blocking half of `export_rollouts`: one trace per (rollout, its attempt's spans) not yet in the run."""
    if not records:
        return []
    done = _exported_attempts(tracker, {_tag_values(rollout) for rollout, _ in records})
    written = []
    with _global_tracking_uri(tracker.expanded_uri):
        for rollout, spans in records:
            if rollout.attempt.attempt_id in done:
                continue
            written.append(_write_trace(tracker, rollout, spans))
    return written


class TraceWriter:
    """One thread that writes a run's traces (`write_traces`) while the run goes on: the writes are most of
    `adapt_spans` otherwise (433 of its 458 ms on the demo, 2 cores). Submitted in order, written in order;
    `flush()` waits until every trace submitted is written (the checkpoint stage calls it, so the MLflow run is
    complete at each checkpoint), `close()` flushes and ends the thread. A write that fails is logged with its
    traceback and counted in `failures`, never dropped silently (the store keeps the spans)."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.failures = 0
        self.written = 0
        self._queue: queue.Queue[Sequence[tuple[AttemptedRollout, list[Span]]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="mlflow-trace-writer", daemon=True)
        self._thread.start()

    def submit(self, records: Sequence[tuple[AttemptedRollout, list[Span]]]) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the trace writer is closed")
        if records:
            self._queue.put(list(records))

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _work(self) -> None:
        while True:
            records = self._queue.get()
            try:
                if records is None:
                    return
                self.written += len(write_traces(self.tracker, records))
            except Exception:
                self.failures += 1
                logger.exception("writing %d rollouts to MLflow as traces failed", len(records or ()))
            finally:
                self._queue.task_done()


def trace_tags(rollout: AttemptedRollout, reward: float | None) -> dict[str, str]:
    metadata = rollout.metadata or {}
    task = json.dumps(rollout.input, ensure_ascii=False, default=str)
    if len(task) > TASK_TAG_CHARS:
        task = task[: TASK_TAG_CHARS - 1] + "…"
    mode, where, value = _tag_values(rollout)
    return {
        "run_name": str(metadata.get("run_name", "")),
        "mode": mode,
        where: value,
        "rollout_id": rollout.rollout_id,
        "attempt": str(rollout.attempt.sequence_id),
        "attempt_id": rollout.attempt.attempt_id,
        "task": task,
        "status": rollout.status,
        "reward": "none" if reward is None else str(round(reward, 6)),
    }


def _tag_values(rollout: Rollout) -> tuple[str, str, str]:
    """(mode, the tag that places the rollout, its value): a training rollout's `iteration`; a held-out rollout's
    `checkpoint`, the step it evaluated (its metadata's `iteration` holds that step), so that `tags.iteration = '3'`
    finds iteration 3's training rollouts only."""
    mode = str(rollout.mode or "")
    return mode, "checkpoint" if mode == "val" else "iteration", str((rollout.metadata or {}).get("iteration", ""))


def _exported_attempts(tracker: Any, groups: set[tuple[str, str, str]]) -> set[str]:
    """The attempt ids among the run's traces of these (mode, tag, value) groups."""
    attempts = set()
    for mode, where, value in groups:
        token = None
        while True:
            page = tracker.client.search_traces(
                locations=[tracker.experiment_id], run_id=tracker.run_id, include_spans=False, max_results=PAGE,
                filter_string=f"tags.mode = '{mode}' AND tags.{where} = '{value}'", page_token=token,
            )  # fmt: skip
            attempts.update(trace.info.tags.get("attempt_id") for trace in page)
            token = page.token
            if not token:
                break
    return attempts


@contextmanager
def _global_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's tracer writing to `uri`, synchronously: its asynchronous queue would only add the seconds that
    flushing it takes, since the export waits for the traces anyway."""
    import mlflow

    with _GLOBAL_URI:
        previous = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
        saved = {name: os.environ.get(name) for name in (ASYNC_LOGGING, TRACKING_URI)}
        os.environ[ASYNC_LOGGING] = "false"  # read when the tracer is set up again, below
        # A local store prices LLM spans with LiteLLM, which would fetch its price list from the internet first.
        litellm_offline()
        mlflow.set_tracking_uri(uri)
        # MLflow also puts the URI (a password read from ${VAR} included) in the environment, for child processes: a
        # serving process restarted meanwhile would inherit it. MLflow's tracer reads the URI it was given instead.
        _restore(TRACKING_URI, saved[TRACKING_URI])
        try:
            yield
        finally:
            _restore(ASYNC_LOGGING, saved[ASYNC_LOGGING])
            mlflow.set_tracking_uri(previous)  # None: unset again
            _restore(TRACKING_URI, saved[TRACKING_URI])


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _ns(seconds: float | None, default: float) -> int:
    return int((default if seconds is None else seconds) * 1e9)


def _write_trace(tracker: Any, rollout: AttemptedRollout, spans: list[Span]) -> str:
    import mlflow
    from mlflow.entities import AssessmentSource, SpanType
    from mlflow.tracing.constant import TraceMetadataKey

    attempt = rollout.attempt
    reward = find_final_reward(spans)
    starts = [span.start_time for span in spans if span.start_time is not None] + [attempt.start_time]
    ends = [span.end_time for span in spans if span.end_time is not None]
    ends += [attempt.end_time or attempt.last_heartbeat_time or max(starts)]
    start, end = min(starts), max(ends)
    metadata = rollout.metadata or {}
    root = mlflow.start_span_no_context(
        "rollout",
        span_type=SpanType.AGENT,
        inputs=rollout.input,
        attributes={
            "rollout_id": rollout.rollout_id, "attempt_id": attempt.attempt_id, "attempt": attempt.sequence_id,
            "worker_id": attempt.worker_id, "group_id": metadata.get("group_id"),
            "task_index": metadata.get("task_index"),
        },
        tags=trace_tags(rollout, reward),
        metadata={TraceMetadataKey.SOURCE_RUN: tracker.run_id},
        experiment_id=tracker.experiment_id,
        start_time_ns=_ns(start, start),
    )  # fmt: skip
    by_id = {span.span_id: span for span in spans}
    made: dict[str, Any] = {}
    depth: dict[str, int] = {}

    def make(span: Span, seen: frozenset[str] = frozenset()) -> Any:
        if span.span_id in made:
            return made[span.span_id]
        parent_span = by_id.get(span.parent_id or "")
        if parent_span is None or parent_span.span_id in seen or parent_span is span:
            parent, depth[span.span_id] = root, 1
        else:
            parent = make(parent_span, seen | {span.span_id})
            depth[span.span_id] = depth[parent_span.span_id] + 1
        made[span.span_id] = _start_span(span, parent, start)
        return made[span.span_id]

    for span in sorted(spans, key=lambda s: (s.start_time or start, s.sequence_id)):
        make(span)
    for span in sorted(spans, key=lambda s: -depth[s.span_id]):  # children end before their parents
        made[span.span_id].end(
            status=_status(span), end_time_ns=_ns(span.end_time, span.start_time or start)
        )  # fmt: skip
    root.end(
        outputs={"reward": reward, "status": rollout.status, "attempt_status": attempt.status},
        status="OK" if rollout.status == "succeeded" else "ERROR",
        end_time_ns=_ns(end, end),
    )
    if reward is not None:  # an assessment: the trace list shows it as a column, and charts it
        mlflow.log_feedback(
            trace_id=root.trace_id, name=REWARD_ASSESSMENT, value=float(reward),
            source=AssessmentSource(source_type="CODE", source_id=str(metadata.get("run_name") or "lightning")),
        )  # fmt: skip
    return root.trace_id


def _status(span: Span) -> str:
    code = str(span.status.status_code or "UNSET").upper()
    return code if code in ("OK", "ERROR") else "UNSET"


def _start_span(span: Span, parent: Any, default_start: float) -> Any:
    import mlflow
    from mlflow.entities import SpanEvent, SpanType

    attributes = dict(span.attributes)
    inputs: Any = None
    outputs: Any = None
    if semconv.GEN_AI_OPERATION in attributes:
        span_type = SpanType.CHAT_MODEL if attributes[semconv.GEN_AI_OPERATION] == "chat" else SpanType.LLM
        inputs, outputs, extra = _llm_call(attributes)
        attributes.update(extra)
    elif get_reward_value(span) is not None:
        span_type = SpanType.EVALUATOR
        outputs = {"reward": get_reward_value(span)}
    elif span.name == semconv.OPERATION_SPAN:
        span_type = SpanType.CHAIN
        inputs = _json(attributes.pop(semconv.OPERATION_INPUT, None))
        outputs = _json(attributes.pop(semconv.OPERATION_OUTPUT, None))
    else:
        span_type = SpanType.UNKNOWN
    name = str(attributes.get(semconv.OPERATION_NAME) or span.name)
    live = mlflow.start_span_no_context(
        name,
        span_type=span_type,
        parent_span=parent,
        inputs=inputs,
        attributes={key: value for key, value in attributes.items() if key not in _LEFT_IN_STORE},
        start_time_ns=_ns(span.start_time, default_start),
    )
    if outputs is not None:
        live.set_outputs(outputs)
    for event in span.events:
        live.add_event(
            SpanEvent(event.name, timestamp=_ns(event.timestamp, default_start), attributes=dict(event.attributes))
        )
    return live


def _llm_call(attributes: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """An LLM call's span as MLflow shows chats: the request (messages or prompt, model, sampling parameters) in
    OpenAI's form, the response's choices likewise, the token usage and the model."""
    from mlflow.tracing.constant import SpanAttributeKey

    chat = attributes[semconv.GEN_AI_OPERATION] == "chat"
    prompt = _json(attributes.get(semconv.GEN_AI_INPUT_MESSAGES))
    inputs: dict[str, Any] = {"messages" if chat else "prompt": prompt}
    model = attributes.get(semconv.GEN_AI_REQUEST_MODEL)
    if model is not None:
        inputs["model"] = model
    for key, value in attributes.items():
        if key.startswith(semconv.GEN_AI_REQUEST_PREFIX) and key != semconv.GEN_AI_REQUEST_MODEL:
            inputs[key.removeprefix(semconv.GEN_AI_REQUEST_PREFIX)] = value
    choices = []
    for index, message in enumerate(_json(attributes.get(semconv.GEN_AI_OUTPUT_MESSAGES)) or []):
        message = dict(message)
        finish_reason = message.pop("finish_reason", None)
        if chat:
            choices.append({"index": index, "message": message, "finish_reason": finish_reason})
        else:
            choices.append({"index": index, "text": message.get("content"), "finish_reason": finish_reason})
    outputs: dict[str, Any] = {"object": "chat.completion" if chat else "text_completion", "choices": choices}
    extra: dict[str, Any] = {}
    usage = {
        "input_tokens": attributes.get(semconv.GEN_AI_INPUT_TOKENS),
        "output_tokens": attributes.get(semconv.GEN_AI_OUTPUT_TOKENS),
    }
    if all(isinstance(count, int) for count in usage.values()):
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        extra[SpanAttributeKey.CHAT_USAGE] = usage
        outputs["usage"] = {
            "prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"],
            "total_tokens": usage["total_tokens"],
        }  # fmt: skip
    served = attributes.get(semconv.GEN_AI_RESPONSE_MODEL) or model
    if served is not None:  # (MLflow reads the model's name from the gen_ai attributes too)
        outputs["model"] = served
    if semconv.LLM_RESPONSE_TOKEN_IDS in attributes:
        # A call to the policy the run serves (token ids are ours): no price per token. A cost of zero keeps MLflow
        # from looking one up in LiteLLM's price list, which imports LiteLLM (seconds) in the run's process. (Not
        # None: MLflow's client accepts a null cost, but its server then never finishes storing the trace.)
        extra[SpanAttributeKey.LLM_COST] = {"input_cost": 0.0, "output_cost": 0.0, "total_cost": 0.0}
    return inputs, outputs, extra


def _json(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value
