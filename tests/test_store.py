"""SqlLightningStore against the store protocol and the lifecycle rules, on every backend."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pytest
from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import TracerProvider

from lightning.store import UNSET, InvalidArgumentError, NotFoundError
from lightning.types import (
    LLM,
    ROLLOUT_STATUSES,
    Attempt,
    AttemptedRollout,
    EnqueueRolloutRequest,
    PaginatedResult,
    PromptTemplate,
    Rollout,
    RolloutConfig,
    Span,
)

# --- helpers ---------------------------------------------------------------------------------


def make_span(
    rollout_id: str,
    attempt_id: str,
    sequence_id: int,
    *,
    span_id: str | None = None,
    name: str = "step",
    parent_id: str | None = None,
    trace_id: str = "ab" * 16,
    attributes: dict[str, Any] | None = None,
) -> Span:
    now = time.time()
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        trace_id=trace_id,
        span_id=span_id or uuid.uuid4().hex[:16],
        parent_id=parent_id,
        name=name,
        attributes=attributes or {},
        start_time=now,
        end_time=now,
    )


async def add_auto_span(store: Any, rollout_id: str, attempt_id: str, **kwargs: Any) -> Span | None:
    seq = await store.get_next_span_sequence_id(rollout_id, attempt_id)
    return await store.add_span(make_span(rollout_id, attempt_id, seq, **kwargs))


async def started(store: Any, **kwargs: Any) -> AttemptedRollout:
    """A rollout enqueued and dequeued: status preparing, attempt 1."""
    rollout = await store.enqueue_rollout({"q": "x"}, **kwargs)
    got = await store.dequeue_rollout(worker_id="w-test")
    assert got is not None and got.rollout_id == rollout.rollout_id
    return got


async def must_get(store: Any, rollout_id: str) -> Rollout:
    rollout = await store.get_rollout_by_id(rollout_id)
    assert rollout is not None, rollout_id
    return rollout


async def latest(store: Any, rollout_id: str) -> Attempt:
    attempt = await store.get_latest_attempt(rollout_id)
    assert attempt is not None, rollout_id
    return attempt


def rollout_counts(stats: dict[str, Any]) -> dict[str, int]:
    """Counts by rollout status, found in `statistics()` (nested under a rollout key, or flat)."""
    nested = [v for k, v in stats.items() if "rollout" in str(k).lower() and isinstance(v, dict)]
    for candidate in [*nested, stats]:
        if any(s in candidate for s in ROLLOUT_STATUSES):
            return {s: int(candidate.get(s, 0) or 0) for s in ROLLOUT_STATUSES}
    raise AssertionError(f"statistics() has no counts by rollout status: {stats!r}")


# --- enqueue ---------------------------------------------------------------------------------


async def test_enqueue_returns_queuing_rollout(store: Any) -> None:
    before = time.time()
    rollout = await store.enqueue_rollout({"question": "2+2"}, mode="train", metadata={"k": 1})
    assert isinstance(rollout, Rollout)
    assert rollout.rollout_id.startswith("ro-")
    assert rollout.status == "queuing"
    assert before - 1 <= rollout.start_time <= time.time() + 1
    assert rollout.end_time is None
    assert rollout.input == {"question": "2+2"}
    assert rollout.mode == "train"
    assert rollout.metadata == {"k": 1}
    assert rollout.config == RolloutConfig()
    stored = await must_get(store, rollout.rollout_id)
    assert stored.model_dump() == rollout.model_dump()


async def test_enqueue_keeps_given_config(store: Any) -> None:
    config = RolloutConfig(timeout_seconds=30, max_attempts=3, retry_condition=["failed", "timeout"])
    rollout = await store.enqueue_rollout("task", config=config)
    assert rollout.config == config
    assert (await must_get(store, rollout.rollout_id)).config == config


async def test_enqueue_idempotency_key_returns_first_rollout(store: Any) -> None:
    first = await store.enqueue_rollout("a", idempotency_key="job-1")
    second = await store.enqueue_rollout("b", idempotency_key="job-1")
    assert second.rollout_id == first.rollout_id
    assert second.input == "a"
    assert len(await store.query_rollouts()) == 1
    # The queue holds one entry.
    got = await store.dequeue_rollout()
    assert got is not None and got.rollout_id == first.rollout_id
    assert await store.dequeue_rollout() is None


async def test_enqueue_many_idempotency_key_within_batch(store: Any) -> None:
    out = await store.enqueue_many_rollouts(
        [
            EnqueueRolloutRequest(input=1, idempotency_key="k"),
            EnqueueRolloutRequest(input=2, idempotency_key="k"),
        ]
    )
    assert len(out) == 2
    assert out[0].rollout_id == out[1].rollout_id
    assert len(await store.query_rollouts()) == 1
    assert len(await store.dequeue_many_rollouts(limit=10)) == 1


async def test_enqueue_idempotency_key_mixed_single_and_batch(store: Any) -> None:
    first = await store.enqueue_rollout("a", idempotency_key="k1")
    out = await store.enqueue_many_rollouts(
        [
            EnqueueRolloutRequest(input="again", idempotency_key="k1"),
            EnqueueRolloutRequest(input="fresh"),
            EnqueueRolloutRequest(input="keyed", idempotency_key="k2"),
        ]
    )
    assert out[0].rollout_id == first.rollout_id
    assert len({r.rollout_id for r in out}) == 3
    again = await store.enqueue_rollout("later", idempotency_key="k2")
    assert again.rollout_id == out[2].rollout_id
    assert len(await store.query_rollouts()) == 3
    assert len(await store.dequeue_many_rollouts(limit=10)) == 3


async def test_enqueue_many_returns_rollouts_in_order(store: Any) -> None:
    out = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i, mode="val") for i in range(4)])
    assert [r.input for r in out] == [0, 1, 2, 3]
    assert all(r.status == "queuing" and r.mode == "val" for r in out)
    assert len({r.rollout_id for r in out}) == 4


# --- resources -------------------------------------------------------------------------------


async def test_enqueue_without_resources_and_none_stored(store: Any) -> None:
    rollout = await store.enqueue_rollout("x")
    assert rollout.resources_id is None
    assert await store.get_latest_resources() is None


async def test_enqueue_takes_latest_resources(store: Any) -> None:
    r1 = await store.add_resources({"llm": LLM(endpoint="http://a/v1", model="m1")})
    assert r1.resources_id.startswith("rs-")
    assert isinstance(r1.resources["llm"], LLM)
    rollout1 = await store.enqueue_rollout("x")
    assert rollout1.resources_id == r1.resources_id

    r2 = await store.add_resources({"prompt": PromptTemplate(template="hi {name}")})
    assert (await store.get_latest_resources()).resources_id == r2.resources_id
    rollout2 = await store.enqueue_rollout("y")
    assert rollout2.resources_id == r2.resources_id
    # The first rollout keeps the resources it was enqueued with.
    assert (await must_get(store, rollout1.rollout_id)).resources_id == r1.resources_id


async def test_update_resources_marks_them_latest(store: Any) -> None:
    r1 = await store.add_resources({"llm": LLM(endpoint="http://a/v1", model="m1")})
    r2 = await store.add_resources({"llm": LLM(endpoint="http://b/v1", model="m2")})
    updated = await store.update_resources(r1.resources_id, {"llm": LLM(endpoint="http://c/v1", model="m3")})
    assert updated.resources_id == r1.resources_id
    assert updated.resources["llm"].model == "m3"
    latest_res = await store.get_latest_resources()
    assert latest_res is not None and latest_res.resources_id == r1.resources_id
    assert latest_res.resources["llm"].model == "m3"
    rollout = await store.enqueue_rollout("x")
    assert rollout.resources_id == r1.resources_id
    assert (await store.get_resources_by_id(r2.resources_id)).resources["llm"].model == "m2"


async def test_enqueue_with_explicit_resources_id(store: Any) -> None:
    r1 = await store.add_resources({"llm": LLM(endpoint="http://a/v1", model="m1")})
    await store.add_resources({"llm": LLM(endpoint="http://b/v1", model="m2")})
    rollout = await store.enqueue_rollout("x", resources_id=r1.resources_id)
    assert rollout.resources_id == r1.resources_id


async def test_a_resources_id_that_names_no_resources_is_stored_as_given(store: Any) -> None:
    # As agent-lightning: the id is the caller's to choose (resources may be added under it later); a runner that
    # claims such a rollout fails its attempt, naming the id.
    queued = await store.enqueue_rollout("x", resources_id="rs-later")
    started = await store.start_rollout("y", resources_id="rs-later")
    updated = await store.update_rollout(started.rollout_id, resources_id="rs-other")
    assert (queued.resources_id, updated.resources_id) == ("rs-later", "rs-other")


async def test_get_resources_by_unknown_id_is_none(store: Any) -> None:
    assert await store.get_resources_by_id("rs-doesnotexist") is None


# --- dequeue ---------------------------------------------------------------------------------


async def test_dequeue_is_fifo_over_single_enqueues(store: Any) -> None:
    ids = [(await store.enqueue_rollout(i)).rollout_id for i in range(5)]
    got = []
    for _ in ids:
        r = await store.dequeue_rollout()
        assert r is not None
        got.append(r.rollout_id)
    assert got == ids


async def test_dequeue_is_fifo_over_batch_enqueue(store: Any) -> None:
    out = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(5)])
    more = await store.enqueue_rollout(99)
    got = []
    while (r := await store.dequeue_rollout()) is not None:
        got.append(r.rollout_id)
    assert got == [r.rollout_id for r in out] + [more.rollout_id]


async def test_dequeue_empty_queue_returns_none_at_once(store: Any) -> None:
    assert await store.dequeue_rollout() is None  # warm-up: tables created on first use
    t0 = time.perf_counter()
    assert await store.dequeue_rollout() is None
    assert time.perf_counter() - t0 < 0.1
    t0 = time.perf_counter()
    assert await store.dequeue_many_rollouts(limit=5) == []
    assert time.perf_counter() - t0 < 0.1


async def test_dequeue_makes_rollout_preparing_with_first_attempt(store: Any) -> None:
    rollout = await store.enqueue_rollout("x")
    got = await store.dequeue_rollout(worker_id="w1")
    assert isinstance(got, AttemptedRollout)
    assert got.rollout_id == rollout.rollout_id
    assert got.status == "preparing"
    assert got.attempt.attempt_id.startswith("at-")
    assert got.attempt.rollout_id == rollout.rollout_id
    assert got.attempt.sequence_id == 1
    assert got.attempt.status == "preparing"
    assert got.attempt.worker_id == "w1"
    assert got.attempt.end_time is None
    assert (await must_get(store, rollout.rollout_id)).status == "preparing"
    stored_attempt = await latest(store, rollout.rollout_id)
    assert stored_attempt.attempt_id == got.attempt.attempt_id
    assert stored_attempt.worker_id == "w1"


async def test_dequeue_many_rollouts_honours_limit(store: Any) -> None:
    out = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(5)])
    first = await store.dequeue_many_rollouts(limit=3, worker_id="w1")
    assert [r.rollout_id for r in first] == [r.rollout_id for r in out[:3]]
    assert all(r.status == "preparing" and r.attempt.sequence_id == 1 for r in first)
    assert all(r.attempt.worker_id == "w1" for r in first)
    rest = await store.dequeue_many_rollouts(limit=3)
    assert [r.rollout_id for r in rest] == [r.rollout_id for r in out[3:]]
    assert await store.dequeue_many_rollouts(limit=3) == []


# --- start_rollout / start_attempt -----------------------------------------------------------


async def test_start_rollout_creates_preparing_rollout_without_queueing(store: Any) -> None:
    got = await store.start_rollout({"q": 1}, mode="test", worker_id="w1")
    assert isinstance(got, AttemptedRollout)
    assert got.rollout_id.startswith("ro-")
    assert got.status == "preparing"
    assert got.attempt.status == "preparing"
    assert got.attempt.sequence_id == 1
    assert got.attempt.worker_id == "w1"
    assert (await must_get(store, got.rollout_id)).status == "preparing"
    assert await store.dequeue_rollout() is None


async def test_start_attempt_makes_next_sequence_id_latest(store: Any) -> None:
    first = await store.start_rollout("x")
    second = await store.start_attempt(first.rollout_id, worker_id="w2")
    assert second.rollout_id == first.rollout_id
    assert second.attempt.sequence_id == 2
    assert second.attempt.attempt_id != first.attempt.attempt_id
    assert second.attempt.worker_id == "w2"
    assert (await latest(store, first.rollout_id)).attempt_id == second.attempt.attempt_id
    attempts = await store.query_attempts(first.rollout_id)
    assert [a.sequence_id for a in attempts] == [1, 2]


# --- spans -----------------------------------------------------------------------------------


async def test_first_span_moves_attempt_and_rollout_to_running(store: Any) -> None:
    got = await started(store)
    rid, aid = got.rollout_id, got.attempt.attempt_id
    stored = await add_auto_span(store, rid, aid)
    assert stored is not None
    assert (await latest(store, rid)).status == "running"
    assert (await must_get(store, rid)).status == "running"


async def test_span_moves_last_heartbeat_time(store: Any) -> None:
    got = await started(store)
    rid, aid = got.rollout_id, got.attempt.attempt_id
    await add_auto_span(store, rid, aid)
    first_beat = (await latest(store, rid)).last_heartbeat_time
    assert first_beat is not None
    await asyncio.sleep(0.02)
    await add_auto_span(store, rid, aid)
    second_beat = (await latest(store, rid)).last_heartbeat_time
    assert second_beat is not None and second_beat > first_beat


async def test_next_span_sequence_id_counts_per_rollout(store: Any) -> None:
    a = await store.start_rollout("a")
    b = await store.start_rollout("b")
    ids_a = [await store.get_next_span_sequence_id(a.rollout_id, a.attempt.attempt_id) for _ in range(3)]
    ids_b = [await store.get_next_span_sequence_id(b.rollout_id, b.attempt.attempt_id) for _ in range(2)]
    assert ids_a == [1, 2, 3]
    assert ids_b == [1, 2]


async def test_span_sequence_ids_continue_across_attempts(store: Any) -> None:
    first = await store.start_rollout("a")
    assert await store.get_next_span_sequence_id(first.rollout_id, first.attempt.attempt_id) == 1
    second = await store.start_attempt(first.rollout_id)
    assert await store.get_next_span_sequence_id(first.rollout_id, second.attempt.attempt_id) == 2


async def test_explicit_span_sequence_id_is_honoured(store: Any) -> None:
    got = await store.start_rollout("a")
    rid, aid = got.rollout_id, got.attempt.attempt_id
    stored = await store.add_span(make_span(rid, aid, 10, span_id="s10"))
    assert stored is not None and stored.sequence_id == 10
    spans = await store.query_spans(rid)
    assert [s.sequence_id for s in spans] == [10]
    assert await store.get_next_span_sequence_id(rid, aid) > 10


async def test_duplicate_span_is_ignored(store: Any) -> None:
    got = await store.start_rollout("a")
    rid, aid = got.rollout_id, got.attempt.attempt_id
    assert await store.add_span(make_span(rid, aid, 1, span_id="dup", name="first")) is not None
    assert await store.add_span(make_span(rid, aid, 2, span_id="dup", name="second")) is None
    spans = await store.query_spans(rid)
    assert len(spans) == 1
    assert spans[0].name == "first"


async def test_add_many_spans_skips_duplicates_inside_batch(store: Any) -> None:
    got = await store.start_rollout("a")
    rid, aid = got.rollout_id, got.attempt.attempt_id
    await store.add_span(make_span(rid, aid, 1, span_id="old"))
    out = await store.add_many_spans(
        [
            make_span(rid, aid, 2, span_id="s1"),
            make_span(rid, aid, 3, span_id="s2"),
            make_span(rid, aid, 4, span_id="s1"),
            make_span(rid, aid, 5, span_id="old"),
        ]
    )
    assert sorted(s.span_id for s in out) == ["s1", "s2"]
    spans = await store.query_spans(rid)
    assert sorted(s.span_id for s in spans) == ["old", "s1", "s2"]


async def test_add_many_spans_moves_attempt_to_running(store: Any) -> None:
    got = await started(store)
    rid, aid = got.rollout_id, got.attempt.attempt_id
    out = await store.add_many_spans([make_span(rid, aid, 1), make_span(rid, aid, 2)])
    assert len(out) == 2
    assert (await latest(store, rid)).status == "running"
    assert (await must_get(store, rid)).status == "running"


async def test_add_span_unknown_rollout_raises_not_found(store: Any) -> None:
    with pytest.raises(NotFoundError):
        await store.add_span(make_span("ro-doesnotexist", "at-doesnotexist", 1))


async def test_add_span_unknown_attempt_raises_not_found(store: Any) -> None:
    got = await store.start_rollout("a")
    with pytest.raises(NotFoundError):
        await store.add_span(make_span(got.rollout_id, "at-doesnotexist", 1))


async def test_add_span_attempt_of_other_rollout_raises_not_found(store: Any) -> None:
    a = await store.start_rollout("a")
    b = await store.start_rollout("b")
    with pytest.raises(NotFoundError):
        await store.add_span(make_span(a.rollout_id, b.attempt.attempt_id, 1))


async def test_next_span_sequence_id_unknown_rollout_raises_not_found(store: Any) -> None:
    with pytest.raises(NotFoundError):
        await store.get_next_span_sequence_id("ro-doesnotexist", "at-doesnotexist")


async def test_next_span_sequence_id_numbers_per_rollout_whatever_the_attempt_id(store: Any) -> None:
    # As agent-lightning: the counter is the rollout's, so "latest" or an id the store never made number too.
    started = await store.start_rollout("a")
    rid = started.rollout_id
    numbers = [
        await store.get_next_span_sequence_id(rid, started.attempt.attempt_id),
        await store.get_next_span_sequence_id(rid, "latest"),
        await store.get_next_span_sequence_id(rid, "at-unknown"),
    ]
    assert numbers == [1, 2, 3]


async def test_query_spans_filters_by_attempt_and_latest(store: Any) -> None:
    first = await store.start_rollout("a")
    rid, a1 = first.rollout_id, first.attempt.attempt_id
    await add_auto_span(store, rid, a1, span_id="a1-1")
    await add_auto_span(store, rid, a1, span_id="a1-2")
    a2 = (await store.start_attempt(rid)).attempt.attempt_id
    await add_auto_span(store, rid, a2, span_id="a2-1")

    assert [s.span_id for s in await store.query_spans(rid)] == ["a1-1", "a1-2", "a2-1"]
    assert [s.span_id for s in await store.query_spans(rid, a1)] == ["a1-1", "a1-2"]
    assert [s.span_id for s in await store.query_spans(rid, a2)] == ["a2-1"]
    assert [s.span_id for s in await store.query_spans(rid, "latest")] == ["a2-1"]


async def test_query_spans_name_filter(store: Any) -> None:
    got = await store.start_rollout("a")
    rid, aid = got.rollout_id, got.attempt.attempt_id
    await add_auto_span(store, rid, aid, span_id="1", name="openai.chat")
    await add_auto_span(store, rid, aid, span_id="2", name="reward")
    await add_auto_span(store, rid, aid, span_id="3", name="openai.chat")
    assert [s.span_id for s in await store.query_spans(rid, name="openai.chat")] == ["1", "3"]
    assert [s.span_id for s in await store.query_spans(rid, name_contains="rew")] == ["2"]
    assert await store.query_spans(rid, name="nothing") == []


async def test_query_spans_sort_desc_limit_offset(store: Any) -> None:
    got = await store.start_rollout("a")
    rid, aid = got.rollout_id, got.attempt.attempt_id
    for i in range(5):
        await add_auto_span(store, rid, aid, span_id=f"s{i}")
    desc = await store.query_spans(rid, sort_by="sequence_id", sort_order="desc")
    assert [s.sequence_id for s in desc] == [5, 4, 3, 2, 1]
    page = await store.query_spans(rid, sort_by="sequence_id", sort_order="asc", limit=2, offset=1)
    assert [s.sequence_id for s in page] == [2, 3]
    assert [s.sequence_id for s in await store.query_spans(rid, limit=2, offset=4)] == [5]


async def test_query_spans_round_trips_span_fields(store: Any) -> None:
    got = await store.start_rollout("a")
    rid, aid = got.rollout_id, got.attempt.attempt_id
    span = make_span(
        rid,
        aid,
        1,
        span_id="s1",
        parent_id="p1",
        name="llm",
        attributes={"gen_ai.request.model": "m", "prompt_token_ids": [1, 2, 3], "reward": 0.5},
    )
    await store.add_span(span)
    (stored,) = await store.query_spans(rid)
    assert stored.model_dump() == span.model_dump()


async def test_add_otel_span_round_trips_real_sdk_span(store: Any) -> None:
    got = await started(store)
    rid, aid = got.rollout_id, got.attempt.attempt_id
    provider = TracerProvider()  # private; never the global one
    tracer = provider.get_tracer("lightning-tests")
    attributes = {"gen_ai.system": "openai", "token_ids": (1, 2, 3), "n": 2}
    with (
        tracer.start_as_current_span("agent.run") as parent,
        tracer.start_as_current_span("openai.chat", attributes=attributes) as child,
    ):
        child.add_event("reward", {"value": 1.0})
    provider.shutdown()

    stored = await store.add_otel_span(rid, aid, child)
    assert stored is not None
    assert stored.name == "openai.chat"
    assert stored.rollout_id == rid and stored.attempt_id == aid
    assert stored.sequence_id >= 1
    assert stored.span_id == trace_api.format_span_id(child.get_span_context().span_id)
    assert stored.trace_id == trace_api.format_trace_id(child.get_span_context().trace_id)
    assert stored.parent_id == trace_api.format_span_id(parent.get_span_context().span_id)
    assert stored.attributes == {"gen_ai.system": "openai", "token_ids": [1, 2, 3], "n": 2}

    (queried,) = await store.query_spans(rid)
    assert queried.name == "openai.chat"
    assert queried.parent_id == stored.parent_id
    assert queried.attributes == stored.attributes
    assert [e.name for e in queried.events] == ["reward"]
    assert (await latest(store, rid)).status == "running"

    parent_stored = await store.add_otel_span(rid, aid, parent, sequence_id=50)
    assert parent_stored is not None and parent_stored.sequence_id == 50
    assert parent_stored.parent_id is None


async def test_span_sequence_ids_are_atomic_under_concurrency(store: Any) -> None:
    got = await store.start_rollout("a")
    pair = (got.rollout_id, got.attempt.attempt_id)
    results = await asyncio.gather(*(store.get_many_span_sequence_ids([pair]) for _ in range(50)))
    ids = [i for batch in results for i in batch]
    assert len(ids) == 50
    assert len(set(ids)) == 50
    assert min(ids) >= 1


async def test_get_many_span_sequence_ids_in_one_call(store: Any) -> None:
    a = await store.start_rollout("a")
    b = await store.start_rollout("b")
    pa = (a.rollout_id, a.attempt.attempt_id)
    pb = (b.rollout_id, b.attempt.attempt_id)
    assert await store.get_many_span_sequence_ids([pa, pb, pa, pa, pb]) == [1, 1, 2, 3, 2]


# --- status mapping through update_attempt ---------------------------------------------------


async def test_attempt_succeeded_moves_rollout_to_succeeded(store: Any) -> None:
    got = await started(store)
    attempt = await store.update_attempt(got.rollout_id, got.attempt.attempt_id, status="succeeded")
    assert attempt.status == "succeeded"
    assert attempt.end_time is not None
    rollout = await must_get(store, got.rollout_id)
    assert rollout.status == "succeeded"
    assert rollout.end_time is not None


async def test_failed_attempt_with_retry_condition_requeues_then_fails(store: Any) -> None:
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    got = await started(store, config=config)
    rid = got.rollout_id
    await store.update_attempt(rid, got.attempt.attempt_id, status="failed")
    rollout = await must_get(store, rid)
    assert rollout.status == "requeuing"
    assert rollout.end_time is None

    retry = await store.dequeue_rollout()
    assert retry is not None and retry.rollout_id == rid
    assert retry.status == "preparing"
    assert retry.attempt.sequence_id == 2
    await store.update_attempt(rid, retry.attempt.attempt_id, status="failed")
    rollout = await must_get(store, rid)
    assert rollout.status == "failed"
    assert rollout.end_time is not None
    assert await store.dequeue_rollout() is None


async def test_failed_attempt_without_retry_condition_fails_rollout(store: Any) -> None:
    got = await started(store, config=RolloutConfig(max_attempts=3))
    await store.update_attempt(got.rollout_id, got.attempt.attempt_id, status="failed")
    assert (await must_get(store, got.rollout_id)).status == "failed"
    assert await store.dequeue_rollout() is None


async def test_only_latest_attempt_moves_rollout(store: Any) -> None:
    first = await store.start_rollout("x", config=RolloutConfig(max_attempts=3, retry_condition=["failed"]))
    rid = first.rollout_id
    second = await store.start_attempt(rid)
    old = await store.update_attempt(rid, first.attempt.attempt_id, status="failed")
    assert old.status == "failed"
    rollout = await must_get(store, rid)
    assert rollout.status == "preparing"
    assert rollout.end_time is None
    await store.update_attempt(rid, second.attempt.attempt_id, status="succeeded")
    assert (await must_get(store, rid)).status == "succeeded"


async def test_cancelled_rollout_stays_cancelled(store: Any) -> None:
    got = await started(store)
    rid = got.rollout_id
    cancelled = await store.update_rollout(rid, status="cancelled")
    assert cancelled.status == "cancelled"
    await store.update_attempt(rid, got.attempt.attempt_id, status="succeeded")
    assert (await must_get(store, rid)).status == "cancelled"


@pytest.mark.parametrize(
    ("attempt_status", "rollout_status"),
    [("succeeded", "succeeded"), ("failed", "failed"), ("timeout", "failed"), ("unresponsive", "failed")],
)
async def test_terminal_statuses_stamp_end_time(store: Any, attempt_status: str, rollout_status: str) -> None:
    got = await started(store)
    attempt = await store.update_attempt(got.rollout_id, got.attempt.attempt_id, status=attempt_status)
    assert attempt.end_time is not None
    stored_attempt = await latest(store, got.rollout_id)
    assert stored_attempt.status == attempt_status
    assert stored_attempt.end_time is not None
    rollout = await must_get(store, got.rollout_id)
    assert rollout.status == rollout_status
    assert rollout.end_time is not None


async def test_update_attempt_running_moves_rollout_running(store: Any) -> None:
    got = await started(store)
    attempt = await store.update_attempt(got.rollout_id, got.attempt.attempt_id, status="running")
    assert attempt.status == "running"
    assert attempt.end_time is None
    assert (await must_get(store, got.rollout_id)).status == "running"


# --- watchdog --------------------------------------------------------------------------------


async def test_watchdog_marks_timeout_and_fails_rollout(store: Any) -> None:
    got = await started(store, config=RolloutConfig(timeout_seconds=0.2))
    assert await store.run_watchdog() == 0
    await asyncio.sleep(0.3)
    assert await store.run_watchdog() == 1
    attempt = await latest(store, got.rollout_id)
    assert attempt.status == "timeout"
    assert attempt.end_time is not None
    rollout = await must_get(store, got.rollout_id)
    assert rollout.status == "failed"
    assert rollout.end_time is not None
    assert await store.run_watchdog() == 0


async def test_watchdog_timeout_requeues_when_retry_allows(store: Any) -> None:
    config = RolloutConfig(timeout_seconds=0.2, max_attempts=2, retry_condition=["timeout"])
    got = await started(store, config=config)
    await asyncio.sleep(0.3)
    assert await store.run_watchdog() == 1
    assert (await latest(store, got.rollout_id)).status == "timeout"
    assert (await must_get(store, got.rollout_id)).status == "requeuing"
    retry = await store.dequeue_rollout()
    assert retry is not None and retry.rollout_id == got.rollout_id
    assert retry.attempt.sequence_id == 2


async def test_watchdog_marks_silent_attempt_unresponsive(store: Any) -> None:
    got = await started(store, config=RolloutConfig(unresponsive_seconds=0.2))
    await asyncio.sleep(0.3)
    assert await store.run_watchdog() == 1
    assert (await latest(store, got.rollout_id)).status == "unresponsive"
    assert (await must_get(store, got.rollout_id)).status == "failed"


async def test_watchdog_spares_attempt_that_heartbeats(store: Any) -> None:
    got = await started(store, config=RolloutConfig(unresponsive_seconds=0.3))
    rid, aid = got.rollout_id, got.attempt.attempt_id
    for _ in range(3):
        await asyncio.sleep(0.15)
        await add_auto_span(store, rid, aid)
    assert await store.run_watchdog() == 0
    assert (await latest(store, rid)).status == "running"


async def test_heartbeat_via_update_attempt_spares_attempt(store: Any) -> None:
    got = await started(store, config=RolloutConfig(unresponsive_seconds=0.3))
    rid, aid = got.rollout_id, got.attempt.attempt_id
    await asyncio.sleep(0.2)
    await store.update_attempt(rid, aid, last_heartbeat_time=time.time())
    await asyncio.sleep(0.2)
    assert await store.run_watchdog() == 0
    assert (await latest(store, rid)).status in ("preparing", "running")


async def test_late_span_revives_unresponsive_attempt(store: Any) -> None:
    got = await started(store, config=RolloutConfig(unresponsive_seconds=0.2))
    rid, aid = got.rollout_id, got.attempt.attempt_id
    await asyncio.sleep(0.3)
    assert await store.run_watchdog() == 1
    assert (await latest(store, rid)).status == "unresponsive"
    assert (await must_get(store, rid)).status == "failed"

    assert await add_auto_span(store, rid, aid) is not None
    assert (await latest(store, rid)).status == "running"
    assert (await must_get(store, rid)).status == "running"


async def test_background_watchdog_marks_without_explicit_call(store_url: str, open_store: Any) -> None:
    store = open_store(store_url, watchdog_interval=0.05)
    got = await started(store, config=RolloutConfig(timeout_seconds=0.1))
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        if (await latest(store, got.rollout_id)).status == "timeout":
            break
        await asyncio.sleep(0.05)
    assert (await latest(store, got.rollout_id)).status == "timeout"
    assert (await must_get(store, got.rollout_id)).status == "failed"


async def test_two_stores_run_watchdog_concurrently_mark_once(shared_url: str, open_store: Any) -> None:
    a = open_store(shared_url)
    b = open_store(shared_url)
    config = RolloutConfig(timeout_seconds=0.2, max_attempts=3, retry_condition=["timeout"])
    n = 20
    await a.enqueue_many_rollouts([EnqueueRolloutRequest(input=i, config=config) for i in range(n)])
    claimed = await b.dequeue_many_rollouts(limit=n)
    assert len(claimed) == n
    await asyncio.sleep(0.3)
    marked = await asyncio.gather(a.run_watchdog(), b.run_watchdog(), a.run_watchdog(), b.run_watchdog())
    assert sum(marked) == n
    for r in claimed:
        attempts = await a.query_attempts(r.rollout_id)
        assert [(x.sequence_id, x.status) for x in attempts] == [(1, "timeout")]
        assert (await a.get_rollout_by_id(r.rollout_id)).status == "requeuing"
    # Each rollout is in the queue once: a second round hands out sequence_id 2, exactly n of them.
    again = await a.dequeue_many_rollouts(limit=2 * n)
    assert sorted(r.rollout_id for r in again) == sorted(r.rollout_id for r in claimed)
    assert {r.attempt.sequence_id for r in again} == {2}


def _watchdog_pass_in_own_thread(store: Any, barrier: threading.Barrier) -> int:
    barrier.wait(timeout=10)
    return asyncio.run(store.run_watchdog())


async def test_two_stores_watchdog_passes_in_parallel_threads_mark_once(shared_url: str, open_store: Any) -> None:
    a = open_store(shared_url)
    b = open_store(shared_url)
    config = RolloutConfig(timeout_seconds=0.2, max_attempts=2, retry_condition=["timeout"])
    n = 100
    await a.enqueue_many_rollouts([EnqueueRolloutRequest(input=i, config=config) for i in range(n)])
    claimed = await a.dequeue_many_rollouts(limit=n)
    assert len(claimed) == n
    await asyncio.sleep(0.3)
    barrier = threading.Barrier(4)
    passes = [asyncio.to_thread(_watchdog_pass_in_own_thread, s, barrier) for s in (a, b, a, b)]
    marked = await asyncio.gather(*passes)
    assert sum(marked) == n
    requeued = await a.query_rollouts(status_in=["requeuing"])
    assert len(requeued) == n
    again = await b.dequeue_many_rollouts(limit=2 * n)
    assert len(again) == n
    assert {r.attempt.sequence_id for r in again} == {2}


async def test_two_background_watchdogs_on_one_database_mark_once(shared_url: str, open_store: Any) -> None:
    a = open_store(shared_url, watchdog_interval=0.02)
    b = open_store(shared_url, watchdog_interval=0.02)
    config = RolloutConfig(timeout_seconds=0.1, max_attempts=3, retry_condition=["timeout"])
    n = 10
    await a.enqueue_many_rollouts([EnqueueRolloutRequest(input=i, config=config) for i in range(n)])
    claimed = await a.dequeue_many_rollouts(limit=n)
    ids = sorted(r.rollout_id for r in claimed)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        if len(await b.query_rollouts(status_in=["requeuing"])) == n:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)  # let both watchdogs have another go
    assert sorted(r.rollout_id for r in await b.query_rollouts(status_in=["requeuing"])) == ids
    for rid in ids:
        assert [(x.sequence_id, x.status) for x in await a.query_attempts(rid)] == [(1, "timeout")]


# --- update_rollout / update_attempt: UNSET vs None ------------------------------------------


async def test_update_rollout_none_clears_metadata(store: Any) -> None:
    rollout = await store.enqueue_rollout("x", metadata={"a": 1})
    updated = await store.update_rollout(rollout.rollout_id, metadata=None)
    assert updated.metadata is None
    assert (await must_get(store, rollout.rollout_id)).metadata is None


async def test_update_rollout_without_fields_changes_nothing(store: Any) -> None:
    rollout = await store.enqueue_rollout({"q": 1}, mode="train", metadata={"a": 1})
    updated = await store.update_rollout(rollout.rollout_id)
    assert updated.model_dump() == rollout.model_dump()
    assert (await must_get(store, rollout.rollout_id)).model_dump() == rollout.model_dump()
    explicit = await store.update_rollout(rollout.rollout_id, metadata=UNSET, status=UNSET)
    assert explicit.model_dump() == rollout.model_dump()


async def test_update_rollout_sets_given_fields_only(store: Any) -> None:
    rollout = await store.enqueue_rollout({"q": 1}, mode="train", metadata={"a": 1})
    config = RolloutConfig(max_attempts=4)
    updated = await store.update_rollout(rollout.rollout_id, input={"q": 2}, config=config)
    assert updated.input == {"q": 2}
    assert updated.config == config
    assert updated.mode == "train"
    assert updated.metadata == {"a": 1}
    assert updated.status == "queuing"


async def test_update_rollout_status_queuing_puts_it_back_in_queue(store: Any) -> None:
    got = await store.start_rollout("x")
    assert await store.dequeue_rollout() is None
    updated = await store.update_rollout(got.rollout_id, status="queuing")
    assert updated.status == "queuing"
    again = await store.dequeue_rollout()
    assert again is not None and again.rollout_id == got.rollout_id
    assert again.status == "preparing"


async def test_update_rollout_status_cancelled_takes_it_out_of_queue(store: Any) -> None:
    rollout = await store.enqueue_rollout("x")
    updated = await store.update_rollout(rollout.rollout_id, status="cancelled")
    assert updated.status == "cancelled"
    assert updated.end_time is not None
    assert await store.dequeue_rollout() is None


async def test_update_attempt_none_clears_and_unset_keeps(store: Any) -> None:
    got = await started(store)
    rid, aid = got.rollout_id, got.attempt.attempt_id
    with_meta = await store.update_attempt(rid, aid, metadata={"m": 1})
    assert with_meta.metadata == {"m": 1}
    assert with_meta.worker_id == "w-test"
    assert with_meta.status == "preparing"
    cleared = await store.update_attempt(rid, aid, metadata=None)
    assert cleared.metadata is None
    assert cleared.worker_id == "w-test"
    no_worker = await store.update_attempt(rid, aid, worker_id=None)
    assert no_worker.worker_id is None
    stored = await latest(store, rid)
    assert stored.metadata is None and stored.worker_id is None


# --- wait_for_rollouts -----------------------------------------------------------------------


async def test_wait_for_rollouts_returns_finished(store: Any) -> None:
    a = await started(store)
    await store.update_attempt(a.rollout_id, a.attempt.attempt_id, status="succeeded")
    b = await started(store)
    await store.update_attempt(b.rollout_id, b.attempt.attempt_id, status="failed")
    done = await asyncio.wait_for(store.wait_for_rollouts(rollout_ids=[a.rollout_id, b.rollout_id]), 5)
    assert {r.rollout_id: r.status for r in done} == {a.rollout_id: "succeeded", b.rollout_id: "failed"}


async def test_wait_for_rollouts_timeout_returns_only_finished(store: Any) -> None:
    a = await started(store)
    await store.update_attempt(a.rollout_id, a.attempt.attempt_id, status="succeeded")
    b = await store.enqueue_rollout("still queued")
    t0 = time.perf_counter()
    done = await store.wait_for_rollouts(rollout_ids=[a.rollout_id, b.rollout_id], timeout=0.3)
    assert time.perf_counter() - t0 < 0.3 + 0.5
    assert [r.rollout_id for r in done] == [a.rollout_id]


async def test_wait_for_rollouts_zero_timeout_does_not_block(store: Any) -> None:
    r = await store.enqueue_rollout("x")
    t0 = time.perf_counter()
    assert await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=0) == []
    assert time.perf_counter() - t0 < 0.5


async def test_wait_for_rollouts_wakes_when_rollout_finishes(store: Any) -> None:
    got = await started(store)

    async def finish_soon() -> None:
        await asyncio.sleep(0.1)
        await store.update_attempt(got.rollout_id, got.attempt.attempt_id, status="succeeded")

    finisher = asyncio.create_task(finish_soon())
    t0 = time.perf_counter()
    done = await store.wait_for_rollouts(rollout_ids=[got.rollout_id], timeout=5)
    elapsed = time.perf_counter() - t0
    await finisher
    assert [r.rollout_id for r in done] == [got.rollout_id]
    assert done[0].status == "succeeded"
    assert elapsed < 1.0


async def test_wait_for_unknown_rollout_raises_not_found(store: Any) -> None:
    with pytest.raises(NotFoundError):
        await store.wait_for_rollouts(rollout_ids=["ro-doesnotexist"], timeout=0.1)


async def test_wait_for_finished_ids_answers_ids_and_waits_like_wait_for_rollouts(store: Any) -> None:
    a = await started(store)
    await store.update_attempt(a.rollout_id, a.attempt.attempt_id, status="succeeded")
    b = await started(store)
    queued = await store.enqueue_rollout("still queued")
    ids = [queued.rollout_id, b.rollout_id, a.rollout_id]
    assert await store.wait_for_finished_ids(rollout_ids=ids, timeout=0) == [a.rollout_id]

    async def finish_soon() -> None:
        await asyncio.sleep(0.1)
        await store.update_attempt(b.rollout_id, b.attempt.attempt_id, status="failed")

    finisher = asyncio.create_task(finish_soon())
    t0 = time.perf_counter()
    done = await store.wait_for_finished_ids(rollout_ids=ids, timeout=0.5)  # woken by b, then waits out queued
    await finisher
    assert done == [b.rollout_id, a.rollout_id]  # in the order asked
    assert 0.4 < time.perf_counter() - t0 < 0.5 + 1.0
    with pytest.raises(NotFoundError, match="wait_for_finished_ids: unknown rollout ids"):
        await store.wait_for_finished_ids(rollout_ids=["ro-doesnotexist"], timeout=0.1)


async def test_waits_look_each_rollout_s_row_number_up_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A phase is waited for in slices, each a wait of the store: the rollouts' row numbers (which never change) are
    read at the first; an unknown id is still refused at every wait."""
    from lightning.store import SqlLightningStore
    from lightning.store import sql as sql_store

    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    looked_up: list[list[str]] = []
    read = sql_store._op_rollout_numbers
    monkeypatch.setattr(sql_store, "_op_rollout_numbers", lambda tx, ids: looked_up.append(ids) or read(tx, ids))
    try:
        ids = [(await store.enqueue_rollout(i)).rollout_id for i in range(3)]
        for _ in range(3):
            assert await store.wait_for_finished_ids(rollout_ids=ids, timeout=0) == []
        assert looked_up == [ids]
        for _ in range(2):
            with pytest.raises(NotFoundError, match="no-such-rollout"):
                await store.wait_for_finished_ids(rollout_ids=[ids[0], "no-such-rollout"], timeout=0)
        assert looked_up == [ids, ["no-such-rollout"], ["no-such-rollout"]]
    finally:
        await store.close()


