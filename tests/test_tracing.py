"""The tracer against a real SqlLightningStore (SQLite file) and the real OpenTelemetry SDK."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace as trace_api

from lightning import semconv
from lightning.store import SqlLightningStore
from lightning.tracing import (
    SpanExportError,
    Tracer,
    emit_exception,
    emit_message,
    emit_object,
    emit_reward,
    emitters,
    find_final_reward,
    find_rewards,
    get_final_reward,
    is_secret_name,
    operation,
)
from lightning.types import LLM, Span

FAST = 0.05


@pytest.fixture
async def file_store(tmp_path: Path) -> AsyncIterator[SqlLightningStore]:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 'store.db'}", watchdog_interval=None)
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
def tracer(file_store: SqlLightningStore) -> Iterator[Tracer]:
    tracer = Tracer(file_store, flush_interval=FAST)
    try:
        yield tracer
    finally:
        tracer.shutdown()


@pytest.fixture
def warned_nothing_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    # Emitters warn once per process; a fresh set lets this test see the warning.
    monkeypatch.setattr(emitters, "_warned_outside_context", set())


async def new_attempt(store: SqlLightningStore) -> tuple[str, str]:
    rollout = await store.start_rollout({"task": "t"})
    return rollout.rollout_id, rollout.attempt.attempt_id


def hex_id(span: trace_api.Span) -> str:
    return trace_api.format_span_id(span.get_span_context().span_id)


def one(spans: list[Span], name: str) -> Span:
    (found,) = [span for span in spans if span.name == name]
    return found


async def spans_of_one_emit(tracer: Tracer, store: SqlLightningStore, emit: Any) -> list[Span]:
    rollout_id, attempt_id = await new_attempt(store)
    with tracer.trace_context(rollout_id, attempt_id):
        emit()
    return await store.query_spans(rollout_id, attempt_id)


# --- spans reach the store ---------------------------------------------------------------------


async def test_spans_are_in_the_store_when_the_block_exits(file_store: SqlLightningStore) -> None:
    # A long interval: only the flush at exit can have written the spans.
    tracer = Tracer(file_store, flush_interval=60)
    rollout_id, attempt_id = await new_attempt(file_store)
    assert (await file_store.get_latest_attempt(rollout_id)).status == "preparing"  # type: ignore[union-attr]
    try:
        with (
            tracer.trace_context(rollout_id, attempt_id, name="agent") as trace,
            tracer.otel_tracer.start_as_current_span("outer") as outer,
            tracer.otel_tracer.start_as_current_span("inner") as inner,
        ):
            emit_reward(0.5)
        spans = await file_store.query_spans(rollout_id, attempt_id)
    finally:
        tracer.shutdown()

    assert [span.name for span in spans] == [semconv.REWARD_SPAN, "inner", "outer", "agent"]  # ended order
    assert [span.sequence_id for span in spans] == [1, 2, 3, 4]
    assert {(span.rollout_id, span.attempt_id) for span in spans} == {(rollout_id, attempt_id)}
    assert len({span.trace_id for span in spans}) == 1
    assert trace.root_span is not None
    root = one(spans, "agent")
    assert root.parent_id is None and root.span_id == hex_id(trace.root_span)
    assert one(spans, "outer").parent_id == root.span_id
    assert one(spans, "inner").parent_id == hex_id(outer)
    assert one(spans, semconv.REWARD_SPAN).parent_id == hex_id(inner)
    assert root.attributes == {semconv.ROLLOUT_ID: rollout_id, semconv.ATTEMPT_ID: attempt_id}
    assert (await file_store.get_latest_attempt(rollout_id)).status == "running"  # type: ignore[union-attr]


async def test_spans_stream_into_the_store_while_the_block_runs(tracer: Tracer, file_store: SqlLightningStore) -> None:
    rollout_id, attempt_id = await new_attempt(file_store)
    with tracer.trace_context(rollout_id, attempt_id):
        for step in range(2):
            emit_message(f"step {step}")
            started = time.monotonic()
            while len(await file_store.query_spans(rollout_id, attempt_id)) <= step:
                assert time.monotonic() - started < 20 * FAST, f"step {step} not streamed"
                await asyncio.sleep(FAST / 5)
    assert len(await file_store.query_spans(rollout_id, attempt_id)) == 2


async def test_spans_outside_any_trace_context_are_not_recorded(tracer: Tracer, file_store: SqlLightningStore) -> None:
    with tracer.otel_tracer.start_as_current_span("stray"):
        pass
    tracer.flush(timeout=5)
    assert (await file_store.statistics())["spans"] == 0


async def test_a_span_ending_after_its_block_is_still_written_to_its_attempt(
    tracer: Tracer, file_store: SqlLightningStore, caplog: pytest.LogCaptureFixture
) -> None:
    rollout_id, attempt_id = await new_attempt(file_store)
    with tracer.trace_context(rollout_id, attempt_id):
        late = tracer.otel_tracer.start_span("late")
    assert "still open" in caplog.text
    late.end()
    tracer.flush(timeout=5)
    assert [span.name for span in await file_store.query_spans(rollout_id, attempt_id)] == ["late"]


async def test_the_exporter_outlives_a_hand_over_that_empties_its_queue(file_store: SqlLightningStore) -> None:
    """A runner's trace context hands its last spans to `finish_attempt` (`hand_over`), taking them out of the
    exporter's queue, sometimes while the exporter waits its interval for more. The exporter then waits for the next
    span: it used to end there, and every later span of the tracer was never written (a trace context without hand-over
    timed out). The pause inside each block lets the exporter see the span first."""
    tracer = Tracer(file_store, flush_interval=0.2, flush_timeout=5.0)
    try:
        for _ in range(3):
            rollout_id, attempt_id = await new_attempt(file_store)
            handing = tracer.trace_context(rollout_id, attempt_id, hand_over=True)
            async with handing:
                emit_reward(1.0)
                await asyncio.sleep(0.05)
            assert [span.name for span in handing.handed_over] == [semconv.REWARD_SPAN]
            await asyncio.sleep(0.3)  # past the exporter's interval, its queue empty
            rollout_id, attempt_id = await new_attempt(file_store)
            async with tracer.trace_context(rollout_id, attempt_id):
                emit_reward(0.5)
            assert [span.name for span in await file_store.query_spans(rollout_id)] == [semconv.REWARD_SPAN]
    finally:
        tracer.shutdown()


async def test_flush_and_aflush_write_spans_before_the_block_exits(file_store: SqlLightningStore) -> None:
    tracer = Tracer(file_store, flush_interval=60)
    rollout_id, attempt_id = await new_attempt(file_store)
    try:
        with tracer.trace_context(rollout_id, attempt_id):
            emit_message("one")
            tracer.flush(timeout=5)
            assert len(await file_store.query_spans(rollout_id, attempt_id)) == 1
            emit_message("two")
            await tracer.aflush(timeout=5)
            assert len(await file_store.query_spans(rollout_id, attempt_id)) == 2
    finally:
        tracer.shutdown()


async def test_nested_trace_contexts_attribute_spans_to_the_innermost(
    tracer: Tracer, file_store: SqlLightningStore
) -> None:
    outer_ids = await new_attempt(file_store)
    inner_ids = await new_attempt(file_store)
    with tracer.trace_context(*outer_ids):
        emit_message("outer before")
        with tracer.trace_context(*inner_ids):
            emit_message("inner")
        emit_message("outer after")
    bodies = {
        ids: [span.attributes[semconv.MESSAGE_BODY] for span in await file_store.query_spans(*ids)]
        for ids in (outer_ids, inner_ids)
    }
    assert bodies == {outer_ids: ["outer before", "outer after"], inner_ids: ["inner"]}


async def test_otel_environment_variables_neither_leak_into_nor_change_spans(
    file_store: SqlLightningStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deploy.secret=hunter2")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "leaky")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "4")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "1")
    tracer = Tracer(file_store, flush_interval=FAST)
    rollout_id, attempt_id = await new_attempt(file_store)
    try:
        with tracer.trace_context(rollout_id, attempt_id):
            emit_object({"long": "x" * 1000})
            emit_message("hello there", a=1, b=2)
    finally:
        tracer.shutdown()
    obj, message = await file_store.query_spans(rollout_id, attempt_id)
    assert json.loads(obj.attributes[semconv.OBJECT_JSON]) == {"long": "x" * 1000}
    assert message.attributes == {semconv.MESSAGE_BODY: "hello there", "a": 1, "b": 2}
    assert obj.resource.attributes == {"service.name": "lightning"}
    assert "hunter2" not in obj.model_dump_json()


async def test_work_handed_to_asyncio_to_thread_stays_with_its_attempt(
    tracer: Tracer, file_store: SqlLightningStore
) -> None:
    rollout_id, attempt_id = await new_attempt(file_store)

    def sync_agent() -> None:  # how a runner runs a sync agent from async code
        emit_reward(0.5)

    async with tracer.trace_context(rollout_id, attempt_id, name="agent"):
        await asyncio.to_thread(sync_agent)
    spans = await file_store.query_spans(rollout_id, attempt_id)
    assert one(spans, semconv.REWARD_SPAN).parent_id == one(spans, "agent").span_id


# --- concurrency -------------------------------------------------------------------------------


async def test_threads_each_with_an_attempt_never_mix_spans(tracer: Tracer, file_store: SqlLightningStore) -> None:
    attempts = [await new_attempt(file_store) for _ in range(8)]
    all_inside = threading.Barrier(len(attempts))
    errors: list[BaseException] = []

    def agent(index: int) -> None:
        try:
            with tracer.trace_context(*attempts[index], name=f"agent-{index}"):
                all_inside.wait(timeout=5)
                for step in range(5):
                    emit_reward(float(index))
                    emit_message(f"{index}/{step}")
                    time.sleep(0.001)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(index,)) for index in range(len(attempts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert errors == []
    for index, ids in enumerate(attempts):
        spans = await file_store.query_spans(*ids)
        assert len(spans) == 11
        assert find_rewards(spans) == [float(index)] * 5
        assert [s.attributes[semconv.MESSAGE_BODY] for s in spans if s.name == semconv.MESSAGE_SPAN] == [
            f"{index}/{step}" for step in range(5)
        ]
        root = one(spans, f"agent-{index}")
        assert all(span.parent_id == root.span_id for span in spans if span is not root)


async def test_asyncio_tasks_each_with_an_attempt_never_mix_spans(
    tracer: Tracer, file_store: SqlLightningStore
) -> None:
    attempts = [await new_attempt(file_store) for _ in range(8)]

    async def agent(index: int) -> None:
        async with tracer.trace_context(*attempts[index], name=f"agent-{index}"):
            for _ in range(5):
                emit_reward(float(index))
                await asyncio.sleep(0.001)

    async def sync_with_agent(index: int) -> None:
        # A plain `with` in async code works too.
        with tracer.trace_context(*attempts[index], name=f"agent-{index}"):
            for _ in range(5):
                emit_reward(float(index))
                await asyncio.sleep(0.001)

    await asyncio.gather(*(agent(i) if i % 2 else sync_with_agent(i) for i in range(len(attempts))))
    for index, ids in enumerate(attempts):
        spans = await file_store.query_spans(*ids)
        assert find_rewards(spans) == [float(index)] * 5
        root = one(spans, f"agent-{index}")
        assert all(span.parent_id == root.span_id for span in spans if span is not root)


# --- failures ----------------------------------------------------------------------------------


async def test_a_closed_store_makes_the_block_raise_promptly(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 'closed.db'}", watchdog_interval=None)
    rollout_id, attempt_id = await new_attempt(store)
    tracer = Tracer(store, flush_interval=FAST)
    await store.close()
    started = time.monotonic()
    try:
        with pytest.raises(SpanExportError, match="closed"), tracer.trace_context(rollout_id, attempt_id):
            emit_reward(1.0)
        with pytest.raises(SpanExportError, match="closed"):
            async with tracer.trace_context(rollout_id, attempt_id):
                emit_reward(1.0)
        with pytest.raises(SpanExportError), tracer.trace_context(rollout_id, attempt_id):  # the exit, too
            emit_reward(1.0)
            with pytest.raises(SpanExportError, match="closed"):
                tracer.flush(timeout=5)
    finally:
        tracer.shutdown()
    assert time.monotonic() - started < 5


async def test_one_bad_attempt_does_not_cost_another_its_spans(tracer: Tracer, file_store: SqlLightningStore) -> None:
    rollout_id, attempt_id = await new_attempt(file_store)
    with pytest.raises(SpanExportError, match="at-missing"), tracer.trace_context(rollout_id, "at-missing"):
        emit_message("lost")
        with tracer.trace_context(rollout_id, attempt_id):  # its exit writes both spans in one batch
            emit_message("kept")
    assert [span.attributes[semconv.MESSAGE_BODY] for span in await file_store.query_spans(rollout_id)] == ["kept"]


async def test_a_hanging_store_makes_the_block_raise_after_the_flush_timeout(file_store: SqlLightningStore) -> None:
    release = threading.Event()

    class HangingStore:
        def __getattr__(self, name: str) -> Any:
            return getattr(file_store, name)

        async def add_many_spans(self, spans: list[Span], **options: Any) -> list[Span]:
            release.wait(timeout=10)
            return await file_store.add_many_spans(spans, **options)

    tracer = Tracer(HangingStore(), flush_interval=FAST, flush_timeout=0.3)  # type: ignore[arg-type]
    rollout_id, attempt_id = await new_attempt(file_store)
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="within 0.3 s"), tracer.trace_context(rollout_id, attempt_id):
            emit_reward(1.0)
        assert time.monotonic() - started < 2
    finally:
        release.set()
        tracer.shutdown()
    assert len(await file_store.query_spans(rollout_id)) == 1  # written once the store answered


async def test_the_block_s_own_exception_wins_over_a_failed_flush(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 'closed.db'}", watchdog_interval=None)
    rollout_id, attempt_id = await new_attempt(store)
    tracer = Tracer(store, flush_interval=FAST)
    await store.close()
    try:
        with pytest.raises(KeyError), tracer.trace_context(rollout_id, attempt_id):
            emit_reward(1.0)
            raise KeyError("agent bug")
    finally:
        tracer.shutdown()


async def test_after_shutdown_no_trace_context_opens(file_store: SqlLightningStore) -> None:
    tracer = Tracer(file_store)
    rollout_id, attempt_id = await new_attempt(file_store)
    tracer.shutdown()
    tracer.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        tracer.trace_context(rollout_id, attempt_id).__enter__()


def test_the_global_tracer_provider_is_untouched(tmp_path: Path) -> None:
    before = trace_api.get_tracer_provider()

    async def run() -> None:
        store = SqlLightningStore(f"sqlite:///{tmp_path / 'g.db'}", watchdog_interval=None)
        tracer = Tracer(store)
        rollout_id, attempt_id = await new_attempt(store)
        with tracer.trace_context(rollout_id, attempt_id, name="agent"):
            emit_reward(1.0)
        tracer.shutdown()
        await store.close()

    asyncio.run(run())
    assert trace_api.get_tracer_provider() is before


# --- emitters ----------------------------------------------------------------------------------


def agl_dimensions(*dimensions: tuple[str, float]) -> dict[str, Any]:
    """agent-lightning 0.3's reward attributes, primary first: what its `find_final_reward` reads."""
    attributes: dict[str, Any] = {}
    for index, (name, value) in enumerate(dimensions):
        attributes[f"agentlightning.reward.{index}.name"] = name
        attributes[f"agentlightning.reward.{index}.value"] = value
    return attributes


