"""OTLP/HTTP trace ingestion: `POST /v1/traces` (protobuf or JSON, gzip) turns OTLP spans into store spans."""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

from lightning import semconv
from lightning.store.base import LightningStore
from lightning.types import Event, Link, OtelResource, Span, SpanContext, TraceStatus

MAX_OTLP_BYTES = 64 * 1024 * 1024
"""Largest OTLP payload accepted, after gunzip (a guard against compressed bombs)."""
PROTOBUF = "application/x-protobuf"

_OTLP_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}
_ROLLOUT_ID_KEYS = (semconv.ROLLOUT_ID, semconv.PEER_ROLLOUT_ID)
_ATTEMPT_ID_KEYS = (semconv.ATTEMPT_ID, semconv.PEER_ATTEMPT_ID)
_SEQUENCE_ID_KEYS = (semconv.SPAN_SEQUENCE_ID, semconv.PEER_SPAN_SEQUENCE_ID)
_PARENT_IS_REMOTE = 0x200  # SpanFlags: bit 8 says the flag is known, bit 9 is its value


class OtlpError(Exception):
    """A request this route refuses: answered with `status_code` (400 unless told) and this message."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


def add_otlp_route(app: FastAPI, store: LightningStore) -> None:
    """POST /v1/traces on `app`: OTLP/HTTP spans (protobuf or JSON) into `store`."""
    body_doc = {
        "requestBody": {
            "required": True,
            "content": {
                PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
                "application/json": {"schema": {"type": "object", "description": "OTLP JSON encoding"}},
            },
        }
    }

    @app.post("/v1/traces", tags=["otlp"], openapi_extra=body_doc, response_class=Response)
    async def export_traces(request: Request) -> Response:
        """OTLP/HTTP trace export. Each span needs the resource (or span) attributes `lightning.rollout_id`
        and `lightning.attempt_id` (`agentlightning.*` also accepted); `lightning.span_sequence_id` is optional."""
        is_json = request.headers.get("content-type", "").split(";")[0].strip().lower() == "application/json"
        try:
            message = _parse_otlp(await _otlp_body(request), is_json)
            spans = await _spans_from_otlp(store, message)
        except OtlpError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=exc.status_code)
        if spans:
            await store.add_many_spans(spans)
        if is_json:
            return Response(b"{}", media_type="application/json")
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type=PROTOBUF)


async def _read_body(request: Request) -> bytes:
    """The body, refused (413) past the app's `max_body_bytes` (set by `create_app`), by declared length or as read."""
    limit = request.app.state.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise OtlpError(f"the request body is {int(declared):,} bytes; this server takes at most {limit:,}", 413)
    body = await request.body()
    if len(body) > limit:
        raise OtlpError(f"the request body is {len(body):,} bytes; this server takes at most {limit:,}", 413)
    return body


async def _otlp_body(request: Request) -> bytes:
    body = await _read_body(request)
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding == "identity":
        return body
    if encoding != "gzip":
        raise OtlpError(f"unsupported Content-Encoding {encoding!r}; send gzip or none")
    try:
        # wbits 16+MAX_WBITS reads the gzip header; max_length stops a compressed bomb.
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        data = inflater.decompress(body, MAX_OTLP_BYTES)
    except zlib.error as exc:
        raise OtlpError(f"body is not valid gzip: {exc}") from None
    if inflater.unconsumed_tail:
        raise OtlpError(f"OTLP payload larger than {MAX_OTLP_BYTES} bytes once decompressed")
    return data


def _parse_otlp(body: bytes, is_json: bool) -> ExportTraceServiceRequest:
    message = ExportTraceServiceRequest()
    if not body:
        return message
    if not is_json:
        try:
            message.ParseFromString(body)
        except DecodeError as exc:
            raise OtlpError(f"body is not an OTLP ExportTraceServiceRequest protobuf: {exc}") from None
        return message
    try:
        document = json.loads(body)
        _hex_ids_to_base64(document)
        json_format.ParseDict(document, message, ignore_unknown_fields=True)
    except (ValueError, TypeError, AttributeError, json_format.ParseError) as exc:
        raise OtlpError(f"body is not OTLP JSON: {exc}") from None
    return message


