"""agent-lightning 0.3.0's own store client against our store server: run by the agl tests with agl's Python
(`make agl-peer`), never imported by ours. Prints one JSON line of what it saw.

    python agl_client.py walk URL             enqueue -> dequeue -> spans -> update attempt -> wait -> query
    python agl_client.py enqueue URL N        queue N rollouts for a runner; their ids
    python agl_client.py collect URL ID...    wait for them; each one's status, span names and final reward
    python agl_client.py agl-runner URL N     agl's own LitAgentRunner (OtelTracer) runs N rollouts of the store
    python agl_client.py semantics URL        what agl's store semantics say, call by call (issue 30's list)
    python agl_client.py unresponsive URL     an attempt 0.25 s past unresponsive_seconds=0.2: its status
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp
from agentlightning import PromptTemplate
from agentlightning.emitter.reward import find_final_reward
from agentlightning.store.client_server import LightningStoreClient
from agentlightning.types import AttemptedRollout, EnqueueRolloutRequest, PaginatedResult, Rollout, RolloutConfig
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def client(url: str) -> LightningStoreClient:
    # No retries: a wrong route or answer must fail here, not hide behind back-off.
    return LightningStoreClient(url, retry_delays=(), health_retry_delays=())


def otel_span(name: str, **attributes: object):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("agl-client").start_as_current_span(name) as span:
        for key, value in attributes.items():
            span.set_attribute(key, value)
    (finished,) = exporter.get_finished_spans()
    return finished


async def wait_until_finished(store: LightningStoreClient, ids: list[str], seconds: float) -> list[Rollout]:
    # agl's client takes a timeout of at most 0.1 s per call: poll, as agl's own trainer does.
    deadline = time.monotonic() + seconds
    done: list[Rollout] = []
    while time.monotonic() < deadline:
        done = await store.wait_for_rollouts(rollout_ids=ids, timeout=0.1)
        if len(done) == len(ids):
            break
        await asyncio.sleep(0.05)
    return done


async def walk(url: str) -> dict[str, object]:
    store = client(url)
    seen: dict[str, object] = {}
    resources = await store.add_resources({"prompt": PromptTemplate(template="Say {word}", engine="f-string")})
    seen["resources_id"] = resources.resources_id
    seen["latest_resources"] = (await store.get_latest_resources()).resources_id

    first = await store.enqueue_rollout(input={"word": "one"}, mode="train", resources_id=resources.resources_id)
    batch = await store.enqueue_many_rollouts(
        [EnqueueRolloutRequest(input={"word": "two"}), EnqueueRolloutRequest(input={"word": "three"}, mode="val")]
    )
    seen["enqueued"] = [first.rollout_id, *(r.rollout_id for r in batch)]

    claimed = await store.dequeue_rollout(worker_id="agl-worker")
    assert isinstance(claimed, AttemptedRollout), claimed
    seen["dequeued"] = claimed.rollout_id
    rollout_id, attempt_id = claimed.rollout_id, claimed.attempt.attempt_id
    await store.update_attempt(rollout_id, attempt_id, status="running")

    sequence_id = await store.get_next_span_sequence_id(rollout_id, attempt_id)
    stored = await store.add_otel_span(rollout_id, attempt_id, otel_span("agent.step", step=1), sequence_id)
    seen["span_stored"] = stored is not None and stored.sequence_id == sequence_id
    await store.add_otel_span(rollout_id, attempt_id, otel_span("agent.answer", answer="one"))
    await store.update_attempt(rollout_id, attempt_id, status="succeeded")

    finished = await wait_until_finished(store, [rollout_id], 10)
    seen["finished"] = [(r.rollout_id, r.status) for r in finished]

    page = await store.query_rollouts(status_in=["succeeded"])
    seen["query_rollouts"] = {"type": type(page).__name__, "ids": [r.rollout_id for r in page], "total": page.total}
    queued = await store.query_rollouts(status_in=["queuing"], limit=1)
    seen["queued_page"] = {"items": len(queued.items), "limit": queued.limit, "total": queued.total}
    spans = await store.query_spans(rollout_id, "latest")
    seen["spans"] = [span.name for span in spans]
    seen["spans_named"] = [span.name for span in await store.query_spans(rollout_id, name_contains="answer")]
    attempts = await store.query_attempts(rollout_id)
    seen["attempts"] = [(a.attempt_id, a.status, a.worker_id) for a in attempts]
    seen["latest_attempt"] = (await store.get_latest_attempt(rollout_id)).attempt_id
    got = await store.get_rollout_by_id(rollout_id)
    seen["get_rollout_by_id"] = {
        "type": type(got).__name__,
        "attempt_id": getattr(got, "attempt", None) and got.attempt.attempt_id,
    }
    seen["unknown_rollout"] = await store.get_rollout_by_id("ro-nothing-here")
    seen["statistics"] = {k: v for k, v in (await store.statistics()).items() if k.startswith("total_")}
    workers = await store.query_workers()
    seen["workers"] = [w.worker_id for w in workers]
    seen["paginated"] = isinstance(page, PaginatedResult)
    await store.close()
    return seen


async def enqueue(url: str, count: int) -> dict[str, object]:
    store = client(url)
    rollouts = await store.enqueue_many_rollouts(
        [EnqueueRolloutRequest(input={"word": f"w{i}"}, mode="train") for i in range(count)]
    )
    await store.close()
    return {"ids": [r.rollout_id for r in rollouts]}


async def collect(url: str, ids: list[str]) -> dict[str, object]:
    store = client(url)
    finished = await wait_until_finished(store, ids, 60)
    result = {}
    for rollout in finished:
        spans = await store.query_spans(rollout.rollout_id, "latest")
        result[rollout.rollout_id] = {
            "status": rollout.status,
            "spans": [span.name for span in spans],
            "reward": find_final_reward(list(spans)),
        }
    await store.close()
    return result


async def agl_runner(url: str, count: int) -> dict[str, object]:
    import agentlightning as agl
    from agentlightning.runner import LitAgentRunner
    from agentlightning.tracer import OtelTracer

    @agl.rollout
    def says_the_word(task: dict, prompt_template: agl.PromptTemplate) -> float:
        # An agl 0.3 agent as its docs write one: the prompt resource in, the reward out (a bool, as agl allows).
        return prompt_template.format(**task).endswith(task["word"])

    store = client(url)
    runner = LitAgentRunner(OtelTracer(), max_rollouts=count, poll_interval=0.2, heartbeat_interval=1.0)
    runner.init(says_the_word)
    runner.init_worker(0, store)
    try:
        await asyncio.wait_for(runner.iter(), timeout=90)
    finally:
        runner.teardown_worker(0)
        runner.teardown()
        await store.close()
    return {"ran": count}


async def status_of(call: object) -> object:
    """What the server answered a call: "ok", or the HTTP status of its refusal."""
    try:
        await call  # type: ignore[misc]
    except aiohttp.ClientResponseError as exc:
        return exc.status
    return "ok"


async def semantics(url: str) -> dict[str, object]:
    store = client(url)
    seen: dict[str, object] = {}
    started = await store.start_rollout(input={"x": 1})
    rid, aid = started.rollout_id, started.attempt.attempt_id
    # An explicit null is refused where agl refuses it (left out, the field keeps its value).
    null_config = store._request_json("post", f"/rollouts/{rid}", json={"config": None})
    seen["null"] = {
        "update_worker.heartbeat_stats": await status_of(store.update_worker("w-null", heartbeat_stats=None)),
        "update_attempt.worker_id": await status_of(store.update_attempt(rid, aid, worker_id=None)),
        "update_attempt.last_heartbeat_time": await status_of(store.update_attempt(rid, aid, last_heartbeat_time=None)),
        "update_attempt.metadata": await status_of(store.update_attempt(rid, aid, metadata=None)),
        "update_rollout.status": await status_of(store.update_rollout(rid, status=None)),
        # (agl's client cannot send this one: it calls config.model_dump() first)
        "update_rollout.config": await status_of(null_config),
        "update_rollout.mode": await status_of(store.update_rollout(rid, mode=None)),
    }
    # Span numbers are the rollout's: "latest" and an attempt id the store never made both number.
    seen["next_span"] = [
        await store.get_next_span_sequence_id(rid, aid),
        await store.get_next_span_sequence_id(rid, "latest"),
        await store.get_next_span_sequence_id(rid, "at-unknown"),
    ]
    # A worker handed a newer attempt moves to it.
    await store.enqueue_rollout(input={"x": 2})
    first = await store.dequeue_rollout(worker_id="W")
    second = await store.start_attempt(first.rollout_id)
    await store.update_attempt(first.rollout_id, second.attempt.attempt_id, worker_id="W")
    worker = await store.get_worker_by_id("W")
    seen["worker_moved"] = (worker.status, worker.current_attempt_id == second.attempt.attempt_id)
    # A resources id with nothing stored under it (yet) is kept as given.
    seen["resources_id_kept"] = [
        (await store.enqueue_rollout(input={"x": 3}, resources_id="rs-later")).resources_id,
        (await store.start_rollout(input={"x": 4}, resources_id="rs-later")).resources_id,
    ]
    added = await store.add_resources({"p": PromptTemplate(template="Say {word}", engine="f-string")})
    seen["resources_id_length"] = len(added.resources_id)
    # NULL sorts first ascending, last descending.
    by_mode = [
        (await store.enqueue_rollout(input={"m": mode}, mode=mode)).rollout_id for mode in ("train", None, "val")
    ]
    ascending = await store.query_rollouts(rollout_id_in=by_mode, sort_by="mode")
    descending = await store.query_rollouts(rollout_id_in=by_mode, sort_by="mode", sort_order="desc")
    seen["null_first"] = [by_mode.index(r.rollout_id) for r in ascending] == [1, 0, 2]
    seen["null_last"] = [by_mode.index(r.rollout_id) for r in descending] == [2, 0, 1]
    # Bad query arguments: 400, as agl's server answers them; a body of the wrong shape: 422, as FastAPI's.
    seen["bad_sort_by"] = await status_of(store.query_rollouts(sort_by="nonexistent"))
    seen["bad_limit"] = await status_of(store.query_rollouts(limit=0))
    seen["missing_field"] = await status_of(store._request_json("post", "/queues/rollouts/enqueue", json={}))
    await store.close()
    return seen


async def unresponsive(url: str) -> dict[str, object]:
    store = client(url)
    await store.enqueue_rollout(input={"x": 1}, config=RolloutConfig(unresponsive_seconds=0.2))
    claimed = await store.dequeue_rollout(worker_id="quiet")
    await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="running")
    await asyncio.sleep(0.45)
    attempt = await store.get_latest_attempt(claimed.rollout_id)
    await store.close()
    return {"status": attempt.status}


def main() -> None:
    command, url, *rest = sys.argv[1:]
    if command == "walk":
        seen = asyncio.run(walk(url))
    elif command == "agl-runner":
        seen = asyncio.run(agl_runner(url, int(rest[0])))
    elif command == "semantics":
        seen = asyncio.run(semantics(url))
    elif command == "unresponsive":
        seen = asyncio.run(unresponsive(url))
    elif command == "enqueue":
        seen = asyncio.run(enqueue(url, int(rest[0])))
    else:
        seen = asyncio.run(collect(url, rest))
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