async def test_emit_reward_float(tracer: Tracer, file_store: SqlLightningStore) -> None:
    spans = await spans_of_one_emit(tracer, file_store, lambda: emit_reward(1))
    assert [(span.name, span.attributes) for span in spans] == [
        (semconv.REWARD_SPAN, {semconv.REWARD_VALUE: 1.0, **agl_dimensions(("primary", 1.0))})
    ]


async def test_an_emitted_span_is_the_same_with_or_without_the_sdk_s_span_machinery(tmp_path: Path) -> None:
    # Our processor alone: emitters record their instant spans without the SDK (Tracer.record_instant). A processor
    # of the user's on the provider (an exporter) must see every span: then they go through the SDK. Both ways the
    # store gets the same span, a child of the current span, in the provider's resource.
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    stored: dict[str, Span] = {}
    exported = InMemorySpanExporter()
    for way in ("instant", "sdk"):
        store = SqlLightningStore(f"sqlite:///{tmp_path / way}.db", watchdog_interval=None)
        tracer = Tracer(store, flush_interval=FAST)
        if way == "sdk":
            tracer.tracer_provider.add_span_processor(SimpleSpanProcessor(exported))
        rollout_id, attempt_id = await new_attempt(store)
        async with tracer.trace_context(rollout_id, attempt_id, name="root"):
            emit_reward(0.5)
        spans = await store.query_spans(rollout_id, attempt_id)
        stored[way] = reward = one(spans, semconv.REWARD_SPAN)
        root = one(spans, "root")
        assert (reward.parent_id, reward.trace_id) == (root.span_id, root.trace_id)
        assert reward.start_time == reward.end_time or way == "sdk"
        tracer.shutdown()
        await store.close()
    assert [span.name for span in exported.get_finished_spans()] == [semconv.REWARD_SPAN, "root"]
    ignored = {"rollout_id", "attempt_id", "trace_id", "span_id", "parent_id", "start_time", "end_time", "context",
               "parent"}  # fmt: skip
    instant, sdk = (stored[way].model_dump(exclude=ignored) for way in ("instant", "sdk"))
    assert instant == sdk
    assert instant["resource"]["attributes"] == {"service.name": "lightning"}