async def test_a_busy_fleet_s_wait_asks_the_store_once_a_slice(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the fleet runs rollouts of its phase (`busy`), the phase is not over: its wait asks the store once a
    slice, not at each rollout the fleet finishes. It still ends within a slice of the last finish when busy stays
    true (an attempt the store moved on, still running here), and at once when the fleet goes idle."""
    from lightning import stopping
    from lightning.runner.fleet import wait_unless_stopped
    from lightning.store import SqlLightningStore
    from lightning.store import sql as sql_store

    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    asked: list[float] = []  # the store's reads of the finished ids
    read = sql_store._op_finished_ids
    monkeypatch.setattr(sql_store, "_op_finished_ids", lambda *args: asked.append(time.monotonic()) or read(*args))
    monkeypatch.setattr(stopping, "POLL_SECONDS", 1.0)
    try:
        ids = [(await store.enqueue_rollout(i)).rollout_id for i in range(20)]
        claimed = [await store.dequeue_rollout(worker_id="w") for _ in range(20)]
        last_finish = [0.0]

        async def finish(pause: float) -> None:
            for attempt in claimed:
                await store.update_attempt(attempt.rollout_id, attempt.attempt.attempt_id, status="succeeded")
                last_finish[0] = time.monotonic()
                await asyncio.sleep(pause)

        finisher = asyncio.create_task(finish(0.02))  # ~0.4 s of finishes, each one a wake-up of an idle wait
        done = await wait_unless_stopped(store, ids, timeout=30, busy=lambda: True)
        ended = time.monotonic()
        await finisher
        assert done == ids
        assert len(asked) <= 4  # a read a slice of 1 s, not one a finish (20 and more)
        assert ended - last_finish[0] < 1.0 + 0.8  # within a slice of the last finish

        running = [True]
        more = [(await store.enqueue_rollout(i)).rollout_id for i in range(2)]
        for _ in more:
            attempt = await store.dequeue_rollout(worker_id="w")
            await store.update_attempt(attempt.rollout_id, attempt.attempt.attempt_id, status="succeeded")
        asyncio.get_running_loop().call_later(0.05, running.clear)  # the fleet goes idle
        started = time.monotonic()
        assert await wait_unless_stopped(store, more, timeout=30, busy=lambda: bool(running)) == more
        assert time.monotonic() - started < 0.6  # not the slice of 1 s
    finally:
        await store.close()


async def test_a_phase_wait_reads_no_rollout_whole_and_a_rollout_wait_each_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner process waits on its phase's rollouts in slices, woken by every rollout it finishes, to know when
    they are all done: it reads their ids, none whole (issue 39). `wait_for_rollouts`, woken the same way, reads each
    finished rollout whole once over the whole wait, not again at every poll."""
    from lightning import stopping
    from lightning.runner.fleet import wait_unless_stopped
    from lightning.store import SqlLightningStore
    from lightning.store import sql as sql_store

    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    reads: list[str] = []
    decode = sql_store._rollout
    monkeypatch.setattr(sql_store, "_rollout", lambda row: reads.append(row["rollout_id"]) or decode(row))
    monkeypatch.setattr(stopping, "POLL_SECONDS", 0.02)  # many slices
    try:
        queued = [await store.enqueue_rollout(i) for i in range(30)]
        ids = [rollout.rollout_id for rollout in queued]

        claimed = [await store.dequeue_rollout(worker_id="w") for _ in range(30)]

        async def finish(attempts: list[Any], pause: float) -> None:
            for attempt in attempts:
                await store.update_attempt(attempt.rollout_id, attempt.attempt.attempt_id, status="succeeded")
                await asyncio.sleep(pause)

        await finish(claimed[:10], 0.0)
        reads.clear()
        finisher = asyncio.create_task(finish(claimed[10:20], 0.01))  # each one wakes the wait
        done = await wait_unless_stopped(store, ids, timeout=0.4)
        await finisher
        assert done == ids[:20] and reads == []

        finisher = asyncio.create_task(finish(claimed[20:], 0.01))
        whole = await store.wait_for_rollouts(rollout_ids=ids[10:], timeout=0.4)
        await finisher
        assert [r.rollout_id for r in whole] == ids[10:]
        assert sorted(reads) == sorted(ids[10:])  # each once
    finally:
        await store.close()


# --- queries ---------------------------------------------------------------------------------


async def _three_rollouts(store: Any) -> list[Rollout]:
    out = []
    for i in range(3):
        out.append(await store.enqueue_rollout(i, mode="train" if i < 2 else "val"))
        await asyncio.sleep(0.01)  # distinct start times
    return out


async def test_query_rollouts_status_in(store: Any) -> None:
    r = await _three_rollouts(store)
    await store.dequeue_rollout()
    queued = await store.query_rollouts(status_in=["queuing"], sort_by="start_time")
    assert [x.rollout_id for x in queued] == [r[1].rollout_id, r[2].rollout_id]
    preparing = await store.query_rollouts(status_in=["preparing", "running"])
    assert [x.rollout_id for x in preparing] == [r[0].rollout_id]


async def test_query_rollouts_rollout_id_in_and_contains(store: Any) -> None:
    r = await _three_rollouts(store)
    got = await store.query_rollouts(rollout_id_in=[r[0].rollout_id, r[2].rollout_id, "ro-missing"])
    assert sorted(x.rollout_id for x in got) == sorted([r[0].rollout_id, r[2].rollout_id])
    fragment = r[1].rollout_id[-10:]
    assert [x.rollout_id for x in await store.query_rollouts(rollout_id_contains=fragment)] == [r[1].rollout_id]
    assert len(await store.query_rollouts(rollout_id_contains="ro-")) == 3


async def test_query_rollouts_mode(store: Any) -> None:
    r = await _three_rollouts(store)
    assert [x.rollout_id for x in await store.query_rollouts(mode="val")] == [r[2].rollout_id]


async def test_query_rollouts_filter_logic_or(store: Any) -> None:
    r = await _three_rollouts(store)
    await store.dequeue_rollout()  # r0 -> preparing
    both_and = await store.query_rollouts(status_in=["preparing"], rollout_id_in=[r[2].rollout_id])
    assert both_and == []
    either = await store.query_rollouts(status_in=["preparing"], rollout_id_in=[r[2].rollout_id], filter_logic="or")
    assert sorted(x.rollout_id for x in either) == sorted([r[0].rollout_id, r[2].rollout_id])


async def test_query_rollouts_sort_limit_offset(store: Any) -> None:
    r = await _three_rollouts(store)
    desc = await store.query_rollouts(sort_by="start_time", sort_order="desc")
    assert [x.rollout_id for x in desc] == [x.rollout_id for x in reversed(r)]
    page = await store.query_rollouts(sort_by="start_time", limit=2, offset=1)
    assert [x.rollout_id for x in page] == [r[1].rollout_id, r[2].rollout_id]
    assert len(await store.query_rollouts(sort_by="start_time", limit=1)) == 1
    assert await store.query_rollouts(sort_by="start_time", offset=3) == []


async def test_query_rollouts_invalid_sort_by_names_field(store: Any) -> None:
    await store.enqueue_rollout("x")
    with pytest.raises(InvalidArgumentError) as info:
        await store.query_rollouts(sort_by="no_such_field")
    message = str(info.value)
    assert "no_such_field" in message or "sort_by" in message


async def test_query_attempts_sorted(store: Any) -> None:
    first = await store.start_rollout("x")
    rid = first.rollout_id
    await store.start_attempt(rid)
    third = await store.start_attempt(rid)
    asc = await store.query_attempts(rid)
    assert [a.sequence_id for a in asc] == [1, 2, 3]
    desc = await store.query_attempts(rid, sort_by="sequence_id", sort_order="desc")
    assert [a.sequence_id for a in desc] == [3, 2, 1]
    assert desc[0].attempt_id == third.attempt.attempt_id
    page = await store.query_attempts(rid, limit=1, offset=1)
    assert [a.sequence_id for a in page] == [2]


async def test_query_resources(store: Any) -> None:
    r1 = await store.add_resources({"llm": LLM(endpoint="http://a/v1", model="m1")})
    r2 = await store.add_resources({"prompt": PromptTemplate(template="{x}")})
    everything = await store.query_resources()
    assert sorted(x.resources_id for x in everything) == sorted([r1.resources_id, r2.resources_id])
    only = await store.query_resources(resources_id=r2.resources_id)
    assert [x.resources_id for x in only] == [r2.resources_id]
    assert isinstance(only[0].resources["prompt"], PromptTemplate)
    fragment = r1.resources_id[-8:]
    assert [x.resources_id for x in await store.query_resources(resources_id_contains=fragment)] == [r1.resources_id]
    assert len(await store.query_resources(limit=1)) == 1


async def test_dequeue_with_worker_makes_worker_busy_and_success_idle(store: Any) -> None:
    await store.enqueue_rollout("x")
    got = await store.dequeue_rollout(worker_id="w1")
    assert got is not None
    worker = await store.get_worker_by_id("w1")
    assert worker is not None
    assert worker.status == "busy"
    assert worker.current_rollout_id == got.rollout_id
    assert worker.current_attempt_id == got.attempt.attempt_id
    assert worker.last_dequeue_time is not None
    await store.update_attempt(got.rollout_id, got.attempt.attempt_id, status="succeeded")
    worker = await store.get_worker_by_id("w1")
    assert worker is not None and worker.status == "idle"


async def test_sorting_puts_null_first_ascending_and_last_descending(store: Any) -> None:
    # As agent-lightning and SQLite do; PostgreSQL's own default is the other way round.
    train = (await store.enqueue_rollout("a", mode="train")).rollout_id
    none = (await store.enqueue_rollout("b")).rollout_id
    val = (await store.enqueue_rollout("c", mode="val")).rollout_id
    ascending = await store.query_rollouts(sort_by="mode")
    descending = await store.query_rollouts(sort_by="mode", sort_order="desc")
    assert [r.rollout_id for r in ascending] == [none, train, val]
    assert [r.rollout_id for r in descending] == [val, train, none]


async def test_a_worker_given_another_attempt_moves_to_it(store: Any) -> None:
    await store.enqueue_rollout("x")
    first = await store.dequeue_rollout(worker_id="w1")
    second = await store.start_attempt(first.rollout_id)
    await store.update_attempt(first.rollout_id, second.attempt.attempt_id, worker_id="w1")
    worker = await store.get_worker_by_id("w1")
    assert (worker.status, worker.current_attempt_id) == ("busy", second.attempt.attempt_id)


async def test_update_worker_heartbeat_stats(store: Any) -> None:
    before = time.time()
    worker = await store.update_worker("w9", heartbeat_stats={"gpu": 0.5})
    assert worker.worker_id == "w9"
    assert worker.heartbeat_stats == {"gpu": 0.5}
    assert worker.last_heartbeat_time is not None and worker.last_heartbeat_time >= before - 1
    stored = await store.get_worker_by_id("w9")
    assert stored is not None and stored.heartbeat_stats == {"gpu": 0.5}
    assert stored.last_heartbeat_time == worker.last_heartbeat_time


async def test_get_unknown_worker_is_none(store: Any) -> None:
    assert await store.get_worker_by_id("nobody") is None


async def test_query_workers_by_status(store: Any) -> None:
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(2)])
    await store.dequeue_rollout(worker_id="busy-1")
    await store.update_worker("other-1", heartbeat_stats={})
    busy = await store.query_workers(status_in=["busy"])
    assert [w.worker_id for w in busy] == ["busy-1"]
    every = await store.query_workers(sort_by="worker_id")
    assert [w.worker_id for w in every] == ["busy-1", "other-1"]
    assert [w.worker_id for w in await store.query_workers(worker_id_contains="other")] == ["other-1"]


