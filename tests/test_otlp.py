"""OTLP/HTTP trace ingestion at /v1/traces, against the stock OpenTelemetry OTLP/HTTP exporter and raw requests:
spans land in the store; a span the store cannot take is rejected alone (200 with partial_success); gzip and
deflate; every error a google.rpc.Status in the request's encoding (the OTLP/HTTP specification's rules)."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
from conftest import serving
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Status
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.sdk.resources import Resource as SdkResource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightning.store import SqlLightningStore
from lightning.store import otlp as otlp_module
from lightning.store.server import create_app

TOKEN = "s3cret-token"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
CHILD_ID = "00f067aa0ba902b7"
PROTOBUF = {"content-type": "application/x-protobuf"}


@pytest.fixture
async def sql_store(tmp_path: Path) -> AsyncIterator[SqlLightningStore]:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 'store.db'}", watchdog_interval=None)
    yield store
    await store.close()


@pytest.fixture
def served(sql_store: SqlLightningStore) -> Iterator[str]:
    """The store server on a real port, for the exporter."""
    with serving(create_app(sql_store)) as url:
        yield url


def asgi_client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://store")


def status_of(answer: httpx.Response | requests.Response) -> status_pb2.Status:
    """The google.rpc.Status of an error answer, in whichever encoding it came."""
    status = status_pb2.Status()
    if answer.headers["content-type"] == "application/json":
        from google.protobuf import json_format

        json_format.Parse(answer.content, status)
    else:
        assert answer.headers["content-type"] == "application/x-protobuf"
        status.ParseFromString(answer.content)
    return status


def violations(status: status_pb2.Status) -> dict[str, str]:
    bad_request = error_details_pb2.BadRequest()
    (detail,) = status.details
    assert detail.Unpack(bad_request)
    return {violation.field: violation.description for violation in bad_request.field_violations}


# --- spans made by hand -----------------------------------------------------------------------


def _kv(key: str, value: Any) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    if isinstance(value, list):
        return KeyValue(key=key, value=AnyValue(array_value=ArrayValue(values=[_kv("", v).value for v in value])))
    return KeyValue(key=key, value=AnyValue(string_value=value))


def otlp_protobuf(resource: dict[str, Any], *spans: ProtoSpan) -> bytes:
    request = ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=Resource(attributes=[_kv(k, v) for k, v in resource.items()]),
                scope_spans=[ScopeSpans(spans=list(spans))],
            )
        ]
    )
    return request.SerializeToString()


def proto_span(name: str, span_id: str, parent_id: str = "", **attributes: Any) -> ProtoSpan:
    return ProtoSpan(
        trace_id=bytes.fromhex(TRACE_ID),
        span_id=bytes.fromhex(span_id),
        parent_span_id=bytes.fromhex(parent_id),
        name=name,
        start_time_unix_nano=1_700_000_000_000_000_000,
        end_time_unix_nano=1_700_000_000_500_000_000,
        attributes=[_kv(k, v) for k, v in attributes.items()],
        events=[ProtoSpan.Event(name="reward", time_unix_nano=1_700_000_000_400_000_000, attributes=[_kv("v", 1.0)])],
        status=Status(code=Status.STATUS_CODE_ERROR, message="boom"),
    )


async def test_otlp_protobuf_spans_land_in_the_store(sql_store: SqlLightningStore) -> None:
    got = await sql_store.start_rollout("task")
    rid, aid = got.rollout_id, got.attempt.attempt_id
    body = otlp_protobuf(
        {"service.name": "agent", "lightning.rollout_id": rid, "lightning.attempt_id": aid},
        proto_span("agent.run", PARENT_ID, **{"lightning.span_sequence_id": 7}),
        proto_span("openai.chat", CHILD_ID, PARENT_ID, model="m", tokens=[1, 2, 3], temperature=0.5, stream=False),
    )
    async with asgi_client(create_app(sql_store)) as http:
        answer = await http.post(
            "/v1/traces",
            content=gzip.compress(body),
            headers={
                "content-type": "application/x-protobuf",
                "content-encoding": "gzip",
            },
        )
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/x-protobuf"
    assert ExportTraceServiceResponse.FromString(answer.content) == ExportTraceServiceResponse()

    parent, child = await sql_store.query_spans(rid, sort_by="name")
    assert (parent.name, parent.span_id, parent.parent_id, parent.sequence_id) == ("agent.run", PARENT_ID, None, 7)
    assert (child.name, child.span_id, child.parent_id, child.trace_id) == (
        "openai.chat",
        CHILD_ID,
        PARENT_ID,
        TRACE_ID,
    )
    assert (child.rollout_id, child.attempt_id) == (rid, aid)
    assert child.sequence_id not in (7, parent.sequence_id) and child.sequence_id >= 1
    assert child.attributes == {"model": "m", "tokens": [1, 2, 3], "temperature": 0.5, "stream": False}
    assert (child.status.status_code, child.status.description) == ("ERROR", "boom")
    assert (child.start_time, child.end_time) == (1_700_000_000.0, 1_700_000_000.5)
    assert [(e.name, e.attributes, e.timestamp) for e in child.events] == [("reward", {"v": 1.0}, 1_700_000_000.4)]
    assert child.resource.attributes["service.name"] == "agent"
    assert (await sql_store.get_latest_attempt(rid)).status == "running"


async def test_otlp_json_spans_land_in_the_store(sql_store: SqlLightningStore) -> None:
    got = await sql_store.start_rollout("task")
    rid, aid = got.rollout_id, got.attempt.attempt_id
    document = {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [
                        {"key": "agentlightning.rollout_id", "value": {"stringValue": rid}},
                        {"key": "agentlightning.attempt_id", "value": {"stringValue": aid}},
                    ]
                },
                "scopeSpans": [
                    {
                        "scope": {"name": "hand-made"},
                        "spans": [
                            {
                                "traceId": TRACE_ID,
                                "spanId": CHILD_ID,
                                "parentSpanId": PARENT_ID,
                                "name": "tool.call",
                                "kind": 1,
                                "startTimeUnixNano": "1700000000000000000",
                                "endTimeUnixNano": "1700000001000000000",
                                "attributes": [
                                    {"key": "count", "value": {"intValue": "42"}},
                                    {"key": "ratio", "value": {"doubleValue": 0.25}},
                                    {"key": "ok", "value": {"boolValue": True}},
                                ],
                                "links": [{"traceId": TRACE_ID, "spanId": PARENT_ID}],
                                "status": {"code": 1},
                                "someFutureField": {"ignored": True},
                            }
                        ],
                    }
                ],
            }
        ]
    }
    async with asgi_client(create_app(sql_store)) as http:
        answer = await http.post("/v1/traces", json=document)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == {}

    (span,) = await sql_store.query_spans(rid)
    assert (span.name, span.trace_id, span.span_id, span.parent_id) == ("tool.call", TRACE_ID, CHILD_ID, PARENT_ID)
    assert (span.rollout_id, span.attempt_id, span.sequence_id) == (rid, aid, 1)
    assert span.attributes == {"count": 42, "ratio": 0.25, "ok": True}
    assert span.status.status_code == "OK"
    assert (span.start_time, span.end_time) == (1_700_000_000.0, 1_700_000_001.0)
    assert [(link.context.trace_id, link.context.span_id) for link in span.links] == [(TRACE_ID, PARENT_ID)]


async def test_garbage_and_an_all_rejected_request_are_400s_with_a_status(sql_store: SqlLightningStore) -> None:
    got = await sql_store.start_rollout("task")
    body = otlp_protobuf({"lightning.attempt_id": got.attempt.attempt_id}, proto_span("orphan", CHILD_ID))
    async with asgi_client(create_app(sql_store)) as http:
        answer = await http.post("/v1/traces", content=body, headers=PROTOBUF)
        garbage = await http.post("/v1/traces", content=b"\xff\xff", headers=PROTOBUF)
        not_json = await http.post("/v1/traces", content=b"{nope", headers={"content-type": "application/json"})
    # Every span rejected: nothing was accepted, so not a partial success but "Bad Data", a 400 (not retried).
    assert answer.status_code == 400
    status = status_of(answer)
    assert "1 of 1 spans rejected" in status.message and "lightning.rollout_id" in status.message
    assert "orphan" in status.message and "OTEL_RESOURCE_ATTRIBUTES" in status.message
    assert list(violations(status)) == ["resource_spans[0].scope_spans[0].spans[0]"]
    assert garbage.status_code == 400
    assert "ExportTraceServiceRequest" in status_of(garbage).message
    assert not_json.status_code == 400 and not_json.headers["content-type"] == "application/json"
    assert not_json.json()["message"].startswith("body is not OTLP JSON")
    assert await sql_store.query_spans(got.rollout_id) == []


async def test_a_partial_success_in_json_keeps_the_good_spans(sql_store: SqlLightningStore) -> None:
    got = await sql_store.start_rollout("task")
    rid, aid = got.rollout_id, got.attempt.attempt_id

    def span(name: str, span_id: str, **ids: str) -> dict[str, Any]:
        attributes = [{"key": key, "value": {"stringValue": value}} for key, value in ids.items()]
        return {"traceId": TRACE_ID, "spanId": span_id, "name": name, "attributes": attributes}

    document = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "lightning.rollout_id", "value": {"stringValue": rid}}]},
                "scopeSpans": [
                    {
                        "spans": [
                            span("kept", PARENT_ID, **{"lightning.attempt_id": aid}),
                            span("no-attempt", CHILD_ID),
                        ]
                    }
                ],
            }
        ]
    }
    async with asgi_client(create_app(sql_store)) as http:
        answer = await http.post(
            "/v1/traces",
            content=gzip.compress(json.dumps(document).encode()),
            headers={"content-type": "application/json", "content-encoding": "gzip"},
        )
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    partial = answer.json()["partialSuccess"]  # the proto3 JSON mapping: lowerCamelCase, int64 as a string
    assert partial["rejectedSpans"] == "1"
    assert partial["errorMessage"].startswith("1 of 2 spans rejected: no lightning.attempt_id attribute")
    assert f"'no-attempt' ({CHILD_ID})" in partial["errorMessage"]
    assert [span.name for span in await sql_store.query_spans(rid)] == ["kept"]


# --- the stock OpenTelemetry OTLP/HTTP exporter -----------------------------------------------


def recorded_spans(resource: dict[str, Any], *spans: tuple[str, dict[str, Any]]) -> list[ReadableSpan]:
    """Spans made by the OpenTelemetry SDK under `resource`: (name, attributes) each."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=SdkResource(resource))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("tests")
    for name, attributes in spans:
        with tracer.start_as_current_span(name, attributes=attributes):
            pass
    provider.shutdown()
    return list(memory.get_finished_spans())


