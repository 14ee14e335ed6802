"""The LLM resource's kept-alive session (`LLM.http_session()`): one per event loop, closed with it, and the demo
agent's calls reuse its connection instead of opening one a rollout (issue 39)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from examples.copy_task.agent import copy_agent
from lightning.types import LLM

ANSWER = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "d"}, "finish_reason": "stop"}]}


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

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        llm = LLM(endpoint=f"http://127.0.0.1:{port}/v1", model="m", sampling_parameters={"max_tokens": 2})
        rewards = [await copy_agent({"letters": "bdfg", "target": "g"}, llm) for _ in range(5)]
        assert rewards == [0.0] * 5
        assert len(peers) == 5 and len(set(peers)) == 1, json.dumps(peers)
    finally:
        await runner.cleanup()