# --- statistics ------------------------------------------------------------------------------


async def test_statistics_counts_rollouts_by_status(store: Any) -> None:
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(5)])
    a = await store.dequeue_rollout()
    b = await store.dequeue_rollout()
    await store.dequeue_rollout()
    await store.update_attempt(a.rollout_id, a.attempt.attempt_id, status="succeeded")
    await store.update_attempt(b.rollout_id, b.attempt.attempt_id, status="failed")
    await store.start_rollout("direct")
    counts = rollout_counts(await store.statistics())
    assert counts["queuing"] == 2
    assert counts["preparing"] == 2
    assert counts["succeeded"] == 1
    assert counts["failed"] == 1
    assert counts["running"] == 0
    assert sum(counts.values()) == 6


# --- unknown ids and invalid arguments -------------------------------------------------------


async def test_get_unknown_rollout_is_none(store: Any) -> None:
    assert await store.get_rollout_by_id("ro-doesnotexist") is None


async def test_update_unknown_rollout_raises_not_found(store: Any) -> None:
    with pytest.raises(NotFoundError):
        await store.update_rollout("ro-doesnotexist", metadata={"a": 1})


async def test_update_attempt_unknown_ids_raise_not_found(store: Any) -> None:
    got = await store.start_rollout("x")
    with pytest.raises(NotFoundError):
        await store.update_attempt("ro-doesnotexist", got.attempt.attempt_id, status="running")
    with pytest.raises(NotFoundError):
        await store.update_attempt(got.rollout_id, "at-doesnotexist", status="running")


