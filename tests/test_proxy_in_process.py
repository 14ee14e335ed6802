"""The LLM proxy's in-process backend (`lightning.proxy.local`): its calls go to an ASGI app of the proxy's own
process, as they would over HTTP. The backends' URLs here point where nothing listens, so an answer can only come
from the app in the process. The proxy itself is served over real HTTP on 127.0.0.1, with a SQLite store."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.requests import Request
from support.fixed_backend import ANSWER, ANSWER_IDS, PROMPT_IDS, FixedBackend
from support.proxy_calls import MESSAGES, attempt_llm, client, running, token_ids
from support.servers import free_port

from lightning import semconv
from lightning.proxy import LLMProxy
from lightning.proxy.local import InProcessSession
from lightning.serving import BearerAuth, BodyLimit, ours_outermost, past_guards
from lightning.store import SqlLightningStore
from lightning.types import Span


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqlLightningStore]:
    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    yield store
    await store.close()


def nowhere() -> str:
    return f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there


async def spans_of(store: SqlLightningStore, rollout_id: str) -> list[Span]:
    for _ in range(100):
        spans = await store.query_spans(rollout_id)
        if spans:
            return spans
        await asyncio.sleep(0.05)
    return []


async def test_a_chat_call_reaches_the_app_in_the_process_and_is_stored_with_its_token_ids(
    store: SqlLightningStore,
) -> None:
    backend, url = FixedBackend(), nowhere()
    with running(LLMProxy(store, [url], in_process={url: backend})) as proxy:
        rollout, llm = await attempt_llm(store, proxy)
        response = await client(llm).chat.completions.create(model="policy", messages=MESSAGES, temperature=0.5)
        [span] = await store.query_spans(rollout.rollout_id)
    assert response.choices[0].message.content == "".join(ANSWER)
    assert backend.requests == [
        {"model": "policy", "messages": MESSAGES, "temperature": 0.5, "return_token_ids": True, "logprobs": True}
    ]
    assert span.status.status_code == "OK" and token_ids(span) == (PROMPT_IDS, [ANSWER_IDS])
    assert span.attributes[semconv.LLM_BACKEND] == url and span.attributes[semconv.LLM_TRIES] == 1


async def test_a_stream_passes_through_as_the_app_sent_it_and_is_stored(store: SqlLightningStore) -> None:
    backend, url = FixedBackend(), nowhere()
    with running(LLMProxy(store, [url], in_process={url: backend})) as proxy:
        rollout, llm = await attempt_llm(store, proxy)
        stream = await client(llm).chat.completions.create(model="policy", messages=MESSAGES, stream=True)
        texts = [chunk.choices[0].delta.content async for chunk in stream]
        [span] = await store.query_spans(rollout.rollout_id)
        body = {"model": "policy", "messages": MESSAGES, "stream": True, "return_token_ids": True, "logprobs": True}
        async with httpx.AsyncClient() as http:
            proxied = await http.post(f"{llm.endpoint}/chat/completions", json=body)
    direct = await InProcessSession(backend, timeout=10).post(
        f"{url}/chat/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    assert texts == ANSWER
    assert proxied.content == await direct.read()
    assert span.attributes[semconv.LLM_STREAM] is True and token_ids(span) == (PROMPT_IDS, [ANSWER_IDS])


async def test_a_stream_the_agent_abandons_stops_the_app_and_is_stored_as_far_as_it_went(
    store: SqlLightningStore,
) -> None:
    backend, url = FixedBackend(), nowhere()
    backend.stream_delay = 0.2
    proxy = LLMProxy(store, [url], in_process={url: backend})
    with running(proxy):
        rollout, llm = await attempt_llm(store, proxy)
        stream = await client(llm).chat.completions.create(model="policy", messages=MESSAGES, stream=True)
        first = await stream.__anext__()
        await stream.close()
        [span] = await spans_of(store, rollout.rollout_id)
        session = proxy._local[url]
        for _ in range(100):  # the app's call is cancelled once the proxy releases its answer
            if not session._tasks:
                break
            await asyncio.sleep(0.05)
        assert not session._tasks
    assert first.choices[0].delta.content == ANSWER[0]
    assert span.status.status_code == "ERROR" and "stopped reading" in (span.status.description or "")
    prompt, [response] = token_ids(span)
    assert prompt == PROMPT_IDS and response == ANSWER_IDS[: len(response)] and 1 <= len(response) < len(ANSWER_IDS)


class Failing:
    """An app that raises before it answers (`at="start"`) or after its first bytes (`at="body"`)."""

    def __init__(self, at: str) -> None:
        self.at = at
        self.calls = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["method"] == "GET":  # the proxy asks GET /v1/models what it serves: nothing listed
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        self.calls += 1
        if self.at == "body":
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b'{"id": ', "more_body": True})
        raise RuntimeError("the app broke")


async def test_an_app_that_raises_is_a_500_before_its_answer_and_a_broken_body_after(
    store: SqlLightningStore, caplog: pytest.LogCaptureFixture
) -> None:
    """As uvicorn serves a failing app: a 500 (and the error in the log) when nothing was sent yet, which the proxy
    tries on its other backends and then passes on; a body that breaks off once the answer has begun."""
    failing, url = Failing("start"), nowhere()
    with running(LLMProxy(store, [url], in_process={url: failing}, retry_backoff=0.01)) as proxy:
        rollout, llm = await attempt_llm(store, proxy)
        with pytest.raises(openai.InternalServerError) as raised:
            await client(llm).chat.completions.create(model="policy", messages=MESSAGES)
        [span] = await store.query_spans(rollout.rollout_id)
    assert raised.value.status_code == 500 and failing.calls == 3  # the proxy's max_tries
    assert span.status.status_code == "ERROR" and "HTTP 500" in (span.status.description or "")
    assert "the in-process inference server failed on POST /v1/chat/completions" in caplog.text

    broken = await InProcessSession(Failing("body"), timeout=10).post(f"{url}/chat/completions", data=b"{}", headers={})
    assert broken.status == 200
    with pytest.raises(Exception, match="the response broke off"):
        await broken.read()


class Slow:
    """An app that answers after `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.cancelled = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


async def test_a_call_past_its_timeout_raises_as_aiohttp_s_would_and_stops_the_app() -> None:
    slow = Slow(30.0)
    session = InProcessSession(slow, timeout=0.2)
    with pytest.raises(TimeoutError):
        await session.post(f"{nowhere()}/chat/completions", data=b"{}", headers={})
    await asyncio.sleep(0.05)  # the cancelled call's task ends, and its done-callback runs
    assert slow.cancelled == 1 and not session._tasks
    quick = await InProcessSession(Slow(0.0), timeout=30).post(f"{nowhere()}/chat/completions", data=b"{}", headers={})
    assert quick.status == 200 and await quick.json() == {}


def test_the_stack_refuses_to_serve_the_proxy_without_its_store_or_beyond_loopback_without_a_token(
    tmp_path: Path,
) -> None:
    """`python -m lightning.stack` (a run's `inference.with_proxy`): refused in the seconds of its imports, before
    any model loads."""
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", "lightning.stack", "--model", str(tmp_path / "none"), "--proxy-port", "9"]
    env = {k: v for k, v in os.environ.items() if k not in ("LIGHTNING_STORE_URL", "LIGHTNING_PROXY_TOKEN")}
    no_store = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert no_store.returncode == 2
    assert "the proxy stores its spans in the store at $LIGHTNING_STORE_URL; set it" in no_store.stderr
    env["LIGHTNING_STORE_URL"] = f"sqlite:///{tmp_path}/store.db"
    exposed = subprocess.run(
        [*command, "--host", "0.0.0.0", "--api-key", "k"], env=env, capture_output=True, text=True, timeout=120
    )
    assert exposed.returncode == 2
    assert "--proxy-port on 0.0.0.0: give the proxy a token in $LIGHTNING_PROXY_TOKEN" in exposed.stderr


async def test_the_process_own_calls_go_past_the_token_and_the_body_limit_and_others_do_not() -> None:
    """`past_guards`: what the proxy hands the inference server of its process enters below the server's bearer
    token and body limit (the caller is the process itself); over HTTP both still guard every call."""
    app = ours_outermost(FastAPI())

    @app.post("/v1/echo")
    async def echo(request: Request) -> dict[str, Any]:
        return {"bytes": len(await request.body()), "app": request.app is app}

    app.add_middleware(BodyLimit, max_bytes=10, refusal=lambda message: JSONResponse({}, 413), setting="--max-body")
    app.add_middleware(BearerAuth, token="secret", refusal=lambda: JSONResponse({}, 401))
    body = json.dumps({"text": "x" * 100})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
        assert (await http.post("/v1/echo", content=body)).status_code == 401
        guarded = await http.post("/v1/echo", content=body, headers={"authorization": "Bearer secret"})
        assert guarded.status_code == 413
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=past_guards(app)), base_url="http://app") as http:
        answer = await http.post("/v1/echo", content=body)
    assert answer.status_code == 200 and answer.json() == {"bytes": len(body), "app": True}


async def test_a_hot_route_is_called_directly_and_answers_as_the_app_would(caplog: pytest.LogCaptureFixture) -> None:
    """A hot route of the in-process app (every chat completion of a rollout) is awaited directly, its answer handed
    back whole: as the app over ASGI answers, its errors (the mapped ones as their response, others a 500), a stream,
    a call past its timeout (the handler stopped)."""
    import re

    from starlette.responses import StreamingResponse

    from lightning.inference.server import OpenAIError
    from lightning.serving import HotRoutes

    stopped: list[str] = []

    async def hot(request: Request, match: re.Match[str]) -> Any:
        what = json.loads(await request.body())["what"]
        if what == "answer":
            return JSONResponse({"path": match.group(0), "app": request.app is app}, headers={"x-hot": "yes"})
        if what == "refuse":
            raise OpenAIError(400, "refused", "what")
        if what == "stream":
            return StreamingResponse(iter([b"data: 1\n\n", b"data: [DONE]\n\n"]), media_type="text/event-stream")
        if what == "slow":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                stopped.append(what)
                raise
        raise (TimeoutError if what == "own timeout" else RuntimeError)("the handler failed")

    app = ours_outermost(FastAPI())
    app.add_middleware(HotRoutes, routes=[(re.compile("/v1/hot"), hot)], errors={OpenAIError: OpenAIError.response})
    app.add_middleware(BodyLimit, max_bytes=1000, refusal=lambda message: JSONResponse({}, 413), setting="--max-body")
    session = InProcessSession(past_guards(app), timeout=3.0)  # a loaded machine's calls too; only `slow` passes it
    url = f"{nowhere()}/hot"

    async def call(what: str) -> tuple[int, str, bytes]:
        response = await session.post(url, data=json.dumps({"what": what}).encode(), headers={})
        try:
            return response.status, response.headers.get("content-type", ""), await response.read()
        finally:
            response.release()

    status, media, body = await call("answer")
    assert (status, media, json.loads(body)) == (200, "application/json", {"path": "/v1/hot", "app": True})
    status, _, body = await call("refuse")
    assert status == 400 and json.loads(body)["error"]["message"] == "refused"
    assert await call("stream") == (200, "text/event-stream; charset=utf-8", b"data: 1\n\ndata: [DONE]\n\n")
    for failing in ("fail", "own timeout"):
        assert await call(failing) == (500, "text/plain; charset=utf-8", b"Internal Server Error")
    assert caplog.text.count("the in-process inference server failed on POST /v1/hot") == 2
    with pytest.raises(TimeoutError, match="took over 3 s"):
        await call("slow")
    assert stopped == ["slow"] and not session._tasks
