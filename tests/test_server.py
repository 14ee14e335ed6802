"""The store's HTTP face: status codes and messages, the token, OTLP ingestion, the client's retries, the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
from conftest import serving
from google.rpc import status_pb2

from lightning.store import (
    AuthError,
    ConflictError,
    InvalidArgumentError,
    LightningStore,
    NotFoundError,
    SqlLightningStore,
    StoreError,
    contract,
)
from lightning.store import client as client_module
from lightning.store.client import HttpLightningStore
from lightning.store.server import create_app
from lightning.types import PaginatedResult, Span

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKEN = "s3cret-token"


class FussyStore(LightningStore):
    """A stand-in store whose calls fail the ways a real one can."""

    async def handle(self, request: contract.Request) -> Any:
        if isinstance(request, contract.StartAttempt):
            raise ConflictError(f"rollout {request.rollout_id} is cancelled; no new attempts")
        if isinstance(request, contract.GetRolloutById):
            raise StoreError("the SQLite database stayed locked by another process for 30 s")
        if isinstance(request, contract.GetLatestAttempt):
            raise RuntimeError("secret internals /home/me/.ssh")
        return {"rollouts": {}}


@pytest.fixture
async def sql_store(tmp_path: Path) -> AsyncIterator[SqlLightningStore]:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 'store.db'}", watchdog_interval=None)
    yield store
    await store.close()


def asgi_client(app: Any, **kwargs: Any) -> httpx.AsyncClient:
    """Requests straight into the app, no socket: for what the server answers."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://store", **kwargs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- status codes and messages ----------------------------------------------------------------


async def test_errors_map_to_status_codes_with_messages(sql_store: SqlLightningStore) -> None:
    async with asgi_client(create_app(sql_store)) as http:
        missing = await http.post("/v1/store/update_rollout", json={"rollout_id": "ro-nope", "metadata": {}})
        assert missing.status_code == 404
        assert "ro-nope" in missing.json()["detail"]

        bad_status = await http.post("/v1/store/update_rollout", json={"rollout_id": "ro-x", "status": "bogus"})
        assert bad_status.status_code == 422
        assert bad_status.json()["detail"].startswith("status: ")

        typo = await http.post("/v1/store/query_rollouts", json={"statuses": ["queuing"]})
        assert typo.status_code == 422
        assert "statuses" in typo.json()["detail"]

        store_says = await http.post("/v1/store/query_rollouts", json={"sort_by": "no_such_column"})
        assert store_says.status_code == 422
        assert "no_such_column" in store_says.json()["detail"]

        not_json = await http.post("/v1/store/query_rollouts", content=b"{not json", headers={"content-type": "json"})
        assert not_json.status_code == 422
        assert isinstance(not_json.json()["detail"], str)


async def test_conflict_unavailable_and_unexpected_errors() -> None:
    async with asgi_client(create_app(FussyStore())) as http:
        conflict = await http.post("/v1/store/start_attempt", json={"rollout_id": "ro-1"})
        assert conflict.status_code == 409
        assert conflict.json() == {"detail": "rollout ro-1 is cancelled; no new attempts"}

        unavailable = await http.post("/v1/store/get_rollout_by_id", json={"rollout_id": "ro-1"})
        assert unavailable.status_code == 503
        assert "locked" in unavailable.json()["detail"]

        unexpected = await http.post("/v1/store/get_latest_attempt", json={"rollout_id": "ro-1"})
        assert unexpected.status_code == 500
        assert "secret" not in unexpected.text and "Traceback" not in unexpected.text
        assert unexpected.json()["detail"].startswith("internal server error")


async def test_client_raises_typed_errors_with_the_server_message(sql_store: SqlLightningStore) -> None:
    with serving(create_app(FussyStore())) as fussy_url, serving(create_app(sql_store)) as url:
        async with HttpLightningStore(fussy_url, retries=0) as fussy, HttpLightningStore(url) as store:
            with pytest.raises(ConflictError, match="is cancelled"):
                await fussy.start_attempt("ro-1")
            with pytest.raises(StoreError, match="locked"):
                await fussy.get_rollout_by_id("ro-1")
            with pytest.raises(NotFoundError, match="ro-nope"):
                await store.start_attempt("ro-nope")
            with pytest.raises(InvalidArgumentError, match="sort_order"):
                await store.query_rollouts(sort_order="sideways")  # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentError, match="JSON"):
                await store.enqueue_rollout({"score": float("nan")})
            assert await store.query_rollouts() == []