async def test_start_attempt_unknown_rollout_raises_not_found(store: Any) -> None:
    with pytest.raises(NotFoundError):
        await store.start_attempt("ro-doesnotexist")


async def test_query_attempts_unknown_rollout_raises_not_found(store: Any) -> None:
    with pytest.raises(NotFoundError):
        await store.query_attempts("ro-doesnotexist")


async def test_not_found_error_is_a_value_error(store: Any) -> None:
    with pytest.raises(ValueError):
        await store.start_attempt("ro-doesnotexist")


async def test_negative_offset_raises_invalid_argument(store: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="offset"):
        await store.query_rollouts(offset=-1)


async def test_limit_below_minus_one_raises_invalid_argument(store: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="limit"):
        await store.query_rollouts(limit=-5)


async def test_bad_rollout_status_raises_invalid_argument(store: Any) -> None:
    rollout = await store.enqueue_rollout("x")
    with pytest.raises(InvalidArgumentError, match="status"):
        await store.update_rollout(rollout.rollout_id, status="bogus")
    assert (await must_get(store, rollout.rollout_id)).status == "queuing"


async def test_bad_attempt_status_raises_invalid_argument(store: Any) -> None:
    got = await store.start_rollout("x")
    with pytest.raises(InvalidArgumentError, match="status"):
        await store.update_attempt(got.rollout_id, got.attempt.attempt_id, status="bogus")
    assert (await latest(store, got.rollout_id)).status == "preparing"