async def test_emit_reward_dict_with_primary_key(tracer: Tracer, file_store: SqlLightningStore) -> None:
    spans = await spans_of_one_emit(
        tracer, file_store, lambda: emit_reward({"correct": 1.0, "brevity": 0.25}, primary_key="correct")
    )
    assert spans[0].attributes == {
        semconv.REWARD_PREFIX + "correct": 1.0,
        semconv.REWARD_PREFIX + "brevity": 0.25,
        semconv.REWARD_PRIMARY_KEY: "correct",
        semconv.REWARD_VALUE: 1.0,
        **agl_dimensions(("correct", 1.0), ("brevity", 0.25)),
    }


async def test_a_one_key_reward_dict_is_its_own_primary(tracer: Tracer, file_store: SqlLightningStore) -> None:
    spans = await spans_of_one_emit(tracer, file_store, lambda: emit_reward({"score": -2.5}))
    assert spans[0].attributes[semconv.REWARD_PRIMARY_KEY] == "score"
    assert spans[0].attributes[semconv.REWARD_VALUE] == -2.5


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (math.nan, ValueError),
        (math.inf, ValueError),
        (-math.inf, ValueError),
        ("1.0", TypeError),
        (None, TypeError),
        ({"a": math.nan}, ValueError),
        ({"a": "1"}, TypeError),
    ],
)
def test_emit_reward_rejects_what_is_not_a_finite_number(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="finite float"):
        emit_reward(value)