class Exporter:
    """OTLPSpanExporter to the store server, with what the server answered it kept in `answers`."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        self.answers: list[requests.Response] = []
        session = requests.Session()
        session.trust_env = False  # no proxy from the environment between us and 127.0.0.1
        session.hooks["response"].append(lambda response, *_, **__: self.answers.append(response))
        self.exporter = OTLPSpanExporter(endpoint=f"{url}/v1/traces", session=session, timeout=10, **kwargs)

    async def export(self, spans: list[ReadableSpan]) -> SpanExportResult:
        try:
            return await asyncio.to_thread(self.exporter.export, spans)
        finally:
            self.exporter.shutdown()


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip, Compression.Deflate])
async def test_the_exporter_s_spans_land_in_the_store(
    sql_store: SqlLightningStore, served: str, compression: Compression
) -> None:
    got = await sql_store.start_rollout("task")
    rid, aid = got.rollout_id, got.attempt.attempt_id
    spans = recorded_spans(
        {"service.name": "agent", "lightning.rollout_id": rid, "lightning.attempt_id": aid},
        ("plan", {"step": 1}),
        ("act", {"tool": "search"}),
    )
    exporter = Exporter(served, compression=compression)
    assert await exporter.export(spans) is SpanExportResult.SUCCESS
    (answer,) = exporter.answers
    assert answer.headers["content-type"] == "application/x-protobuf"
    # Full success: partial_success left unset.
    assert not ExportTraceServiceResponse.FromString(answer.content).HasField("partial_success")
    stored = await sql_store.query_spans(rid)
    assert [(span.name, span.attributes) for span in stored] == [("plan", {"step": 1}), ("act", {"tool": "search"})]
    assert [span.sequence_id for span in stored] == [1, 2]
    assert stored[0].resource.attributes["service.name"] == "agent"


async def test_the_exporter_gets_a_partial_success_naming_each_problem(
    sql_store: SqlLightningStore, served: str
) -> None:
    got = await sql_store.start_rollout("task")
    rid, aid = got.rollout_id, got.attempt.attempt_id
    ids = {"lightning.rollout_id": rid, "lightning.attempt_id": aid}
    spans = [
        *recorded_spans(ids, ("good-1", {}), ("bad-sequence-id", {"lightning.span_sequence_id": "soon"})),
        *recorded_spans({"service.name": "forgot-the-ids"}, ("orphan", {})),
        *recorded_spans({"lightning.rollout_id": rid, "lightning.attempt_id": "at-gone"}, ("stale", {})),
        # The span's own attributes name the attempt, where the resource does not.
        *recorded_spans({"service.name": "shared"}, ("good-2", ids)),
    ]
    exporter = Exporter(served)
    # 200: the exporter counts it a success and does not send it again (OTLP: no retry of a partial success).
    assert await exporter.export(spans) is SpanExportResult.SUCCESS
    (answer,) = exporter.answers
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/x-protobuf"
    partial = ExportTraceServiceResponse.FromString(answer.content).partial_success
    assert partial.rejected_spans == 3
    message = partial.error_message
    assert message.startswith("3 of 5 spans rejected: ")
    assert (
        "lightning.span_sequence_id must be an integer >= 1, got 'soon'" in message and "'bad-sequence-id'" in message
    )
    assert "no lightning.rollout_id nor lightning.attempt_id attribute" in message and "'orphan'" in message
    assert "OTEL_RESOURCE_ATTRIBUTES" in message
    assert "no attempt 'at-gone'" in message and "'stale'" in message
    assert sorted(span.name for span in await sql_store.query_spans(rid)) == ["good-1", "good-2"]


async def test_the_exporter_is_refused_without_the_token_in_protobuf(sql_store: SqlLightningStore) -> None:
    got = await sql_store.start_rollout("task")
    spans = recorded_spans(
        {"lightning.rollout_id": got.rollout_id, "lightning.attempt_id": got.attempt.attempt_id}, ("x", {})
    )
    with serving(create_app(sql_store, token=TOKEN)) as url:
        anonymous = Exporter(url)
        assert await anonymous.export(spans) is SpanExportResult.FAILURE
        with_token = Exporter(url, headers={"authorization": f"Bearer {TOKEN}"})
        assert await with_token.export(spans) is SpanExportResult.SUCCESS
    (refused,) = anonymous.answers  # a 401 is not retried
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    status = status_of(refused)
    assert "bearer token" in status.message and "OTEL_EXPORTER_OTLP_HEADERS" in status.message
    assert TOKEN not in refused.text
    assert [span.name for span in await sql_store.query_spans(got.rollout_id)] == ["x"]


# --- errors, in the request's encoding ----------------------------------------------------------


async def test_a_401_answers_in_the_request_s_encoding(sql_store: SqlLightningStore) -> None:
    async with asgi_client(create_app(sql_store, token=TOKEN)) as http:
        as_json = await http.post("/v1/traces", json={}, headers={"authorization": "Bearer wrong"})
        other_route = await http.post("/v1/store/statistics", json={})
    assert as_json.status_code == 401 and as_json.headers["content-type"] == "application/json"
    assert "bearer token" in as_json.json()["message"]
    assert other_route.status_code == 401 and "token" in other_route.json()["detail"]  # the store's own shape


async def test_compression_gzip_deflate_and_refused_encodings(sql_store: SqlLightningStore) -> None:
    got = await sql_store.start_rollout("task")
    rid, aid = got.rollout_id, got.attempt.attempt_id
    body = otlp_protobuf({"lightning.rollout_id": rid, "lightning.attempt_id": aid}, proto_span("s", CHILD_ID))
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    sent = {
        "deflate": zlib.compress(body),  # the zlib format: what RFC 9110 calls deflate
        "Deflate": raw_deflate.compress(body) + raw_deflate.flush(),  # a raw deflate stream, as some clients send
        "x-gzip": gzip.compress(body),
    }
    async with asgi_client(create_app(sql_store)) as http:
        for encoding, content in sent.items():
            answer = await http.post("/v1/traces", content=content, headers={**PROTOBUF, "content-encoding": encoding})
            assert answer.status_code == 200, (encoding, status_of(answer).message)
        brotli = await http.post("/v1/traces", content=body, headers={**PROTOBUF, "content-encoding": "br"})
        brotli_json = await http.post(
            "/v1/traces", content=b"{}", headers={"content-type": "application/json", "content-encoding": "br"}
        )
        not_gzip = await http.post("/v1/traces", content=body, headers={**PROTOBUF, "content-encoding": "gzip"})
        cut_short = await http.post(
            "/v1/traces", content=gzip.compress(body)[:-12], headers={**PROTOBUF, "content-encoding": "gzip"}
        )
    assert len(await sql_store.query_spans(rid)) == 1  # the same span id three times: stored once

    assert brotli.status_code == 415 and brotli.headers["accept-encoding"] == "gzip, deflate"
    assert status_of(brotli).message == (
        "Content-Encoding 'br' is not supported: send the body with gzip, deflate or no compression"
    )
    assert brotli_json.status_code == 415 and "'br'" in brotli_json.json()["message"]
    assert not_gzip.status_code == 400 and "not valid gzip" in status_of(not_gzip).message
    assert cut_short.status_code == 400 and "cut short" in status_of(cut_short).message


async def test_size_limits_are_413s_with_a_status(
    sql_store: SqlLightningStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(otlp_module, "MAX_OTLP_BYTES", 10_000)  # the cap once decompressed
    async with asgi_client(create_app(sql_store, max_body_bytes=10_000)) as http:
        too_big = await http.post("/v1/traces", content=b"\0" * 20_000, headers=PROTOBUF)
        bomb = await http.post(
            "/v1/traces", content=gzip.compress(b"\0" * 20_000), headers={**PROTOBUF, "content-encoding": "gzip"}
        )
    assert too_big.status_code == 413 and "at most 10,000" in status_of(too_big).message
    assert bomb.status_code == 413 and "larger than 10,000 bytes once decompressed" in status_of(bomb).message


async def test_other_content_types_and_a_store_that_cannot_serve(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 'store.db'}", watchdog_interval=None)
    got = await store.start_rollout("task")
    body = otlp_protobuf(
        {"lightning.rollout_id": got.rollout_id, "lightning.attempt_id": got.attempt.attempt_id},
        proto_span("s", CHILD_ID),
    )
    async with asgi_client(create_app(store)) as http:
        text = await http.post("/v1/traces", content=b"hello", headers={"content-type": "text/plain"})
        await store.close()
        closed = await http.post("/v1/traces", content=body, headers=PROTOBUF)
    assert text.status_code == 415 and text.headers["content-type"] == "application/json"
    assert text.json()["message"] == (
        "Content-Type 'text/plain' is not an OTLP encoding: send application/x-protobuf or application/json"
    )
    assert closed.status_code == 503  # OTLP clients retry a 503
    assert "closed" in status_of(closed).message