async def test_bad_sort_order_raises_invalid_argument(store: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="sort_order"):
        await store.query_rollouts(sort_by="start_time", sort_order="sideways")


async def test_dequeue_with_wait_wakes_when_work_is_enqueued(store: Any) -> None:
    async def enqueue_later() -> None:
        await asyncio.sleep(0.2)
        await store.enqueue_rollout({"late": True})

    started_at = time.monotonic()
    task = asyncio.create_task(enqueue_later())
    claimed = await store.dequeue_rollout(worker_id="w", wait=5.0)
    await task
    assert claimed is not None and claimed.input == {"late": True}
    # Woken by the enqueue, well before the 5 s wait ends (the margin is for a loaded machine, not a speed claim).
    assert time.monotonic() - started_at < 3.0


async def test_dequeue_with_wait_returns_none_after_the_wait(store: Any) -> None:
    started_at = time.monotonic()
    assert await store.dequeue_rollout(wait=0.3) is None
    # It waited, and returned after its own wait, not some longer default (a loaded CI machine took 1.55 s over HTTP).
    assert 0.25 < time.monotonic() - started_at < 5.0


# --- queues ----------------------------------------------------------------------------------


async def test_each_queue_is_dequeued_only_by_its_own_runners(store: Any) -> None:
    plain = await store.enqueue_rollout("plain")
    first = await store.enqueue_rollout("a1", queue="run-a")
    batch = await store.enqueue_many_rollouts(
        [EnqueueRolloutRequest(input="b1", queue="run-b"), EnqueueRolloutRequest(input="a2", queue="run-a")]
    )

    assert [r.rollout_id for r in await store.dequeue_many_rollouts(limit=10, queue="run-a")] == [
        first.rollout_id,
        batch[1].rollout_id,
    ]
    assert await store.dequeue_rollout(queue="run-a") is None
    claimed = await store.dequeue_rollout()  # no queue: the default one, as agent-lightning's runners ask
    assert claimed is not None and claimed.rollout_id == plain.rollout_id
    assert await store.dequeue_rollout() is None
    assert [r.input for r in await store.query_rollouts(queue="run-b")] == ["b1"]
    assert {r.input for r in await store.query_rollouts(queue="default")} == {"plain"}