async def test_emit_reward_takes_bools_and_agent_lightning_s_keywords(
    tracer: Tracer, file_store: SqlLightningStore
) -> None:
    """As in agent-lightning 0.3: a bool is 1.0 / 0.0, `attributes` go on the reward span (nested dicts flattened),
    and propagate=False records nothing but returns the span."""
    spans = await spans_of_one_emit(
        tracer,
        file_store,
        lambda: emit_reward(
            {"correct": True, "short": False}, primary_key="correct", attributes={"judge": {"model": "m"}, "turns": 2}
        ),
    )
    assert spans[0].attributes == {
        semconv.REWARD_PREFIX + "correct": 1.0,
        semconv.REWARD_PREFIX + "short": 0.0,
        semconv.REWARD_PRIMARY_KEY: "correct",
        semconv.REWARD_VALUE: 1.0,
        **agl_dimensions(("correct", 1.0), ("short", 0.0)),
        "judge.model": "m",
        "turns": 2,
    }
    assert find_final_reward(spans) == 1.0
    quiet = emit_reward(False, propagate=False)
    assert (quiet.name, quiet.attributes) == (
        semconv.REWARD_SPAN,
        {semconv.REWARD_VALUE: 0.0, **agl_dimensions(("primary", 0.0))},
    )
    with pytest.raises(ValueError, match="reserved"):
        emit_reward(1.0, attributes={"lightning.reward.value": 2.0})
    with pytest.raises(TypeError, match="attribute 'obj' is a object"):
        emit_reward(1.0, attributes={"obj": object()})


