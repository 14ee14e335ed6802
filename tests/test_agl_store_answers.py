"""Rollout ids a store does not know, reached through agent-lightning's names: `InMemoryLightningStore`,
`LightningStoreClient` and the store `Trainer` hands an agl `Algorithm` answer as agl's stores do (`query_spans`: an
empty page; `wait_for_rollouts`: the ids left out), where our own `SqlLightningStore` / `HttpLightningStore` raise
`NotFoundError` (agl's tests test_query_empty_spans, test_wait_for_nonexistent_rollout,
test_wait_mixed_existing_and_nonexistent_rollouts)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from support.servers import serving

import lightning as agl
from lightning.store import InMemoryLightningStore, LightningStoreClient, NotFoundError, open_store
from lightning.store.client import HttpLightningStore
from lightning.store.memory import AglSqlLightningStore
from lightning.store.server import create_app


async def check_agl_answers(store: Any) -> None:
    known = await store.enqueue_rollout({"x": 1})
    await store.update_rollout(known.rollout_id, status="succeeded")
    for attempt_id in (None, "latest", "at-nope"):
        spans = await store.query_spans("ro-nope", attempt_id)
        assert (list(spans), spans.total) == ([], 0)
    started = time.monotonic()
    assert await store.wait_for_rollouts(rollout_ids=["ro-nope"], timeout=0.1) == []
    assert time.monotonic() - started < 2
    assert await store.wait_for_rollouts(rollout_ids=["ro-nope"], timeout=None) == []  # none known: at once
    mixed = await store.wait_for_rollouts(rollout_ids=[known.rollout_id, "ro-nope"], timeout=0.1)
    assert [r.rollout_id for r in mixed] == [known.rollout_id]
    with pytest.raises(NotFoundError):  # the other methods keep our answer
        await store.update_rollout("ro-nope", status="failed")


async def check_our_answers(store: Any) -> None:
    with pytest.raises(NotFoundError, match="ro-nope"):
        await store.query_spans("ro-nope")
    with pytest.raises(NotFoundError, match="ro-nope"):
        await store.wait_for_rollouts(rollout_ids=["ro-nope"], timeout=0.1)


async def test_the_in_memory_store_answers_unknown_ids_as_agl_s(tmp_path: Path) -> None:
    async with InMemoryLightningStore(thread_safe=True, watchdog_interval=None) as memory:
        await check_agl_answers(memory)
    async with open_store(f"sqlite:///{tmp_path}/ours.db", watchdog_interval=None) as ours:
        await check_our_answers(ours)
    with pytest.raises(ValueError, match="keeps every span"):
        InMemoryLightningStore(eviction_memory_threshold=0.9)


async def test_agl_s_client_name_answers_unknown_ids_as_agl_s_and_ours_does_not(tmp_path: Path) -> None:
    served = agl.SqlLightningStore(f"sqlite:///{tmp_path}/served.db", watchdog_interval=None, threaded=False)
    with serving(create_app(served)) as url:
        client = LightningStoreClient(url, retry_delays=(), request_timeout=5.0)
        await check_agl_answers(client)
        await client.close()
        ours = HttpLightningStore(url, retries=0)
        await check_our_answers(ours)
        await ours.close()
    await served.close()


def test_the_store_an_agl_algorithm_is_given_answers_unknown_ids_as_agl_s(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    @agl.algo
    async def probe(*, store: agl.LightningStore) -> None:
        seen["store"] = type(store)
        seen["spans"] = list(await store.query_spans("ro-nope"))
        seen["waited"] = await store.wait_for_rollouts(rollout_ids=["ro-nope"], timeout=0.01)

    @agl.rollout
    def unused(task: Any) -> float:
        return 0.0

    agl.Trainer(n_runners=1, algorithm=probe).fit(unused)
    assert seen == {"store": InMemoryLightningStore, "spans": [], "waited": []}
    # With store= (a URL), the same answers: the store is opened with open_store(url, agl_answers=True).
    by_url = open_store(f"sqlite:///{tmp_path}/algo.db", agl_answers=True, watchdog_interval=None)
    assert isinstance(by_url, AglSqlLightningStore)
    asyncio.run(by_url.close())
    assert isinstance(open_store("http://127.0.0.1:9", agl_answers=True), LightningStoreClient)


async def test_agl_s_store_server_object_serves_a_store_from_this_process() -> None:
    """agl's `LightningStoreServer(store, host, port)` with `start()` / `stop()` (examples/minimal/llm_proxy.py's form),
    reached by a client at `endpoint`; the server object is a store too, and `LightningStoreThreaded` the store."""
    from support.servers import free_port

    store = agl.InMemoryLightningStore(watchdog_interval=None)
    assert agl.LightningStoreThreaded(store) is store
    server = agl.LightningStoreServer(store, "127.0.0.1", free_port())
    await server.start()
    try:
        client = LightningStoreClient(server.endpoint, retry_delays=(), request_timeout=5.0)
        queued = await client.enqueue_rollout({"x": 1})
        assert [r.rollout_id for r in await server.query_rollouts()] == [queued.rollout_id]  # the same store
        assert (await client.statistics())["total_rollouts"] == 1
        assert client.capabilities["otlp_traces"] and client.otlp_traces_endpoint() == f"{server.endpoint}/v1/traces"
        await client.close()
    finally:
        await server.stop()
    assert store.capabilities == {"thread_safe": True, "async_safe": True, "zero_copy": True, "otlp_traces": False}
    with pytest.raises(ValueError, match="without a token"):
        agl.LightningStoreServer(store, "0.0.0.0", 4747)
    with pytest.raises(ValueError, match="lightning store serve"):
        agl.LightningStoreServer(store, launch_mode="mp")
    await store.close()
