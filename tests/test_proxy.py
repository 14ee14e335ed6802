"""The LLM proxy over real HTTP on 127.0.0.1: a SQLite store, the proxy on its own thread, and fast
OpenAI-shaped backends (tests/support/fixed_backend.py) called with the OpenAI SDK."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.fixed_backend import ANSWER, ANSWER_IDS, ANSWER_LOGPROBS, PROMPT_IDS, FixedBackend
from support.proxy_calls import MESSAGES, attempt_llm, client, running, token_ids
from support.servers import free_port, serving

from lightning import semconv
from lightning.agent import LitAgent
from lightning.errors import ConfigError
from lightning.proxy import Backend, ExternalModel, LLMProxy
from lightning.runner import Runner
from lightning.seeding import turn_seed
from lightning.store import SqlLightningStore
from lightning.types import LLM, AttemptedRollout, ProxyLLM, Span


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqlLightningStore]:
    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    yield store
    await store.close()


@contextlib.contextmanager
def backends(count: int = 1) -> Iterator[list[tuple[FixedBackend, str]]]:
    with contextlib.ExitStack() as stack:
        apps = [FixedBackend() for _ in range(count)]
        yield [(app, stack.enter_context(serving(app)) + "/v1") for app in apps]


def logprobs(span: Span) -> list[list[float]]:
    return [semconv.decode_logprobs(s) for s in span.attributes[semconv.LLM_RESPONSE_LOGPROBS]]


async def test_a_chat_call_is_forwarded_with_token_ids_on_and_stored_as_one_span(store: SqlLightningStore) -> None:
    with backends() as [(backend, url)], running(LLMProxy(store, [url], model_name="policy")) as proxy:
        rollout, llm = await attempt_llm(store, proxy)
        assert llm.endpoint == f"{proxy.url}/rollout/{rollout.rollout_id}/attempt/{rollout.attempt.attempt_id}/v1"
        response = await client(llm).chat.completions.create(model="policy", messages=MESSAGES, temperature=0.5)
        # The span is in the store when the agent gets its answer: no waiting.
        [span] = await store.query_spans(rollout.rollout_id)

    assert response.choices[0].message.content == "".join(ANSWER)
    assert backend.requests == [
        {"model": "policy", "messages": MESSAGES, "temperature": 0.5, "return_token_ids": True, "logprobs": True}
    ]
    assert span.attempt_id == rollout.attempt.attempt_id and span.name == "chat policy"
    assert span.status.status_code == "OK"
    assert token_ids(span) == (PROMPT_IDS, [ANSWER_IDS])
    assert logprobs(span) == [ANSWER_LOGPROBS]
    attrs = span.attributes
    assert attrs[semconv.GEN_AI_OPERATION] == "chat"
    assert attrs[semconv.GEN_AI_REQUEST_MODEL] == "policy"
    assert attrs[semconv.GEN_AI_REQUEST_PREFIX + "temperature"] == 0.5
    assert attrs[semconv.GEN_AI_INPUT_TOKENS] == len(PROMPT_IDS)
    assert attrs[semconv.GEN_AI_OUTPUT_TOKENS] == len(ANSWER_IDS)
    assert attrs[semconv.GEN_AI_FINISH_REASONS] == ["stop"]
    assert json.loads(attrs[semconv.GEN_AI_INPUT_MESSAGES]) == MESSAGES
    assert json.loads(attrs[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == "".join(ANSWER)
    assert attrs[semconv.LLM_BACKEND] == url and attrs[semconv.LLM_TRIES] == 1
    assert attrs[semconv.LLM_LATENCY_MS] > 0


@pytest.mark.parametrize("operation", ["chat", "text_completion"])
async def test_a_stream_passes_through_unchanged_and_its_token_ids_are_stored(
    store: SqlLightningStore, operation: str
) -> None:
    with backends() as [(_, url)], running(LLMProxy(store, [url])) as proxy:
        rollout, llm = await attempt_llm(store, proxy)
        if operation == "chat":
            stream = await client(llm).chat.completions.create(model="policy", messages=MESSAGES, stream=True)
            texts = [chunk.choices[0].delta.content async for chunk in stream]
        else:
            stream = await client(llm).completions.create(model="policy", prompt="2+2=", stream=True)
            texts = [chunk.choices[0].text async for chunk in stream]
        [span] = await store.query_spans(rollout.rollout_id)
        # The same call through the proxy, raw: the bytes the agent reads are the backend's bytes.
        path = "chat/completions" if operation == "chat" else "completions"
        body = {"model": "policy", "stream": True, "return_token_ids": True, "logprobs": operation == "chat" or 0}
        body.update({"messages": MESSAGES} if operation == "chat" else {"prompt": "2+2="})
        async with httpx.AsyncClient() as http:
            direct = await http.post(f"{url}/{path}", json=body)
            proxied = await http.post(f"{llm.endpoint}/{path}", json=body)

    assert texts == ANSWER
    assert proxied.content == direct.content
    assert span.attributes[semconv.LLM_STREAM] is True
    assert token_ids(span) == (PROMPT_IDS, [ANSWER_IDS])
    assert logprobs(span) == [ANSWER_LOGPROBS]
    assert json.loads(span.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == "".join(ANSWER)
    assert span.attributes[semconv.LLM_TIME_TO_FIRST_CHUNK_MS] > 0


async def test_a_stream_the_agent_abandons_is_still_stored_as_far_as_it_went(store: SqlLightningStore) -> None:
    with backends() as [(backend, url)], running(LLMProxy(store, [url])) as proxy:
        backend.stream_delay = 0.2
        rollout, llm = await attempt_llm(store, proxy)
        stream = await client(llm).chat.completions.create(model="policy", messages=MESSAGES, stream=True)
        first = await stream.__anext__()
        await stream.close()
        for _ in range(100):
            spans = await store.query_spans(rollout.rollout_id)
            if spans:
                break
            await asyncio.sleep(0.05)
    assert first.choices[0].delta.content == ANSWER[0]
    [span] = spans
    assert span.status.status_code == "ERROR" and "stopped reading" in (span.status.description or "")
    prompt, [response] = token_ids(span)
    assert prompt == PROMPT_IDS and response == ANSWER_IDS[: len(response)] and 1 <= len(response) < len(ANSWER_IDS)


async def test_completions_read_prompt_token_ids_from_the_choice(store: SqlLightningStore) -> None:
    with backends() as [(_, url)], running(LLMProxy(store, [url])) as proxy:
        rollout, llm = await attempt_llm(store, proxy)
        response = await client(llm).completions.create(model="policy", prompt="2+2=", max_tokens=5)
        [span] = await store.query_spans(rollout.rollout_id)
    assert response.choices[0].text == "".join(ANSWER)
    assert span.name == "text_completion policy"
    assert token_ids(span) == (PROMPT_IDS, [ANSWER_IDS])
    assert logprobs(span) == [ANSWER_LOGPROBS]
    assert json.loads(span.attributes[semconv.GEN_AI_INPUT_MESSAGES]) == "2+2="


async def test_a_backend_without_token_ids_is_not_asked_for_them(store: SqlLightningStore) -> None:
    with backends() as [(backend, url)], running(LLMProxy(store, [Backend(url=url, token_ids=False)])) as proxy:
        rollout, llm = await attempt_llm(store, proxy)
        await client(llm).chat.completions.create(model="policy", messages=MESSAGES)
        [span] = await store.query_spans(rollout.rollout_id)
    assert "return_token_ids" not in backend.requests[0] and "logprobs" not in backend.requests[0]
    assert semconv.LLM_PROMPT_TOKEN_IDS not in span.attributes
    assert semconv.LLM_RESPONSE_TOKEN_IDS not in span.attributes


async def test_the_model_name_is_rewritten_for_backends_that_serve_another_name(store: SqlLightningStore) -> None:
    with backends() as [(backend, url)], running(LLMProxy(store, [Backend(url=url, model="/ckpt/step-3")])) as proxy:
        _, llm = await attempt_llm(store, proxy)
        await client(llm).chat.completions.create(model="policy", messages=MESSAGES)
    assert backend.requests[0]["model"] == "/ckpt/step-3"


async def test_connection_errors_and_5xx_move_on_to_the_next_backend(store: SqlLightningStore) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    with backends(2) as [(first, first_url), (second, second_url)]:
        proxy = LLMProxy(store, [dead, first_url, second_url], retry_backoff=0.01)
        with running(proxy):
            rollout, llm = await attempt_llm(store, proxy)
            first.fail_next = 1
            response = await client(llm).chat.completions.create(model="policy", messages=MESSAGES)
            [span] = await store.query_spans(rollout.rollout_id)
            # The rollout now sticks to the backend that answered.
            await client(llm).chat.completions.create(model="policy", messages=MESSAGES)
            first.fail_next = second.fail_next = 10
            with pytest.raises(openai.InternalServerError) as failed:
                await client(llm).chat.completions.create(model="policy", messages=MESSAGES)
    assert response.choices[0].message.content == "".join(ANSWER)
    assert span.attributes[semconv.LLM_TRIES] == 3
    assert span.attributes[semconv.LLM_BACKEND] == second_url
    assert len(first.requests) == 2 and len(second.requests) == 3
    # The dead backend refused a connection, so it now goes last: after two 500s it refuses again, and the proxy
    # answers 502 naming it.
    assert failed.value.status_code == 502


async def test_a_rollout_sticks_to_one_backend_and_rollouts_spread(store: SqlLightningStore) -> None:
    with backends(2) as [(first, first_url), (second, second_url)]:
        proxy = LLMProxy(store, [first_url, second_url])
        with running(proxy):
            for _ in range(4):
                rollout, llm = await attempt_llm(store, proxy)
                for _ in range(3):
                    await client(llm).chat.completions.create(
                        model="policy", messages=MESSAGES, user=rollout.rollout_id
                    )
    by_rollout: dict[str, set[int]] = {}
    for which, backend in enumerate((first, second)):
        for request in backend.requests:
            by_rollout.setdefault(request["user"], set()).add(which)
    assert all(len(used) == 1 for used in by_rollout.values())
    assert len(first.requests) == len(second.requests) == 6


async def test_pause_drains_calls_in_flight_and_holds_new_ones_until_resume(store: SqlLightningStore) -> None:
    with backends() as [(backend, url)], running(LLMProxy(store, [url])) as proxy:
        backend.stream_delay = 0.1  # a stream of 5 chunks takes 0.5 s
        rollout, llm = await attempt_llm(store, proxy)

        async def streamed() -> str:
            stream = await client(llm).chat.completions.create(model="policy", messages=MESSAGES, stream=True)
            return "".join([chunk.choices[0].delta.content async for chunk in stream])

        in_flight = asyncio.create_task(streamed())
        for _ in range(200):  # until the stream is in flight through the proxy (not a fixed sleep: CI is slow)
            if proxy.status()["in_flight"] == 1:
                break
            await asyncio.sleep(0.01)
        drained = await asyncio.to_thread(proxy.pause_sync, 5.0)
        # pause returned only after the proxy sent the stream's last byte: nothing is in flight any more,
        # and the agent's read ends without the proxy (the client task just needs its turn on this loop).
        assert drained == 1 and proxy.status()["in_flight"] == 0
        await asyncio.wait_for(asyncio.shield(in_flight), 2)
        held = asyncio.create_task(client(llm).chat.completions.create(model="policy", messages=MESSAGES))
        await asyncio.sleep(0.3)
        assert not held.done() and len(backend.requests) == 1
        await asyncio.to_thread(proxy.resume_sync, 7)
        await held
        spans = await store.query_spans(rollout.rollout_id)
        async with httpx.AsyncClient() as http:
            status = (await http.get(f"{proxy.url}/admin/status")).json()
    assert await in_flight == "".join(ANSWER)
    assert [s.attributes.get(semconv.LLM_WEIGHT_VERSION) for s in spans] == [None, 7]
    assert status["paused"] is False and status["in_flight"] == 0 and status["spans_written"] == 2


async def test_admin_routes_pause_and_resume_over_http(store: SqlLightningStore) -> None:
    with backends() as [(_, url)], running(LLMProxy(store, [url])) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            assert (await http.post("/admin/pause")).json() == {"paused": True, "drained": 0}
            assert (await http.get("/admin/status")).json()["paused"] is True
            resumed = await http.post("/admin/resume", json={"weight_version": "step-2"})
            assert resumed.json() == {"paused": False, "weight_version": "step-2", "adapter": None}
            replaced = await http.put("/admin/backends", json=[{"url": url}, {"url": url, "token_ids": False}])
            assert replaced.json() == {"backends": [url, url]}


async def test_a_token_is_required_when_set_and_the_agent_gets_it_as_its_api_key(store: SqlLightningStore) -> None:
    with (
        backends() as [(backend, url)],
        running(LLMProxy(store, [Backend(url=url, api_key="backend-key")], token="s3cret")) as proxy,
    ):
        rollout, llm = await attempt_llm(store, proxy)
        assert llm.api_key == "s3cret"
        await client(llm).chat.completions.create(model="policy", messages=MESSAGES)
        async with httpx.AsyncClient() as http:
            refused = await http.post(
                f"{llm.endpoint}/chat/completions", json={"model": "policy", "messages": MESSAGES}
            )
            health = await http.get(f"{proxy.url}/health")
        [span] = await store.query_spans(rollout.rollout_id)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "AuthenticationError"
    assert health.status_code == 200
    assert len(backend.requests) == 1
    assert "s3cret" not in span.model_dump_json() and "backend-key" not in span.model_dump_json()


async def test_on_loopback_agents_calls_are_served_whatever_key_they_send(store: SqlLightningStore) -> None:
    # agent-lightning's agents send their own placeholder ("dummy", OPENAI_API_KEY) on the route their runner handed
    # them (signed with the token); every other call, and the admin routes, keep the token: no other process of the
    # machine can call the models or write spans into a run's attempts.
    with (
        backends() as [(backend, url)],
        running(LLMProxy(store, [url], token="s3cret", agents_need_token=False)) as proxy,
    ):
        rollout, llm = await attempt_llm(store, proxy)
        placeholder = llm.model_copy(update={"api_key": "dummy"})
        await client(placeholder).chat.completions.create(model="policy", messages=MESSAGES)
        body = {"model": "policy", "messages": MESSAGES}
        routed = f"{proxy.url}/rollout/{rollout.rollout_id}/attempt/{rollout.attempt.attempt_id}"
        async with httpx.AsyncClient() as http:
            plain = await http.post(f"{proxy.url}/v1/chat/completions", json=body)
            unsigned = await http.post(f"{routed}/v1/chat/completions", json=body)
            forged = await http.post(f"{routed}/signed/{'0' * 32}/v1/chat/completions", json=body)
            with_token = await http.post(
                f"{routed}/v1/chat/completions", json=body, headers={"authorization": "Bearer s3cret"}
            )
            admin = await http.get(f"{proxy.url}/admin/status", headers={"authorization": "Bearer dummy"})
        spans = await store.query_spans(rollout.rollout_id)
    assert [plain.status_code, unsigned.status_code, forged.status_code] == [401, 401, 401]
    assert with_token.status_code == 200 and admin.status_code == 401
    assert len(backend.requests) == 2 and len(spans) == 2
    span = spans[0]
    assert span.attributes[semconv.GEN_AI_REQUEST_MODEL] == "policy"
    with pytest.raises(ValueError, match="agents_need_token=False"):
        LLMProxy(store, [url], token="s3cret", agents_need_token=False).start(host="0.0.0.0")


@pytest.mark.parametrize("any_agent_key", [False, True])
async def test_a_run_s_proxy_needs_the_token_unless_its_config_lets_agents_send_any_key(
    store: SqlLightningStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, any_agent_key: bool
) -> None:
    """By default a run's proxy takes a call on the route a runner handed its agent only with the run's token, which
    the agent has as its LLM's api_key; `proxy_any_agent_key` (agent-lightning's habit, set by its Trainer) serves
    such a call whatever key comes with it. Either way a route not signed with the token needs the token."""
    from lightning.config import load_config
    from lightning.run import _Parts, _start_serving
    from lightning.runner import _routed

    monkeypatch.delenv("LIGHTNING_PROXY_TOKEN", raising=False)
    with backends() as [(_, url)]:
        config = load_config({
            "run_name": "r", "agent": "examples.copy_task.agent:copy_agent", "proxy_any_agent_key": any_agent_key,
            "inference": {"backend": "external", "endpoint": url}, "store_url": f"sqlite:///{tmp_path}/store.db",
            "output_dir": str(tmp_path / "runs"),
        })  # fmt: skip
        parts = _Parts(store=store, model_dir=None)
        endpoints = _start_serving(config, parts, tmp_path)  # as Run.open starts the run's proxy
        try:
            rollout = await store.start_rollout({"question": "2+2"})
            llm = _routed(ProxyLLM(endpoint=f"{endpoints.proxy_url}/v1", model="policy"), rollout)
            assert llm.api_key == parts.proxy_token  # from this process's environment, where the run put it
            answer = await client(llm).chat.completions.create(model="policy", messages=MESSAGES)
            own_key = openai.AsyncOpenAI(base_url=llm.base_url, api_key="dummy", max_retries=0)
            if any_agent_key:
                await own_key.chat.completions.create(model="policy", messages=MESSAGES)
            else:
                with pytest.raises(openai.AuthenticationError, match="proxy_any_agent_key: true"):
                    await own_key.chat.completions.create(model="policy", messages=MESSAGES)
            unsigned = openai.AsyncOpenAI(base_url=f"{llm.base_url.split('/signed/')[0]}/v1", api_key="dummy")
            with pytest.raises(openai.AuthenticationError):
                await unsigned.with_options(max_retries=0).chat.completions.create(model="policy", messages=MESSAGES)
            spans = await store.query_spans(rollout.rollout_id)
        finally:
            for close in reversed(parts.closers):
                close()
    assert answer.choices[0].message.content == "".join(ANSWER)
    assert len(spans) == (2 if any_agent_key else 1)
    with pytest.raises(ConfigError, match="proxy_any_agent_key: only for a proxy on loopback"):
        load_config({"proxy_any_agent_key": True, "proxy_host": "10.0.0.5", "inference": {"backend": "vllm"}})


def test_the_proxy_refuses_to_listen_beyond_loopback_without_a_token(tmp_path: Path) -> None:
    proxy = LLMProxy(SqlLightningStore(f"sqlite:///{tmp_path}/s.db", watchdog_interval=None), ["http://127.0.0.1:1/v1"])
    with pytest.raises(ValueError, match="token"):
        proxy.start(host="0.0.0.0")


async def test_a_route_signed_with_the_proxys_token_is_not_looked_up_and_a_forged_one_is(
    store: SqlLightningStore,
) -> None:
    looked_up: list[str] = []
    query_attempts = store.query_attempts

    async def counted(rollout_id: str, **options: Any) -> Any:
        looked_up.append(rollout_id)
        return await query_attempts(rollout_id, **options)

    store.query_attempts = counted  # type: ignore[method-assign]
    with backends() as [(backend, url)], running(LLMProxy(store, [url], token="s3cret")) as proxy:
        rollout, llm = await attempt_llm(store, proxy)
        assert "/signed/" in llm.endpoint  # the runner's route carries the proxy's mark
        await client(llm).chat.completions.create(model="policy", messages=MESSAGES)
        assert looked_up == []  # a signed route's attempt is taken as known: no store request before the call
        forged = llm.endpoint.replace(f"attempt/{rollout.attempt.attempt_id}/", "attempt/at-unknown/")
        async with httpx.AsyncClient(headers={"authorization": "Bearer s3cret"}) as http:
            unknown = await http.post(f"{forged}/chat/completions", json={"model": "policy", "messages": MESSAGES})
        [span] = await store.query_spans(rollout.rollout_id)
    assert looked_up == [rollout.rollout_id]  # a signature that does not match is only a reason to ask
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "attempt_id"
    assert len(backend.requests) == 1 and span.status.status_code != "ERROR"


async def test_bad_requests_get_4xx_in_openai_shape(store: SqlLightningStore) -> None:
    with backends() as [(backend, url)], running(LLMProxy(store, [url])) as proxy:
        rollout, llm = await attempt_llm(store, proxy)
        async with httpx.AsyncClient() as http:
            not_json = await http.post(f"{llm.endpoint}/chat/completions", content=b"{nope")
            not_object = await http.post(f"{llm.endpoint}/chat/completions", json=[1, 2])
            unknown = await http.post(
                f"{proxy.url}/rollout/{rollout.rollout_id}/attempt/at-unknown/v1/chat/completions",
                json={"model": "policy", "messages": MESSAGES},
            )
        assert await store.query_spans(rollout.rollout_id) == []
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]
    assert not_object.status_code == 400
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "attempt_id"
    assert backend.requests == []


async def test_backend_errors_pass_through_and_are_stored_as_error_spans(store: SqlLightningStore) -> None:
    with backends() as [(_, url)], running(LLMProxy(store, [url])) as proxy:
        rollout, llm = await attempt_llm(store, proxy)
        async with httpx.AsyncClient() as http:
            missing = await http.post(f"{llm.endpoint}/chat/completions/nothing", json={"model": "policy"})
        async with httpx.AsyncClient() as http:
            # A 4xx from the backend on a captured route reaches the agent as is, and leaves an error span.
            proxy.set_backends([Backend(url=url.replace("/v1", "/nowhere"))])
            refused = await http.post(
                f"{llm.endpoint}/chat/completions", json={"model": "policy", "messages": MESSAGES}
            )
        [span] = await store.query_spans(rollout.rollout_id)
    assert missing.status_code == 404
    assert refused.status_code == 404
    assert span.status.status_code == "ERROR" and "HTTP 404" in (span.status.description or "")
    assert span.attributes[semconv.LLM_HTTP_STATUS] == 404


async def test_plain_v1_routes_record_spans_when_headers_name_the_attempt(store: SqlLightningStore) -> None:
    with backends() as [(_, url)], running(LLMProxy(store, [url])) as proxy:
        rollout, _ = await attempt_llm(store, proxy)
        plain = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0)
        await plain.chat.completions.create(model="policy", messages=MESSAGES)  # no span: no attempt named
        headers = {"x-rollout-id": rollout.rollout_id, "x-attempt-id": rollout.attempt.attempt_id}
        await plain.chat.completions.create(model="policy", messages=MESSAGES, extra_headers=headers)
        models = await plain.models.list()
        [span] = await store.query_spans(rollout.rollout_id)
    assert span.attempt_id == rollout.attempt.attempt_id
    assert [m.id for m in models.data] == ["policy"]


async def test_concurrent_calls_of_many_attempts_each_leave_their_span(store: SqlLightningStore) -> None:
    with backends() as [(_, url)], running(LLMProxy(store, [url])) as proxy:
        attempts = [await attempt_llm(store, proxy) for _ in range(8)]

        async def calls(llm: LLM) -> None:
            for i in range(4):
                if i % 2:
                    stream = await client(llm).chat.completions.create(model="policy", messages=MESSAGES, stream=True)
                    assert "".join([chunk.choices[0].delta.content async for chunk in stream]) == "".join(ANSWER)
                else:
                    await client(llm).chat.completions.create(model="policy", messages=MESSAGES)

        await asyncio.gather(*(calls(llm) for _, llm in attempts))
        for rollout, _ in attempts:
            spans = await store.query_spans(rollout.rollout_id)
            assert sorted(s.sequence_id for s in spans) == [1, 2, 3, 4]
            assert all(token_ids(s) == (PROMPT_IDS, [ANSWER_IDS]) for s in spans)
        assert proxy.writer.written == 32 and proxy.writer.failed == 0


async def test_external_models_go_through_litellm_with_spans_but_no_token_ids(store: SqlLightningStore) -> None:
    with backends() as [(backend, url)]:
        external = ExternalModel(
            model_name="frozen-judge",
            litellm_params={"model": "openai/judge-v1", "api_base": url, "api_key": "sk-provider-secret"},
        )
        with running(LLMProxy(store, [url], external_models=[external])) as proxy:
            rollout, llm = await attempt_llm(store, proxy)
            response = await client(llm).chat.completions.create(model="frozen-judge", messages=MESSAGES)
            stream = await client(llm).chat.completions.create(model="frozen-judge", messages=MESSAGES, stream=True)
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            spans = await store.query_spans(rollout.rollout_id)
    assert response.choices[0].message.content == "".join(ANSWER)
    assert streamed == "".join(ANSWER)
    assert [r["model"] for r in backend.requests] == ["judge-v1", "judge-v1"]
    assert all("return_token_ids" not in r for r in backend.requests)
    assert [s.attributes[semconv.GEN_AI_PROVIDER] for s in spans] == ["litellm", "litellm"]
    assert all(semconv.LLM_RESPONSE_TOKEN_IDS not in s.attributes for s in spans)
    assert all("sk-provider-secret" not in s.model_dump_json() for s in spans)


class _SubclassAgent(LitAgent[dict[str, Any]]):
    """A 0.3-style agent that reads its LLM from the resources dict itself."""

    async def rollout_async(self, task: dict[str, Any], resources: dict[str, Any], rollout: AttemptedRollout) -> float:
        llm = resources["main_llm"]
        base_url = llm.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
        oai = openai.AsyncOpenAI(base_url=base_url, api_key=llm.api_key or "unused", max_retries=0)
        response = await oai.chat.completions.create(model=llm.model, messages=MESSAGES)
        return 1.0 if response.choices[0].message.content == "".join(ANSWER) else 0.0


async def test_runners_hand_agents_the_proxy_routed_to_their_attempt(store: SqlLightningStore) -> None:
    with backends() as [(_, url)], running(LLMProxy(store, [url])) as proxy:
        await store.add_resources({"main_llm": proxy.resource()})
        queued = await store.enqueue_many_rollouts([{"input": {"n": i}} for i in range(3)])
        runner = Runner(_SubclassAgent(), store, idle_wait=0.05)
        assert await runner.iter(max_rollouts=3) == 3
        await runner.close()
        for rollout in queued:
            spans = await store.query_spans(rollout.rollout_id)
            llm_spans = [s for s in spans if s.attributes.get(semconv.GEN_AI_OPERATION) == "chat"]
            assert len(llm_spans) == 1
            assert token_ids(llm_spans[0]) == (PROMPT_IDS, [ANSWER_IDS])


class GatedStream:
    """A backend that streams `before` (one write each, apart, so they reach the proxy in separate reads), then
    holds its response open until `gate` is set, then sends `after` and ends it."""

    def __init__(self, before: list[bytes], after: list[bytes]) -> None:
        self.before, self.after = before, after
        self.gate = threading.Event()
        self.ended = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["method"] != "POST":  # GET /v1/models: not served here
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for piece in self.before:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            await asyncio.sleep(0.1)
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        for piece in self.after:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.ended.set()


def sse_chunk(content: str, finish_reason: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": finish_reason}
    return b"data: " + json.dumps({"id": "gated-1", "model": "policy", "choices": [choice]}).encode() + b"\n\n"


async def test_a_done_split_across_reads_still_waits_for_the_span_and_ends_the_stream(store: SqlLightningStore) -> None:
    backend = GatedStream([sse_chunk("4", "stop"), b"data: [DO", b"NE]\n\n"], [])
    with serving(backend) as url, running(LLMProxy(store, [Backend(url=f"{url}/v1", token_ids=False)])) as proxy:
        rollout, llm = await attempt_llm(store, proxy)
        body = {"model": "policy", "messages": MESSAGES, "stream": True}
        async with (
            httpx.AsyncClient(timeout=30) as http,
            http.stream("POST", f"{llm.endpoint}/chat/completions", json=body) as response,
        ):
            received = b""
            async for data in response.aiter_bytes():
                received += data
                if b"data: [DONE]\n\n" in received:
                    spans_at_done = await store.query_spans(rollout.rollout_id)
            # The proxy ended the agent's stream at [DONE], while the backend still holds its response open.
            ended_before_backend = not backend.ended.is_set()
        backend.gate.set()
    assert received == sse_chunk("4", "stop") + b"data: [DONE]\n\n"
    assert ended_before_backend
    [span] = spans_at_done
    assert span.status.status_code == "OK"
    assert json.loads(span.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == "4"


async def test_the_plain_v1_route_streams_without_buffering(store: SqlLightningStore) -> None:
    backend = GatedStream([sse_chunk("The")], [sse_chunk(" end", "stop"), b"data: [DONE]\n\n"])
    with serving(backend) as url, running(LLMProxy(store, [Backend(url=f"{url}/v1", token_ids=False)])) as proxy:
        plain = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=30)
        stream = await plain.chat.completions.create(model="policy", messages=MESSAGES, stream=True)
        # The backend sends the rest only when the gate opens: a proxy that buffered would never answer here.
        first = await asyncio.wait_for(stream.__anext__(), timeout=20)
        assert not backend.ended.is_set()
        backend.gate.set()
        rest = [chunk.choices[0].delta.content async for chunk in stream]
    assert first.choices[0].delta.content == "The"
    assert rest == [" end"]


async def test_after_adapter_n_is_published_the_policy_s_calls_go_to_it_and_their_spans_record_n(
    store: SqlLightningStore,
) -> None:
    """A LoRA run on vLLM: the run resumes the proxy with the adapter's name and step (`Run.load_weights`); every call
    for the policy from then on is sent as that adapter, and its span records both, streamed or not."""
    with backends() as [(backend, url)], running(LLMProxy(store, [url], model_name="policy")) as proxy:
        rollout, llm = await attempt_llm(store, proxy)
        await client(llm).chat.completions.create(model="policy", messages=MESSAGES)  # the base, version 0
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            await http.post("/admin/pause")
            resumed = await http.post("/admin/resume", json={"weight_version": 3, "adapter": "policy-lora-3"})
            assert resumed.json() == {"paused": False, "weight_version": 3, "adapter": "policy-lora-3"}
            await client(llm).chat.completions.create(model="policy", messages=MESSAGES)
            stream = await client(llm).chat.completions.create(model="policy", messages=MESSAGES, stream=True)
            assert "".join([chunk.choices[0].delta.content async for chunk in stream]) == "".join(ANSWER)
            await client(llm).chat.completions.create(model="another", messages=MESSAGES)  # not the policy: as is
            assert (await http.get("/admin/status")).json()["adapter"] == "policy-lora-3"
            wrong = await http.post("/admin/resume", json={"adapter": 3})
            assert wrong.status_code == 400 and "adapter" in wrong.text
            await http.post("/admin/resume", json={"weight_version": 4, "adapter": None})  # whole weights again
            await client(llm).chat.completions.create(model="policy", messages=MESSAGES)
        spans = await store.query_spans(rollout.rollout_id)
    sent = [request["model"] for request in backend.requests]
    assert sent == ["policy", "policy-lora-3", "policy-lora-3", "another", "policy"]
    recorded = [
        (s.attributes.get(semconv.LLM_WEIGHT_VERSION), s.attributes.get(semconv.LLM_LORA_ADAPTER)) for s in spans
    ]
    assert recorded == [(None, None), (3, "policy-lora-3"), (3, "policy-lora-3"), (3, None), (4, None)]


async def test_the_advertised_model_name_is_mapped_to_what_the_backend_serves(store: SqlLightningStore) -> None:
    with backends() as [(backend, url)], running(LLMProxy(store, [url], model_name="policy")) as proxy:
        backend.served_models = ["tiny"]  # a server started with its own --served-model-name
        _, llm = await attempt_llm(store, proxy)
        plain = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0)
        advertised = [model.id for model in (await plain.models.list()).data]
        for name in advertised:
            await client(llm).chat.completions.create(model=name, messages=MESSAGES)
            await plain.chat.completions.create(model=name, messages=MESSAGES, stream=True)
        await client(llm).chat.completions.create(model="tiny", messages=MESSAGES)  # the backend's own name works too
    assert advertised == ["policy"]
    assert [request["model"] for request in backend.requests] == ["tiny", "tiny", "tiny"]


async def test_tool_definitions_are_recorded_on_the_span(store: SqlLightningStore) -> None:
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]
    with backends() as [(backend, url)], running(LLMProxy(store, [url])) as proxy:
        rollout, llm = await attempt_llm(store, proxy)
        await client(llm).chat.completions.create(model="policy", messages=MESSAGES, tools=tools, tool_choice="auto")
        stream = await client(llm).chat.completions.create(model="policy", messages=MESSAGES, tools=tools, stream=True)
        _ = [chunk async for chunk in stream]
        await client(llm).chat.completions.create(model="policy", messages=MESSAGES)
        spans = sorted(await store.query_spans(rollout.rollout_id), key=lambda s: s.sequence_id)
    assert backend.requests[0]["tools"] == tools
    assert [json.loads(s.attributes.get(semconv.GEN_AI_TOOL_DEFINITIONS, "null")) for s in spans] == [
        tools,
        tools,
        None,
    ]
    assert spans[0].attributes[semconv.GEN_AI_REQUEST_PREFIX + "tool_choice"] == "auto"


async def test_a_tools_request_through_litellm_reaches_the_backend_and_its_span(store: SqlLightningStore) -> None:
    # LiteLLM 1.106.2 imports `mcp` for any request with tools: without it this call fails.
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]
    with backends() as [(backend, url)]:
        external = ExternalModel(
            model_name="judge", litellm_params={"model": "openai/judge", "api_base": url, "api_key": "unused"}
        )
        with running(LLMProxy(store, [url], external_models=[external])) as proxy:
            rollout, llm = await attempt_llm(store, proxy)
            response = await client(llm).chat.completions.create(model="judge", messages=MESSAGES, tools=tools)
            [span] = await store.query_spans(rollout.rollout_id)
    assert response.choices[0].message.content == "".join(ANSWER)
    assert backend.requests[0]["tools"] == tools
    assert json.loads(span.attributes[semconv.GEN_AI_TOOL_DEFINITIONS]) == tools


def test_the_proxy_command_answers_the_name_it_advertises(tmp_path: Path) -> None:
    """`lightning proxy serve --backend URL` in front of a server that serves another name (as the embedded server
    serves `tiny`): what its /v1/models lists is what it answers. With `--any-agent-key` an agent's own key is
    served; the admin routes still need the token."""
    port = free_port()
    with backends() as [(backend, url)]:
        backend.served_models = ["tiny"]
        command = [sys.executable, "-m", "lightning.cli", "proxy", "serve", "--backend", url, "--port", str(port)]
        command += ["--store", f"sqlite:///{tmp_path}/store.db", "--token", "the-token", "--any-agent-key"]
        process = subprocess.Popen(command, cwd=Path(__file__).resolve().parent.parent)
        try:
            base = f"http://127.0.0.1:{port}/v1"
            deadline = time.monotonic() + 60
            while True:
                try:
                    models = httpx.get(f"{base}/models", headers={"authorization": "Bearer the-token"}).json()
                    break
                except httpx.TransportError:
                    assert process.poll() is None and time.monotonic() < deadline, "the proxy did not start"
                    time.sleep(0.2)
            [advertised] = [model["id"] for model in models["data"]]
            plain = openai.OpenAI(base_url=base, api_key="the-token", max_retries=0)
            response = plain.chat.completions.create(model=advertised, messages=MESSAGES)
            # An agent's own key is served on the route its runner hands it (signed with the token), nowhere else.
            rollout = asyncio.run(_started_rollout(f"sqlite:///{tmp_path}/store.db"))
            route = ProxyLLM(endpoint=base, model=advertised, api_key="the-token").get_base_url(
                rollout.rollout_id, rollout.attempt.attempt_id
            )
            own_key = openai.OpenAI(base_url=route, api_key="unused", max_retries=0)
            routed = own_key.chat.completions.create(model=advertised, messages=MESSAGES)
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=base, api_key="unused", max_retries=0).chat.completions.create(
                    model=advertised, messages=MESSAGES
                )
            admin = httpx.get(f"http://127.0.0.1:{port}/admin/status", headers={"authorization": "Bearer unused"})
        finally:
            process.terminate()
            process.wait(timeout=30)
    assert advertised == "policy" and admin.status_code == 401
    assert response.choices[0].message.content == "".join(ANSWER) == routed.choices[0].message.content
    assert [request["model"] for request in backend.requests] == ["tiny", "tiny"]


async def _started_rollout(url: str) -> AttemptedRollout:
    store = SqlLightningStore(url, watchdog_interval=None)
    try:
        return await store.start_rollout({"question": "2+2"})
    finally:
        await store.close()


async def test_each_turn_of_an_attempt_gets_its_own_seed_derived_from_the_agents(store: SqlLightningStore) -> None:
    """An agent passes its rollout's seed with every call (it is in the LLM resource's sampling_parameters): the
    first call keeps it, each later call of the attempt gets `turn_seed(seed, turn)`; another attempt counts anew.
    Calls without a seed pass as sent. The span records the seed the backend got."""
    with backends() as [(backend, url)], running(LLMProxy(store, [url], model_name="policy")) as proxy:
        rollout, llm = await attempt_llm(store, proxy)
        other, other_llm = await attempt_llm(store, proxy)
        for each in (llm, llm, other_llm, llm):
            await client(each).chat.completions.create(model="policy", messages=MESSAGES, seed=1234)
        await client(llm).chat.completions.create(model="policy", messages=MESSAGES)
        spans = await store.query_spans(rollout.rollout_id)

    assert [body.get("seed") for body in backend.requests] == [
        1234, turn_seed(1234, 1), 1234, turn_seed(1234, 2), None
    ]  # fmt: skip
    recorded = [span.attributes.get(semconv.GEN_AI_REQUEST_PREFIX + "seed") for span in spans]
    assert sorted(recorded, key=str) == sorted([1234, turn_seed(1234, 1), turn_seed(1234, 2), None], key=str)
