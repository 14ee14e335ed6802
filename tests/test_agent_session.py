"""The LLM resource's kept-alive session (`LLM.http_session()`): one per event loop, closed with it, and the demo
agent's calls reuse its connection instead of opening one a rollout (issue 39); a process's next rollout
phase keeps them."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from examples.copy_task.agent import copy_agent
from lightning.agent import rollout
from lightning.runner import blocking
from lightning.runner.fleet import run_fleet_until
from lightning.store import SqlLightningStore
from lightning.types import LLM

ANSWER = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "d"}, "finish_reason": "stop"}]}


@contextlib.asynccontextmanager
async def chat_server(chat: Any) -> AsyncIterator[int]:
    """An aiohttp app on 127.0.0.1 answering POST /v1/chat/completions with `chat`; its port."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


def test_one_session_per_event_loop_closed_with_it() -> None:
    llm = LLM(endpoint="http://127.0.0.1:9/v1", model="m")

    async def sessions() -> tuple[Any, Any, Any]:
        first, again = await llm.http_session(), await llm.http_session()
        other = await asyncio.to_thread(asyncio.run, llm.http_session())  # another thread's loop: its own
        return first, again, other

    first, again, other = asyncio.run(sessions())
    assert first is again and other is not first
    assert first.closed and other.closed  # each closed as its loop shut down
    assert asyncio.run(sessions())[0] is not first


async def test_a_closed_session_is_replaced() -> None:
    llm = LLM(endpoint="http://127.0.0.1:9/v1", model="m")
    first = await llm.http_session()
    await first.close()  # an agent that closed it by mistake
    second = await llm.http_session()
    assert second is not first and not second.closed


async def test_the_demo_agent_keeps_its_connection_across_rollouts() -> None:
    peers: list[Any] = []

    async def chat(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        body = await request.json()
        assert body["messages"][0]["content"] == "bdfg"
        return web.json_response(ANSWER)

    async with chat_server(chat) as port:
        llm = LLM(endpoint=f"http://127.0.0.1:{port}/v1", model="m", sampling_parameters={"max_tokens": 2})
        rewards = [await copy_agent({"letters": "bdfg", "target": "g"}, llm) for _ in range(5)]
        assert rewards == [0.0] * 5
        assert len(peers) == 5 and len(set(peers)) == 1, json.dumps(peers)


async def _slow_to_cancel() -> None:
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        await asyncio.sleep(0.3)  # a flush on the way out
        raise


@rollout
async def session_agent(task: dict[str, Any]) -> float:
    """Calls its endpoint on the LLM's kept-alive session, as the demo agent does, and leaves a task running that
    takes a while to end when cancelled (a client's background flush)."""
    session = await LLM(endpoint=task["endpoint"], model="m").http_session()
    async with session.post(f"{task['endpoint']}/chat/completions", json={"messages": []}) as response:
        await response.read()
    asyncio.get_running_loop().create_task(_slow_to_cancel())
    return 1.0


async def test_a_process_s_next_rollout_phase_reuses_the_agents_connections(tmp_path: Path) -> None:
    """Each rollout phase's fleet runs on an event loop of its own thread; the loop is kept for the process's next
    phase, and with it the agents' session and its open connections (a new loop per phase reopened them all). The
    phase ends once its loop is tidied and kept: the agents' leftover tasks here take 0.3 s to end, and a phase that
    ended before its loop was kept had the next one start on a new loop. Another fleet's loop kept in between (the
    full suite's earlier tests left theirs) does not take its place: a fleet takes back the loop it ran on."""
    peers: list[Any] = []

    async def chat(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        await asyncio.sleep(0.05)  # the fleet's agents call at once: one connection each
        return web.json_response(ANSWER)

    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db")
    try:
        async with chat_server(chat) as port:
            phases = []
            for _ in range(2):
                task = {"endpoint": f"http://127.0.0.1:{port}/v1"}
                queued = await store.enqueue_many_rollouts([{"input": task, "queue": "kept"} for _ in range(8)])
                ids = [rollout.rollout_id for rollout in queued]
                done = await run_fleet_until(
                    session_agent, store, ids, queue="kept", concurrency=4, index=0, timeout=60, blocked_after=30,
                    on_rollout_end=lambda: None,
                )  # fmt: skip
                assert done["finished"] == 8
                phases.append(set(peers))
                peers.clear()
                stray = blocking._LoopThread()  # another fleet's loop, kept after this one's
                stray.thread.name = "another-fleet"
                stray.give_back()
            first, second = phases
            assert 1 <= len(first) <= 4 and second <= first, json.dumps([sorted(map(str, p)) for p in phases])
    finally:
        await store.close()