async def test_a_retried_rollout_goes_back_to_its_own_queue(store: Any) -> None:
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    rollout = await store.enqueue_rollout("x", config=config, queue="run-a")
    claimed = await store.dequeue_rollout(queue="run-a")
    await store.update_attempt(rollout.rollout_id, claimed.attempt.attempt_id, status="failed")
    assert (await must_get(store, rollout.rollout_id)).status == "requeuing"
    assert await store.dequeue_rollout() is None
    again = await store.dequeue_rollout(queue="run-a")
    assert again is not None and again.attempt.sequence_id == 2


async def test_counts_past_any_table_size_are_refused_by_name(store: Any) -> None:
    for method, arguments in (
        (store.query_rollouts, {"limit": 2**63}),
        (store.query_rollouts, {"offset": 2**63}),
        (store.dequeue_many_rollouts, {"limit": 2**64}),
    ):
        with pytest.raises(InvalidArgumentError, match="limit|offset"):
            await method(**arguments)


async def test_an_unknown_argument_is_named() -> None:
    from lightning.store import SqlLightningStore

    async with SqlLightningStore("sqlite://", watchdog_interval=None) as store:
        with pytest.raises(InvalidArgumentError, match="query_spans: nmae: unknown argument"):
            await store.query_spans("ro-1", nmae="x")
        with pytest.raises(InvalidArgumentError, match=r"status: .*\(got 'done'\)"):
            await store.update_rollout("ro-1", status="done")