def _hex_ids_to_base64(document: dict[str, Any]) -> None:
    """OTLP JSON writes trace and span ids in hex where protobuf's JSON mapping expects base64."""
    for resource_spans in document.get("resourceSpans") or document.get("resource_spans") or []:
        for scope_spans in resource_spans.get("scopeSpans") or resource_spans.get("scope_spans") or []:
            for span in scope_spans.get("spans") or []:
                _convert_ids(span, ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"))
                for link in span.get("links") or []:
                    _convert_ids(link, ("traceId", "spanId", "trace_id", "span_id"))


def _convert_ids(holder: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = holder.get(key)
        if isinstance(value, str) and value:
            try:
                holder[key] = base64.b64encode(bytes.fromhex(value)).decode()
            except ValueError:
                raise OtlpError(f"{key} {value!r} is not hexadecimal") from None


async def _spans_from_otlp(store: LightningStore, message: ExportTraceServiceRequest) -> list[Span]:
    spans: list[Span] = []
    for resource_spans in message.resource_spans:
        resource_attributes = _attributes(resource_spans.resource.attributes)
        resource = OtelResource(attributes=resource_attributes, schema_url=resource_spans.schema_url)
        for scope_spans in resource_spans.scope_spans:
            for proto in scope_spans.spans:
                attributes = _attributes(proto.attributes)
                spans.append(_span(proto, attributes, resource_attributes, resource))
    # Spans sent without a sequence id get one now, all in one call; -1 marks them.
    unnumbered = [span for span in spans if span.sequence_id < 0]
    if unnumbered:
        pairs = [(span.rollout_id, span.attempt_id) for span in unnumbered]
        for span, sequence_id in zip(unnumbered, await store.get_many_span_sequence_ids(pairs), strict=True):
            span.sequence_id = sequence_id
    return spans


def _span(proto: ProtoSpan, attributes: dict[str, Any], resource_attributes: dict[str, Any], resource: Any) -> Span:
    trace_id, span_id = proto.trace_id.hex(), proto.span_id.hex()
    parent_id = proto.parent_span_id.hex() or None

    def lookup(keys: tuple[str, ...]) -> Any:
        # A span's own attribute wins over its resource's.
        for source in (attributes, resource_attributes):
            for key in keys:
                if source.get(key) not in (None, ""):
                    return source[key]
        return None

    rollout_id, attempt_id = lookup(_ROLLOUT_ID_KEYS), lookup(_ATTEMPT_ID_KEYS)
    for value, keys in ((rollout_id, _ROLLOUT_ID_KEYS), (attempt_id, _ATTEMPT_ID_KEYS)):
        if value is None:
            raise OtlpError(
                f"span {proto.name!r} ({span_id}) has no {keys[0]} resource attribute (nor {keys[1]}); "
                "set it on the exporter's Resource so the store knows the rollout attempt"
            )
    return Span(
        rollout_id=str(rollout_id),
        attempt_id=str(attempt_id),
        sequence_id=_sequence_id(lookup(_SEQUENCE_ID_KEYS)),
        trace_id=trace_id,
        span_id=span_id,
        parent_id=parent_id,
        name=proto.name,
        status=TraceStatus(
            status_code=_OTLP_STATUS.get(proto.status.code, "UNSET"), description=proto.status.message or None
        ),
        attributes=attributes,
        events=[
            Event(name=e.name, attributes=_attributes(e.attributes), timestamp=_seconds(e.time_unix_nano))
            for e in proto.events
        ],
        links=[
            Link(
                context=SpanContext(trace_id=link.trace_id.hex(), span_id=link.span_id.hex(), is_remote=False),
                attributes=_attributes(link.attributes),
            )
            for link in proto.links
        ],
        start_time=_seconds(proto.start_time_unix_nano),
        end_time=_seconds(proto.end_time_unix_nano),
        context=SpanContext(trace_id=trace_id, span_id=span_id, trace_state=_trace_state(proto.trace_state)),
        parent=None
        if parent_id is None
        else SpanContext(trace_id=trace_id, span_id=parent_id, is_remote=bool(proto.flags & _PARENT_IS_REMOTE)),
        resource=resource,
    )


def _sequence_id(value: Any) -> int:
    if value is None:
        return -1
    try:
        sequence_id = int(value)
    except (TypeError, ValueError):
        raise OtlpError(f"{semconv.SPAN_SEQUENCE_ID} must be an integer, got {value!r}") from None
    if sequence_id < 1:
        raise OtlpError(f"{semconv.SPAN_SEQUENCE_ID} must be >= 1, got {sequence_id}")
    return sequence_id


def _seconds(nanoseconds: int) -> float | None:
    return nanoseconds / 1e9 if nanoseconds else None


def _trace_state(header: str) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in header.split(",") if "=" in item)
    return {key.strip(): value.strip() for key, value in pairs}


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()  # JSON has no bytes; OTLP JSON uses base64 too
    return None if kind is None else getattr(value, kind)