@pytest.mark.parametrize(
    ("value", "primary_key", "message"),
    [
        ({"a": 1.0, "b": 2.0}, None, "needs primary_key="),
        ({"a": 1.0}, "b", "primary_key 'b' is not one of"),
        (1.0, "a", "primary_key picks a component"),
        ({}, None, "empty"),
        ({"value": 1.0}, None, "reserved"),
    ],
)
def test_emit_reward_rejects_ambiguous_dicts(value: Any, primary_key: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        emit_reward(value, primary_key=primary_key)


async def test_emit_message(tracer: Tracer, file_store: SqlLightningStore) -> None:
    spans = await spans_of_one_emit(tracer, file_store, lambda: emit_message("hello", turn=3, tags=["a", "b"]))
    assert (spans[0].name, spans[0].attributes) == (
        semconv.MESSAGE_SPAN,
        {semconv.MESSAGE_BODY: "hello", "turn": 3, "tags": ["a", "b"]},
    )


async def test_emit_object_records_json_with_secrets_redacted(tracer: Tracer, file_store: SqlLightningStore) -> None:
    llm = LLM(endpoint="http://x/v1", model="m", api_key="sk-very-secret")
    spans = await spans_of_one_emit(tracer, file_store, lambda: emit_object({"answer": [1, 2], "llm": llm}))
    assert spans[0].name == semconv.OBJECT_SPAN
    recorded = json.loads(spans[0].attributes[semconv.OBJECT_JSON])
    assert recorded["answer"] == [1, 2]
    assert recorded["llm"]["api_key"] == "[redacted]" and recorded["llm"]["model"] == "m"
    assert "sk-very-secret" not in spans[0].model_dump_json()


@pytest.mark.parametrize("value", [object(), {"x": {1, object()}}, math.nan, {(1, 2): "tuple key"}])
def test_emit_object_rejects_what_json_cannot_hold(value: Any) -> None:
    with pytest.raises(TypeError, match="cannot be recorded as JSON"):
        emit_object(value)


async def test_emit_exception(tracer: Tracer, file_store: SqlLightningStore) -> None:
    try:
        raise ValueError("bad tool call")
    except ValueError as exc:
        caught = exc
    spans = await spans_of_one_emit(tracer, file_store, lambda: emit_exception(caught))
    span = spans[0]
    assert span.name == semconv.EXCEPTION_SPAN
    assert span.status.status_code == "ERROR" and "bad tool call" in (span.status.description or "")
    (event,) = span.events
    assert event.name == "exception"
    assert event.attributes["exception.type"] == "ValueError"
    assert event.attributes["exception.message"] == "bad tool call"
    assert "raise ValueError" in event.attributes["exception.stacktrace"]


async def test_operation_decorates_a_sync_function(tracer: Tracer, file_store: SqlLightningStore) -> None:
    @operation
    def add(x: int, y: int = 0) -> dict[str, int]:
        return {"sum": x + y}

    spans = await spans_of_one_emit(tracer, file_store, lambda: add(1, y=2))
    span = one(spans, semconv.OPERATION_SPAN)
    assert span.attributes[semconv.OPERATION_NAME].endswith("add")
    assert json.loads(span.attributes[semconv.OPERATION_INPUT]) == {"x": 1, "y": 2}
    assert json.loads(span.attributes[semconv.OPERATION_OUTPUT]) == {"sum": 3}
    assert span.status.status_code == "UNSET"


async def test_operation_decorates_an_async_function_and_parents_its_spans(
    tracer: Tracer, file_store: SqlLightningStore
) -> None:
    @operation("judge")
    async def judge(answer: str) -> float:
        await asyncio.sleep(0)
        emit_reward(0.75)
        return 0.75

    rollout_id, attempt_id = await new_attempt(file_store)
    async with tracer.trace_context(rollout_id, attempt_id):
        assert await judge("42") == 0.75
    spans = await file_store.query_spans(rollout_id, attempt_id)
    span = one(spans, semconv.OPERATION_SPAN)
    assert span.attributes[semconv.OPERATION_NAME] == "judge"
    assert json.loads(span.attributes[semconv.OPERATION_INPUT]) == {"answer": "42"}
    assert json.loads(span.attributes[semconv.OPERATION_OUTPUT]) == 0.75
    assert one(spans, semconv.REWARD_SPAN).parent_id == span.span_id


async def test_operation_records_and_reraises_exceptions(tracer: Tracer, file_store: SqlLightningStore) -> None:
    @operation
    async def fail() -> None:
        raise RuntimeError("tool down")

    rollout_id, attempt_id = await new_attempt(file_store)
    with tracer.trace_context(rollout_id, attempt_id), pytest.raises(RuntimeError, match="tool down"):
        await fail()
    (span,) = await file_store.query_spans(rollout_id, attempt_id)
    assert span.status.status_code == "ERROR"
    assert span.events[0].attributes["exception.type"] == "RuntimeError"
    assert semconv.OPERATION_OUTPUT not in span.attributes


async def test_operation_as_a_context_manager(tracer: Tracer, file_store: SqlLightningStore) -> None:
    rollout_id, attempt_id = await new_attempt(file_store)
    with tracer.trace_context(rollout_id, attempt_id):
        with operation("lookup") as op:
            op.set_input("paris", limit=3)
            emit_message("searching")
            op.set_output(["result"])
        with pytest.raises(ZeroDivisionError), operation("divide"):
            _ = 1 / 0
    spans = await file_store.query_spans(rollout_id, attempt_id)
    lookup, divide = [span for span in spans if span.name == semconv.OPERATION_SPAN]
    assert lookup.attributes[semconv.OPERATION_NAME] == "lookup"
    assert json.loads(lookup.attributes[semconv.OPERATION_INPUT]) == {"args": ["paris"], "limit": 3}
    assert json.loads(lookup.attributes[semconv.OPERATION_OUTPUT]) == ["result"]
    assert one(spans, semconv.MESSAGE_SPAN).parent_id == lookup.span_id
    assert divide.status.status_code == "ERROR"


async def test_operation_redacts_secret_arguments(tracer: Tracer, file_store: SqlLightningStore) -> None:
    class Client:
        @operation
        def call(self, prompt: str, api_key: str, max_tokens: int, token_ids: list[int], **kwargs: Any) -> str:
            return "ok"

    call = lambda: Client().call(  # noqa: E731
        "hi",
        api_key="sk-1",
        max_tokens=8,
        token_ids=[1, 2],
        hf_token="hf-2",
        password="pw-3",
        headers={"Authorization": "Bearer tok-4"},
        config={"client_secret": "cs-5", "temperature": 0.5},
    )
    spans = await spans_of_one_emit(tracer, file_store, call)
    recorded = json.loads(spans[0].attributes[semconv.OPERATION_INPUT])
    assert recorded == {
        "prompt": "hi",
        "api_key": "[redacted]",
        "max_tokens": 8,
        "token_ids": [1, 2],
        "kwargs": {
            "hf_token": "[redacted]",
            "password": "[redacted]",
            "headers": {"Authorization": "[redacted]"},
            "config": {"client_secret": "[redacted]", "temperature": 0.5},
        },
    }
    payload = spans[0].model_dump_json()
    assert not any(secret in payload for secret in ("sk-1", "hf-2", "pw-3", "tok-4", "cs-5"))


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("api_key", True),
        ("OPENAI_API_KEY", True),
        ("apiKey", True),
        ("access_token", True),
        ("secret", True),
        ("db_password", True),
        ("max_tokens", False),
        ("token_ids", False),
        ("primary_key", False),
        ("prompt", False),
    ],
)
def test_is_secret_name(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


@pytest.mark.usefixtures("warned_nothing_yet")
async def test_emitters_outside_a_trace_context_warn_once_and_record_nothing(
    tracer: Tracer, file_store: SqlLightningStore, caplog: pytest.LogCaptureFixture
) -> None:
    @operation
    def double(x: int) -> int:
        return 2 * x

    with caplog.at_level(logging.WARNING, logger="lightning.tracing.emitters"):
        for _ in range(2):
            emit_reward(1.0)
            emit_message("lost")
            emit_object({"a": 1})
            emit_exception(ValueError("x"))
            assert double(2) == 4
            with operation("block") as op:
                op.set_output("ignored")
    warnings = [record.getMessage() for record in caplog.records if "outside a trace context" in record.getMessage()]
    assert len(warnings) == 5
    tracer.flush(timeout=5)
    assert (await file_store.statistics())["spans"] == 0


# --- reading rewards ---------------------------------------------------------------------------


def _span(sequence_id: int, name: str, attributes: dict[str, Any]) -> Span:
    return Span(
        rollout_id="ro-1",
        attempt_id="at-1",
        sequence_id=sequence_id,
        trace_id="0" * 32,
        span_id=f"{sequence_id:016x}",
        name=name,
        attributes=attributes,
    )


def test_find_rewards_reads_ours_and_agent_lightning_s_in_sequence_order() -> None:
    spans = [
        _span(5, semconv.REWARD_SPAN, {semconv.REWARD_VALUE: 0.9}),
        # agent-lightning 0.3 emit_reward: an annotation span, primary reward first.
        _span(
            2,
            "agentlightning.annotation",
            {
                "agentlightning.reward.0.name": "task",
                "agentlightning.reward.0.value": 0.3,
                "agentlightning.reward.1.name": "speed",
                "agentlightning.reward.1.value": 0.1,
            },
        ),
        _span(3, "agentlightning.reward", {"agentlightning.reward.0.value": 0.4}),  # 0.3 pre-release name
        _span(1, "agentlightning.reward", {"reward": 0.2}),  # 0.2
        _span(4, "agentlightning.reward", {"reward": None}),  # 0.2 allowed "no reward"
        _span(6, semconv.MESSAGE_SPAN, {semconv.MESSAGE_BODY: "reward: 5"}),
        _span(7, "chat", {"reward": 1.0}),  # not a reward span: any span may have a `reward` attribute
    ]
    assert find_rewards(spans) == [0.2, 0.3, 0.4, 0.9]
    assert find_final_reward(spans) == 0.9
    assert find_final_reward(spans[1:4]) == 0.4
    assert find_final_reward(spans[5:]) is None
    assert find_final_reward([]) is None


async def test_get_final_reward_reads_the_latest_or_a_given_attempt(
    tracer: Tracer, file_store: SqlLightningStore
) -> None:
    rollout_id, first_attempt = await new_attempt(file_store)
    with tracer.trace_context(rollout_id, first_attempt, name="agent"):
        emit_reward(0.1)
        emit_reward({"final": 0.7, "aux": 0.0}, primary_key="final")
        emit_message("done")
    assert await get_final_reward(file_store, rollout_id) == 0.7
    second_attempt = (await file_store.start_attempt(rollout_id)).attempt.attempt_id
    assert await get_final_reward(file_store, rollout_id) is None  # the new attempt has no spans yet
    with tracer.trace_context(rollout_id, second_attempt):
        emit_reward(0.2)
    assert await get_final_reward(file_store, rollout_id) == 0.2
    assert await get_final_reward(file_store, rollout_id, first_attempt) == 0.7


def test_the_openai_sdk_is_instrumented_when_an_agent_imports_it_after_the_tracer_exists() -> None:
    """A tracer does not import the OpenAI SDK (seconds on a busy CPU, for agents that never use it); an agent that
    imports it later gets it instrumented at that import."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from lightning.tracing import Tracer\n"
        "from lightning.tracing import instrument\n"
        "Tracer()\n"
        "assert 'openai' not in sys.modules and instrument._provider is None, 'imported at tracer start'\n"
        "import openai.resources.chat.completions as completions\n"
        "assert instrument._provider is not None\n"
        "assert hasattr(completions.Completions.create, '__wrapped__'), 'not instrumented'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