def test_a_store_from_before_queues_keeps_its_rollouts_in_the_default_queue(tmp_path: Any) -> None:
    """A SQLite file written before the queue column existed: opened now, its queued rollout is in the default
    queue, and new rollouts get queues."""
    import sqlite3

    from lightning.store import SqlLightningStore

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.executescript(OLD_ROLLOUTS_TABLE)
        db.execute(
            "INSERT INTO rollouts (rollout_id, input, start_time, status, config, queued_at, attempt_count, "
            "next_span_sequence_id) VALUES ('ro-old', '\"old\"', 1.0, 'queuing', '{}', 1.0, 0, 1)"
        )

    async def check() -> None:
        async with SqlLightningStore(f"sqlite:///{path}", watchdog_interval=None) as store:
            await store.enqueue_rollout("new", queue="run-a")
            claimed = await store.dequeue_rollout()
            assert claimed is not None and (claimed.rollout_id, claimed.input) == ("ro-old", "old")
            assert (await store.dequeue_rollout(queue="run-a")).input == "new"

    asyncio.run(check())
    with sqlite3.connect(path) as db:
        indexes = {row[1] for row in db.execute("PRAGMA index_list(rollouts)")}
    assert "ix_rollouts_queue_head" in indexes and "ix_rollouts_queue" not in indexes


def test_repeated_query_spans_sees_spans_added_since_through_any_store(tmp_path: Any) -> None:
    """query_spans keeps decoded answers while the database is unchanged: a span added through this store object,
    or through another one on the same file (another connection, as another process would be), shows at once."""
    from lightning.store import SqlLightningStore

    url = f"sqlite:///{tmp_path / 'store.db'}"

    async def check() -> None:
        async with (
            SqlLightningStore(url, watchdog_interval=None) as reader,
            SqlLightningStore(url, watchdog_interval=None) as writer,
        ):
            claimed = await reader.enqueue_rollout("task") and await reader.dequeue_rollout()
            rollout_id, attempt_id = claimed.rollout_id, claimed.attempt.attempt_id
            await reader.add_span(make_span(rollout_id, attempt_id, 1, span_id="a"))
            first = await reader.query_spans(rollout_id)
            first.items.clear()  # the caller's list, not the store's
            assert [s.span_id for s in await reader.query_spans(rollout_id)] == ["a"]
            await writer.add_span(make_span(rollout_id, attempt_id, 2, span_id="b"))
            assert [s.span_id for s in await reader.query_spans(rollout_id)] == ["a", "b"]
            await reader.add_span(make_span(rollout_id, attempt_id, 3, span_id="c"))
            assert [s.span_id for s in await reader.query_spans(rollout_id, attempt_id)] == ["a", "b", "c"]
            assert [s.span_id for s in await writer.query_spans(rollout_id, "latest")] == ["a", "b", "c"]
            await writer.start_attempt(rollout_id)
            assert list(await reader.query_spans(rollout_id, "latest")) == []

    asyncio.run(check())


OLD_ROLLOUTS_TABLE = """
CREATE TABLE rollouts (
    seq INTEGER NOT NULL PRIMARY KEY, rollout_id VARCHAR(64) NOT NULL UNIQUE, input TEXT NOT NULL,
    start_time FLOAT NOT NULL, end_time FLOAT, mode VARCHAR(16), resources_id VARCHAR(64), status VARCHAR(16) NOT NULL,
    config TEXT NOT NULL, metadata TEXT, idempotency_key VARCHAR(255), queued_at FLOAT, attempt_count INTEGER NOT NULL,
    latest_attempt_id VARCHAR(64), next_span_sequence_id INTEGER NOT NULL
);
CREATE INDEX ix_rollouts_queue ON rollouts (queued_at, seq) WHERE queued_at IS NOT NULL;
"""


# --- agent-lightning 0.3's answer shapes ------------------------------------------------------


async def test_queries_answer_a_page_with_the_total_past_it(store: Any) -> None:
    for word in ("a", "b", "c", "d", "e"):
        await store.enqueue_rollout({"word": word})
    everything = await store.query_rollouts()
    assert isinstance(everything, PaginatedResult)
    assert (len(everything), everything.total, everything.limit, everything.offset) == (5, 5, -1, 0)
    page = await store.query_rollouts(limit=2, offset=1)
    assert [r.input["word"] for r in page] == ["b", "c"] and page.total == 5
    last = await store.query_rollouts(limit=2, offset=4)
    assert [r.input["word"] for r in last] == ["e"] and last.total == 5
    past_the_end = await store.query_rollouts(limit=2, offset=9)
    assert past_the_end == [] and past_the_end.total == 5
    assert (await store.query_rollouts(status_in=["running"], limit=3)).total == 0


async def test_get_rollout_by_id_comes_with_its_latest_attempt(store: Any) -> None:
    queued = await store.enqueue_rollout({"q": 1})
    assert type(await store.get_rollout_by_id(queued.rollout_id)) is Rollout
    claimed = await store.dequeue_rollout()
    again = await store.start_attempt(claimed.rollout_id)
    got = await store.get_rollout_by_id(claimed.rollout_id)
    assert isinstance(got, AttemptedRollout) and got.attempt.attempt_id == again.attempt.attempt_id


async def test_statistics_has_agent_lightnings_totals(store: Any) -> None:
    await store.enqueue_rollout({"q": 1})
    claimed = await store.dequeue_rollout(worker_id="w-1")
    await add_auto_span(store, claimed.rollout_id, claimed.attempt.attempt_id)
    stats = await store.statistics()
    assert {k: stats[k] for k in stats if k.startswith("total_")} == {
        "total_rollouts": 1,
        "total_attempts": 1,
        "total_spans": 1,
        "total_resources": 0,
        "total_workers": 1,
    }


async def test_query_spans_by_parts_of_ids(store: Any) -> None:
    await store.enqueue_rollout({"q": 1})
    claimed = await store.dequeue_rollout()
    rollout_id, attempt_id = claimed.rollout_id, claimed.attempt.attempt_id
    first = await add_auto_span(store, rollout_id, attempt_id, name="one")
    await add_auto_span(store, rollout_id, attempt_id, name="two")
    by_span = await store.query_spans(rollout_id, span_id_contains=first.span_id[2:8])
    assert [s.name for s in by_span] == ["one"] and by_span.total == 1
    by_trace = await store.query_spans(rollout_id, trace_id_contains=first.trace_id[:6], limit=1)
    assert len(by_trace) == 1 and by_trace.total == 2


# --- the runner's lifecycle in fewer requests: claim_rollouts, add_many_spans(number=True), finish_attempt,
# query_latest_spans ---------------------------------------------------------------------------------


async def test_claim_rollouts_starts_each_attempt_running_under_its_worker_with_the_resources(store: Any) -> None:
    template = PromptTemplate(template="{x}", engine="f-string")
    resources = await store.add_resources({"prompt": template})
    queued = await store.enqueue_many_rollouts([{"input": {"i": i}, "queue": "claims"} for i in range(3)])

    claim = await store.claim_rollouts(["w1", "w2"], queue="claims")
    assert [r.rollout_id for r in claim.rollouts] == [r.rollout_id for r in queued[:2]]  # oldest first
    assert [r.attempt.worker_id for r in claim.rollouts] == ["w1", "w2"]
    assert {r.attempt.status for r in claim.rollouts} == {"running"}
    assert {r.status for r in claim.rollouts} == {"running"}
    assert [(u.resources_id, u.version) for u in claim.resources] == [(resources.resources_id, 1)]
    assert (await must_get(store, queued[0].rollout_id)).status == "running"
    worker = await store.get_worker_by_id("w1")
    assert worker is not None and worker.status == "busy"

    # Resources the caller holds at the same version stay home; a newer version comes along.
    known = {resources.resources_id: 1}
    await store.update_resources(resources.resources_id, {"prompt": template})
    claim = await store.claim_rollouts(["w3"], queue="claims", known_resources=known)
    assert [(u.resources_id, u.version) for u in claim.resources] == [(resources.resources_id, 2)]
    assert (await store.claim_rollouts(["w4"], queue="claims")).rollouts == []  # the queue is empty


async def test_claim_rollouts_refuses_no_workers_by_name(store: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="worker_ids"):
        await store.claim_rollouts([])


async def test_claim_rollouts_with_wait_wakes_when_work_is_enqueued(store: Any) -> None:
    async def enqueue_later() -> None:
        await asyncio.sleep(0.2)
        await store.enqueue_rollout({"late": True}, queue="later")

    task = asyncio.create_task(enqueue_later())
    claim = await store.claim_rollouts(["w"], wait=10, queue="later")
    await task
    assert len(claim.rollouts) == 1 and claim.rollouts[0].input == {"late": True}


async def test_add_many_spans_numbered_by_the_store_continue_the_rollouts_sequence(store: Any) -> None:
    got = await started(store)
    first = await add_auto_span(store, got.rollout_id, got.attempt.attempt_id)
    assert first is not None
    unnumbered = [make_span(got.rollout_id, got.attempt.attempt_id, 0, name=f"s{i}") for i in range(3)]
    added = await store.add_many_spans(unnumbered, number=True)
    assert [s.sequence_id for s in added] == [first.sequence_id + 1, first.sequence_id + 2, first.sequence_id + 3]
    stored = await store.query_spans(got.rollout_id)
    assert [s.name for s in stored] == ["step", "s0", "s1", "s2"]
    assert await store.get_next_span_sequence_id(got.rollout_id, got.attempt.attempt_id) == first.sequence_id + 4