async def test_openapi_schema_has_a_route_per_store_method(sql_store: SqlLightningStore) -> None:
    async with asgi_client(create_app(sql_store)) as http:
        schema = (await http.get("/openapi.json")).json()
    methods = {path.removeprefix("/v1/store/") for path in schema["paths"] if path.startswith("/v1/store/")}
    # `capabilities` is agl's flag property (what the store can do), answered by the object, not a request.
    local = {"close", "add_otel_span", "handle", "capabilities"}
    public = {name for name in dir(LightningStore) if not name.startswith("_")} - local
    assert methods == public == {request.method for request in contract.REQUESTS}
    # Each route's body is its request model, fields and descriptions included.
    query_spans = schema["paths"]["/v1/store/query_spans"]["post"]
    body = query_spans["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert set(contract.QuerySpans.model_fields) == set(schema["components"]["schemas"][body]["properties"])
    assert "/v1/traces" in schema["paths"] and "/health" in schema["paths"]


async def test_query_spans_answers_the_stored_span_json(sql_store: SqlLightningStore) -> None:
    """The server sends query_spans' spans as stored, without building Span models; the answer is the same."""
    rollout = await sql_store.start_rollout("spans")
    rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
    await sql_store.add_many_spans(
        [
            Span(
                rollout_id=rid,
                attempt_id=aid,
                sequence_id=seq,
                trace_id="ab" * 16,
                span_id=f"{seq:016x}",
                parent_id=None,
                name="chat" if seq % 2 else "reward",
                attributes={"n": seq, "text": f"é {seq}"},
                start_time=1_700_000_000.0 + seq,
                end_time=1_700_000_000.5 + seq,
            )
            for seq in range(1, 6)
        ]
    )
    answer = pydantic.TypeAdapter(PaginatedResult[Span])
    queries = [{}, {"attempt_id": "latest"}, {"name": "chat", "limit": 2, "offset": 1}, {"sort_order": "desc"}]
    async with asgi_client(create_app(sql_store)) as http:
        for query in queries:
            sent = await http.post("/v1/store/query_spans", json={"rollout_id": rid, **query})
            assert sent.status_code == 200, sent.text
            expected = await sql_store.query_spans(rid, **query)
            got = answer.validate_json(sent.content)
            assert (got.items, got.limit, got.offset, got.total) == (
                expected.items,
                expected.limit,
                expected.offset,
                expected.total,
            ), query
        missing = await http.post("/v1/store/query_spans", json={"rollout_id": "ro-nope"})
        assert missing.status_code == 404 and "ro-nope" in missing.json()["detail"]


# --- the token --------------------------------------------------------------------------------


async def test_token_guards_every_route(sql_store: SqlLightningStore, caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(sql_store, token=TOKEN)
    routes = [("GET", "/health"), ("GET", "/openapi.json"), ("GET", "/docs"), ("POST", "/v1/store/statistics")]
    routes.append(("POST", "/v1/traces"))
    async with asgi_client(app) as http:
        for method, path in routes:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
                denied = await http.request(method, path, headers=headers)
                assert denied.status_code == 401, (method, path, headers)
                if path == "/v1/traces":  # OTLP/HTTP answers errors with a google.rpc.Status (test_otlp.py)
                    assert "token" in status_pb2.Status.FromString(denied.content).message
                else:
                    assert "token" in denied.json()["detail"]
            allowed = await http.request(method, path, headers={"authorization": f"Bearer {TOKEN}"})
            assert allowed.status_code == 200, (method, path, allowed.text)
    assert TOKEN not in caplog.text

    with serving(app) as url:
        async with HttpLightningStore(url, token=TOKEN) as good, HttpLightningStore(url, retries=0) as anonymous:
            assert (await good.enqueue_rollout("x")).status == "queuing"
            with pytest.raises(AuthError, match=f"the store server at {url} refused the request: HTTP 401: missing"):
                await anonymous.query_rollouts()
            assert TOKEN not in repr(good)


# --- the client: threads, loops, long waits, retries -------------------------------------------


async def test_client_works_from_many_threads_and_loops(sql_store: SqlLightningStore) -> None:
    with serving(create_app(sql_store)) as url:
        store = HttpLightningStore(url)
        rollout = await store.enqueue_rollout("shared")
        seen: list[str] = []

        def in_own_loop() -> None:
            for _ in range(2):  # a second loop in the same thread, after the first has ended
                got = asyncio.run(store.get_rollout_by_id(rollout.rollout_id))
                seen.append(got.rollout_id)

        threads = [threading.Thread(target=in_own_loop) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert seen == [rollout.rollout_id] * 6
        assert (await store.get_rollout_by_id(rollout.rollout_id)).input == "shared"
        await store.close()
        with pytest.raises(StoreError, match="closed"):
            await store.get_rollout_by_id(rollout.rollout_id)


async def test_long_waits_span_several_requests(sql_store: SqlLightningStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "MAX_WAIT_SECONDS", 0.2)
    monkeypatch.setattr(contract, "MAX_WAIT_SECONDS", 0.2)
    with serving(create_app(sql_store)) as url:
        async with HttpLightningStore(url) as store:

            async def enqueue_later() -> str:
                await asyncio.sleep(0.6)
                return (await store.enqueue_rollout("late")).rollout_id

            started = time.monotonic()
            late, claimed = await asyncio.gather(enqueue_later(), store.dequeue_rollout(worker_id="w", wait=3.0))
            assert claimed is not None and claimed.rollout_id == late
            assert 0.5 < time.monotonic() - started < 2.0

            async def finish_later() -> None:
                await asyncio.sleep(0.5)
                await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")

            _, done = await asyncio.gather(finish_later(), store.wait_for_rollouts(rollout_ids=[late], timeout=3.0))
            assert [(r.rollout_id, r.status) for r in done] == [(late, "succeeded")]


class CountingStub:
    """An ASGI app that counts requests per path and answers each with `status` (503: "store busy")."""

    def __init__(self, status: int = 503, detail: str = "store busy") -> None:
        self.calls: dict[str, int] = {}
        self.status = status
        self.detail = detail

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"].removeprefix("/v1/store/")
        self.calls[path] = self.calls.get(path, 0) + 1
        body = json.dumps({"detail": self.detail}).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def test_client_repeats_only_calls_that_are_safe_to_repeat() -> None:
    stub = CountingStub()
    with serving(stub) as url:
        async with HttpLightningStore(url, retries=2) as store:
            safe = {
                "get_rollout_by_id": store.get_rollout_by_id("ro-1"),
                "enqueue_rollout": store.enqueue_rollout("x", idempotency_key="k-1"),
                "get_many_span_sequence_ids": store.get_many_span_sequence_ids([("ro-1", "at-1")]),
                "update_attempt": store.update_attempt("ro-1", "at-1", last_heartbeat_time=time.time()),
                "update_worker": store.update_worker("w-1"),
            }
            for name, call in safe.items():
                with pytest.raises(StoreError, match="store busy"):
                    await call
                assert stub.calls.pop(name) == 3, name

            unsafe = {
                "enqueue_rollout": store.enqueue_rollout("x"),
                "dequeue_rollout": store.dequeue_rollout(worker_id="w-1"),
                "update_attempt": store.update_attempt("ro-1", "at-1", status="succeeded"),
                "update_rollout": store.update_rollout("ro-1", status="cancelled"),
            }
            for name, call in unsafe.items():
                with pytest.raises(StoreError, match="store busy"):
                    await call
                assert stub.calls.pop(name) == 1, name


@pytest.mark.parametrize("status", [401, 403])
async def test_a_refused_token_is_an_auth_error_at_once(status: int) -> None:
    stub = CountingStub(status, detail="not for you")
    with serving(stub) as url:
        async with HttpLightningStore(url, token="wrong", retries=3) as store:
            started = time.monotonic()
            with pytest.raises(AuthError, match=f"at {url} refused the request: HTTP {status}: not for you"):
                await store.query_rollouts()  # a read: 503s and transport errors would be repeated
            assert time.monotonic() - started < 1.0
    assert stub.calls == {"query_rollouts": 1}
    assert issubclass(AuthError, StoreError)


async def test_client_against_a_stopped_server_raises_instead_of_answering_empty() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with HttpLightningStore(url, retries=2, timeout=2.0) as store:
        started = time.monotonic()
        with pytest.raises(StoreError, match="no answer"):
            await store.query_rollouts()
        assert time.monotonic() - started >= 0.2  # two backoffs: the read was repeated
        started = time.monotonic()
        with pytest.raises(StoreError, match="no answer"):
            await store.dequeue_rollout(worker_id="w")
        assert time.monotonic() - started < 0.1  # sent once, and not turned into "queue empty"


# --- the command line -------------------------------------------------------------------------


def run_cli(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "lightning.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=60, **kwargs)


def test_cli_help_reads_well() -> None:
    top = run_cli("--help")
    assert top.returncode == 0
    assert "usage: lightning" in top.stdout and "store" in top.stdout
    serve = run_cli("store", "serve", "--help")
    assert serve.returncode == 0
    for option in ("--host", "--port", "--db", "--token", "--log-level", "LIGHTNING_STORE_TOKEN", "127.0.0.1"):
        assert option in serve.stdout, option


def test_cli_refuses_a_public_host_without_token() -> None:
    refused = run_cli("store", "serve", "--host", "0.0.0.0", env={**os.environ, "LIGHTNING_STORE_TOKEN": ""})
    assert refused.returncode == 2
    assert "--token" in refused.stderr and "0.0.0.0" in refused.stderr


@pytest.fixture(params=["token from the environment", "token and access log flags"])
def served_by_cli(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """docs/store.md's form: `lightning store serve --host 127.0.0.1 --port 4747 --db sqlite:///... [--token T]`,
    the token from $LIGHTNING_STORE_TOKEN or --token, and with `--access-log` a line per request."""
    port = free_port()
    command = [sys.executable, "-m", "lightning.cli", "store", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--db", f"sqlite:///{tmp_path / 'cli.db'}"]
    env = {name: value for name, value in os.environ.items() if name != "LIGHTNING_STORE_TOKEN"}
    flags = request.param == "token and access log flags"
    if flags:
        command += ["--token", TOKEN, "--access-log", "--log-level", "info"]
    else:
        command += ["--log-level", "warning"]
        env["LIGHTNING_STORE_TOKEN"] = TOKEN
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=20)
        assert process.returncode == 0, stderr
        assert TOKEN not in stderr and TOKEN not in stdout
        assert ('"GET /health HTTP/1.1" 200' in stdout + stderr) == flags, (stdout, stderr)


def test_cli_serves_a_store_that_answers_health(served_by_cli: str) -> None:
    deadline = time.monotonic() + 30
    with httpx.Client(base_url=served_by_cli, trust_env=False) as http:
        while True:
            try:
                denied = http.get("/health")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "lightning store serve did not come up"
                time.sleep(0.1)
        assert denied.status_code == 401
        health = http.get("/health", headers={"authorization": f"Bearer {TOKEN}"})
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    assert health.json()["statistics"]["backend"] == "sqlite"


# --- bad input is a 4xx that names it -----------------------------------------------------------


async def test_a_nul_character_is_refused_naming_the_field(sql_store: SqlLightningStore) -> None:
    async with asgi_client(create_app(sql_store)) as http:
        answer = await http.post("/v1/store/enqueue_rollout", json={"input": "x", "idempotency_key": "a\u0000b"})
        assert answer.status_code == 422
        assert answer.json()["detail"].startswith("idempotency_key: contains a NUL character")
        answer = await http.post("/v1/store/update_worker", json={"worker_id": "w\u0000"})
        assert answer.status_code == 422 and answer.json()["detail"].startswith("worker_id: contains a NUL")
    # Inside a task's input (stored as JSON, where it is escaped) it is data like any other.
    rollout = await sql_store.enqueue_rollout({"text": "a\u0000b"})
    assert (await sql_store.get_rollout_by_id(rollout.rollout_id)).input == {"text": "a\u0000b"}
    with pytest.raises(InvalidArgumentError, match="queue: contains a NUL character"):
        await sql_store.dequeue_rollout(queue="q\u0000")


async def test_a_body_over_the_cap_is_a_413(sql_store: SqlLightningStore) -> None:
    app = create_app(sql_store, max_body_bytes=10_000)
    async with asgi_client(app) as http:
        big = await http.post("/v1/store/enqueue_rollout", json={"input": "x" * 20_000})
        assert big.status_code == 413 and "at most 10,000" in big.json()["detail"]
        traces = await http.post(
            "/v1/traces", content=b"\0" * 20_000, headers={"content-type": "application/x-protobuf"}
        )
        assert traces.status_code == 413
        assert (await http.post("/v1/store/enqueue_rollout", json={"input": "x" * 100})).status_code == 200
    assert len(await sql_store.query_rollouts()) == 1


# --- waiting requests -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/store/dequeue_rollout", {"wait": 3600, "queue": "q"}),
        ("/v1/agl/queues/rollouts/dequeue", {"wait": 3600, "queue": "q"}),  # agent-lightning's wire
    ],
)
async def test_a_waiting_claim_whose_client_left_claims_nothing(
    sql_store: SqlLightningStore, path: str, body: dict
) -> None:
    """On both wires: the wait is the contract's (capped per request), and a claim stops waiting once its client is
    gone, so a rollout enqueued after it left stays in the queue for someone who is there."""
    with serving(create_app(sql_store)) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(path, json=body, timeout=0.5)  # the client gives up and closes the connection
        await asyncio.sleep(1.6)  # the server's next look (every second) sees it gone
        rollout = await sql_store.enqueue_rollout({"n": 1}, queue="q")
        await asyncio.sleep(1.2)
        assert (await sql_store.get_rollout_by_id(rollout.rollout_id)).status == "queuing"


def test_every_waiting_request_is_capped_by_the_contract() -> None:
    """Which requests wait, and for how long one HTTP request may, is said once, on the contract."""
    waiting = {request.method for request in contract.REQUESTS if request.wait_field is not None}
    rollout_waits = {"wait_for_rollouts", "wait_for_finished_ids"}
    assert waiting == {"dequeue_rollout", "dequeue_many_rollouts", "claim_rollouts", *rollout_waits}
    assert {request.method for request in contract.REQUESTS if request.claims} == waiting - rollout_waits
    assert contract.DequeueRollouts(wait=3600).capped().wait == contract.MAX_WAIT_SECONDS
    assert contract.WaitForRollouts(rollout_ids=["a"]).capped().timeout == contract.MAX_WAIT_SECONDS
    assert contract.WaitForRollouts(rollout_ids=["a"], timeout=2).capped().timeout == 2


async def test_agl_routes_answer_unknown_rollout_ids_with_nothing_as_agl_does(sql_store: SqlLightningStore) -> None:
    """agl's store answers spans of a rollout it does not know with an empty page, and leaves unknown ids out of a
    wait (its tests test_query_empty_spans, test_wait_for_nonexistent_rollout, ..._with_finite_timeout); our own
    routes keep refusing them (404), which says more."""
    known = await sql_store.start_rollout("known")
    await sql_store.update_rollout(known.rollout_id, status="succeeded")
    async with asgi_client(create_app(sql_store)) as http:
        spans = await http.get("/v1/agl/spans", params={"rollout_id": "ro-nope", "attempt_id": "latest"})
        started = time.monotonic()
        none = await http.post("/v1/agl/waits/rollouts", json={"rollout_ids": ["ro-nope"], "timeout": 0.1})
        waited = time.monotonic() - started
        mixed = await http.post(
            "/v1/agl/waits/rollouts", json={"rollout_ids": [known.rollout_id, "ro-nope"], "timeout": 0.1}
        )
        ours = await http.post("/v1/store/query_spans", json={"rollout_id": "ro-nope", "attempt_id": "latest"})
    assert (spans.status_code, spans.json()["items"], spans.json()["total"]) == (200, [], 0), spans.text
    assert (none.status_code, none.json()) == (200, []) and 0.1 <= waited < 2, (none.text, waited)
    assert mixed.status_code == 200 and [r["rollout_id"] for r in mixed.json()] == [known.rollout_id], mixed.text
    assert ours.status_code == 404, ours.text


FASTAPI_TELEMETRY_SCRIPT = """
import asyncio, sys
from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

exported = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exported))
trace.set_tracer_provider(provider)  # what a library in the user's process may do

from lightning.proxy.app import LLMProxy
from lightning.store.server import create_app
from lightning.store.sql import SqlLightningStore

store = SqlLightningStore(sys.argv[1], watchdog_interval=None)
apps = {"store": create_app(store), "proxy": LLMProxy(store, ["http://127.0.0.1:9/v1"]).app}
for name, app in apps.items():
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200, name
asyncio.run(store.close())
print(len(exported.get_finished_spans()))
"""


def test_servers_export_no_request_spans_of_fastapi_to_a_global_provider(tmp_path: Path) -> None:
    """FastAPI (0.150 and later) traces every request to the global tracer provider unless told not to: our servers'
    request paths carry route signatures, and each lookup of the providers cost 6% of the proxy's CPU."""
    done = subprocess.run(
        [sys.executable, "-c", FASTAPI_TELEMETRY_SCRIPT, f"sqlite:///{tmp_path / 'store.db'}"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "0"