async def test_finish_attempt_stores_the_last_spans_and_the_status_in_one_request(store: Any) -> None:
    got = await started(store)
    rollout_id, attempt_id = got.rollout_id, got.attempt.attempt_id
    reward = make_span(rollout_id, attempt_id, 0, name="reward")
    attempt = await store.finish_attempt(rollout_id, attempt_id, "succeeded", [reward])
    assert attempt.status == "succeeded" and attempt.end_time is not None
    assert (await must_get(store, rollout_id)).status == "succeeded"
    assert [s.name for s in await store.query_spans(rollout_id)] == ["reward"]
    # Sending it again changes nothing (the client repeats it after a lost answer).
    again = await store.finish_attempt(rollout_id, attempt_id, "succeeded", [reward])
    assert again.status == "succeeded"
    assert len(await store.query_spans(rollout_id)) == 1


async def test_finish_attempt_with_spans_revives_an_unresponsive_attempt_then_finishes_it(store: Any) -> None:
    """As `add_many_spans` then `update_attempt(status=...)` would: the late spans bring the attempt back (running,
    its heartbeat now), then the status ends it. Without spans, the store's verdict stands."""
    config = RolloutConfig(unresponsive_seconds=0.2)
    got, quiet = await started(store, config=config), await started(store, config=config)
    await asyncio.sleep(0.3)
    assert await store.run_watchdog() == 2
    before = time.time()
    answer = await store.finish_attempt(
        got.rollout_id, got.attempt.attempt_id, "succeeded", [make_span(got.rollout_id, got.attempt.attempt_id, 0)]
    )
    assert answer.status == "succeeded" and answer.last_heartbeat_time is not None
    assert answer.last_heartbeat_time >= before
    assert (await latest(store, got.rollout_id)).model_dump() == answer.model_dump()
    assert (await must_get(store, got.rollout_id)).status == "succeeded"
    kept = await store.finish_attempt(quiet.rollout_id, quiet.attempt.attempt_id, "succeeded")
    assert kept.status == "unresponsive" and (await must_get(store, quiet.rollout_id)).status == "failed"


async def test_a_claim_starts_each_attempt_running_as_update_attempt_would(store: Any) -> None:
    """A claim's attempt is created running under its worker, its rollout running and its worker busy: the state a
    dequeue then `update_attempt(status="running", worker_id=...)` leaves."""
    claimed_rollout = await store.enqueue_rollout({"n": 1}, queue="q1")
    dequeued_rollout = await store.enqueue_rollout({"n": 2}, queue="q2")
    [claimed] = (await store.claim_rollouts(["w-claim"], queue="q1")).rollouts
    dequeued = await store.dequeue_rollout(worker_id="w-deq", queue="q2")
    moved = await store.update_attempt(
        dequeued_rollout.rollout_id, dequeued.attempt.attempt_id, status="running", worker_id="w-deq"
    )
    for rollout_id, attempt, worker_id in [
        (claimed_rollout.rollout_id, claimed.attempt, "w-claim"),
        (dequeued_rollout.rollout_id, moved, "w-deq"),
    ]:
        stored = await latest(store, rollout_id)
        assert (stored.status, stored.worker_id, stored.end_time) == ("running", worker_id, None)
        assert (attempt.status, attempt.worker_id) == ("running", worker_id)
        assert (await must_get(store, rollout_id)).status == "running"
        worker = await store.get_worker_by_id(worker_id)
        assert worker is not None and worker.status == "busy" and worker.current_attempt_id == stored.attempt_id
        assert worker.last_dequeue_time is not None and worker.last_busy_time is not None
    assert claimed.status == "running"


async def test_finish_attempt_keeps_the_stores_verdict_on_an_attempt_it_moved_on(store: Any) -> None:
    got = await started(store, config=RolloutConfig(max_attempts=3, retry_condition=["timeout"]))
    rollout_id, old = got.rollout_id, got.attempt.attempt_id
    await store.update_attempt(rollout_id, old, status="timeout")  # as the watchdog would
    newer = await store.start_attempt(rollout_id)
    answer = await store.finish_attempt(rollout_id, old, "succeeded", [make_span(rollout_id, old, 0, name="late")])
    assert answer.attempt_id == old and answer.status != "succeeded"  # the runner learns it was moved on
    assert (await latest(store, rollout_id)).attempt_id == newer.attempt.attempt_id
    assert (await must_get(store, rollout_id)).status != "succeeded"
    assert [s.name for s in await store.query_spans(rollout_id, old)] == ["late"]  # the trace is kept


async def test_finish_attempt_refuses_spans_of_another_attempt_and_unknown_attempts(store: Any) -> None:
    got = await started(store)
    other = make_span(got.rollout_id, "another-attempt", 0)
    with pytest.raises(InvalidArgumentError, match="its own finish"):
        await store.finish_attempt(got.rollout_id, got.attempt.attempt_id, "succeeded", [other])
    with pytest.raises(NotFoundError):
        await store.finish_attempt(got.rollout_id, "no-such-attempt", "succeeded")
    with pytest.raises(InvalidArgumentError, match="status"):
        await store.finish_attempt(got.rollout_id, got.attempt.attempt_id, "running")


async def test_query_latest_spans_reads_many_rollouts_latest_attempts_at_once(store: Any) -> None:
    one = await started(store)
    await add_auto_span(store, one.rollout_id, one.attempt.attempt_id, name="one-first")
    retried = await store.start_attempt(one.rollout_id)
    await add_auto_span(store, one.rollout_id, retried.attempt.attempt_id, name="one-a")
    await add_auto_span(store, one.rollout_id, retried.attempt.attempt_id, name="one-b")
    waiting = await store.enqueue_rollout({"q": "never claimed"}, queue="elsewhere")

    found = await store.query_latest_spans([waiting.rollout_id, "no-such-rollout", one.rollout_id])
    assert list(found) == [waiting.rollout_id, one.rollout_id]  # the order asked; the unknown id left out
    assert found[waiting.rollout_id] == []
    assert [s.name for s in found[one.rollout_id]] == ["one-a", "one-b"]  # the latest attempt only, in order


async def test_query_latest_spans_rewards_only_leaves_out_what_holds_no_reward(store: Any) -> None:
    """A summary of rewards reads the spans that may carry one, and finds the same final reward as in all the spans:
    ours, agent-lightning 0.3's annotation, its 0.2 reward span, its primary reward on a span of another name; the
    LLM calls' spans (whole prompts and token ids) stay in the store."""
    from lightning import semconv
    from lightning.tracing import find_final_reward

    rewarded = {
        "ours": [(semconv.REWARD_SPAN, {semconv.REWARD_VALUE: 0.25})],
        "agl 0.3": [(semconv.PEER_ANNOTATION_SPAN, {semconv.PEER_PRIMARY_REWARD: 0.5})],
        "agl 0.2": [(semconv.PEER_REWARD_SPAN, {"reward": 0.75})],
        "attribute": [("judge", {semconv.PEER_PRIMARY_REWARD: 1.0})],
        "none": [],
    }
    ids = {}
    for label, reward_spans in rewarded.items():
        rollout = await started(store)
        ids[label] = rollout.rollout_id
        llm = ("openai.chat.completion", {"prompt": "what reward?", "prompt_token_ids": [1, 2, 3]})
        for name, attributes in [llm, *reward_spans, llm]:
            await add_auto_span(store, rollout.rollout_id, rollout.attempt.attempt_id, name=name, attributes=attributes)

    every = await store.query_latest_spans(list(ids.values()))
    rewards = await store.query_latest_spans(list(ids.values()), rewards_only=True)
    assert list(rewards) == list(every)
    for label, rollout_id in ids.items():
        assert [span.name for span in rewards[rollout_id]] == [name for name, _ in rewarded[label]]
        assert find_final_reward(rewards[rollout_id]) == find_final_reward(every[rollout_id])
    assert find_final_reward(rewards[ids["attribute"]]) == 1.0


async def test_concurrent_sqlite_writes_share_a_commit_and_fail_alone(tmp_path: Any) -> None:
    """Writes that queue up while the store's SQLite thread is busy run in one transaction, each in a savepoint of
    its own: one that fails midway leaves nothing behind and gets its own error; the others are committed (issue 39).
    """
    from lightning.store import SqlLightningStore

    url = f"sqlite:///{tmp_path}/store.db"
    store = SqlLightningStore(url, watchdog_interval=None)
    groups: list[int] = []
    group = store._group

    def counting(jobs: list[Any]) -> None:
        groups.append(len(jobs))
        group(jobs)

    store._group = counting  # type: ignore[method-assign]
    try:
        held = await started(store)
        rollout_id, attempt_id = held.rollout_id, held.attempt.attempt_id
        # The first span is of a known attempt and numbered first; the second names no rollout: the whole request
        # fails, and the first span's number and row must not survive it.
        failing = [make_span(rollout_id, attempt_id, 0), make_span("ro-missing", "at-missing", 0)]
        outcomes = await asyncio.gather(
            *(store.enqueue_rollout({"i": i}) for i in range(8)),
            store.add_many_spans(failing, number=True),
            store.add_many_spans([make_span(rollout_id, attempt_id, 0, name="kept")], number=True),
            return_exceptions=True,
        )
    finally:
        await store.close()
    assert isinstance(outcomes[8], NotFoundError), outcomes[8]
    assert not any(isinstance(outcome, BaseException) for i, outcome in enumerate(outcomes) if i != 8), outcomes
    assert max(groups) > 1, groups  # some of them did share a transaction

    async with SqlLightningStore(url, watchdog_interval=None) as reopened:  # what is on disk
        spans = await reopened.query_spans(rollout_id)
        assert [(span.name, span.sequence_id) for span in spans] == [("kept", 1)]
        assert await reopened.get_next_span_sequence_id(rollout_id, attempt_id) == 2
        queued = await reopened.query_rollouts(status_in=["queuing"])
        assert sorted(rollout.input["i"] for rollout in queued) == list(range(8))
