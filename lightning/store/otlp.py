"""OTLP/HTTP trace ingestion: `POST /v1/traces` turns OTLP spans into store spans.

It follows the OTLP/HTTP specification (opentelemetry-proto, docs/specification.md, "OTLP/HTTP Request" and
"OTLP/HTTP Response"):

- the body is an ExportTraceServiceRequest, binary protobuf (`application/x-protobuf`, also assumed when no
  Content-Type is given) or OTLP JSON (`application/json`); gzip or deflate Content-Encoding, or none;
- the answer has the request's Content-Type ("The server MUST use the same Content-Type in the response as it
  received in the request");
- a span the store cannot take (no rollout or attempt id, a bad sequence id, an attempt the store does not have)
  is rejected on its own: the others are stored and the answer is 200 with `partial_success` (`rejected_spans`
  and an `error_message` that says why and what to do);
- a request of which nothing can be stored (it does not decode, or every span is rejected) is "Bad Data": 400. Every
  4xx and 5xx body is a google.rpc.Status (400s with a google.rpc.BadRequest naming the spans); 503 when the store
  cannot serve now (a client retries that), 413 past the size limits.
"""

from __future__ import annotations

import base64
import json
import logging
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import Response
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect

from lightning import semconv
from lightning.serving import CLIENT_GONE
from lightning.store.base import LightningStore, describe_validation_error
from lightning.store.errors import ConflictError, InvalidArgumentError, NotFoundError, StoreError
from lightning.types import Event, Link, OtelResource, Span, SpanContext, TraceStatus

logger = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
MAX_OTLP_BYTES = 64 * 1024 * 1024
"""Largest OTLP payload accepted once decompressed (a guard against compressed bombs): 413 beyond."""
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
ACCEPTED_ENCODINGS = "gzip, deflate"

_OTLP_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}
_ROLLOUT_ID_KEYS = (semconv.ROLLOUT_ID, semconv.PEER_ROLLOUT_ID)
_ATTEMPT_ID_KEYS = (semconv.ATTEMPT_ID, semconv.PEER_ATTEMPT_ID)
_SEQUENCE_ID_KEYS = (semconv.SPAN_SEQUENCE_ID, semconv.PEER_SPAN_SEQUENCE_ID)
_PARENT_IS_REMOTE = 0x200  # SpanFlags: bit 8 says the flag is known, bit 9 is its value
_RPC_CODES = {
    400: code_pb2.INVALID_ARGUMENT,
    401: code_pb2.UNAUTHENTICATED,
    403: code_pb2.PERMISSION_DENIED,
    409: code_pb2.FAILED_PRECONDITION,
    413: code_pb2.RESOURCE_EXHAUSTED,
    415: code_pb2.INVALID_ARGUMENT,
    500: code_pb2.INTERNAL,
    503: code_pb2.UNAVAILABLE,
}
"""google.rpc.Code for each HTTP status we answer. OTLP/HTTP clients go by the HTTP status; the code is a courtesy."""
UNAUTHORISED = (
    "missing or wrong bearer token: send Authorization: Bearer <token> "
    "(an OpenTelemetry exporter: OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20<token>)"
)


class OtlpError(Exception):
    """A request this route refuses as a whole: answered with `status_code` (400 unless told), this message and
    `headers`."""

    def __init__(self, message: str, status_code: int = 400, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.headers = headers


@dataclass
class Rejection:
    """One span the store does not take, and why (`reason` is the same text for the same problem)."""

    field: str
    name: str
    span_id: str
    reason: str


class _SpanRejected(Exception):
    """Raised while converting one span: it is rejected with this reason, the rest of the request goes on."""


def add_otlp_route(app: FastAPI, store: LightningStore) -> None:
    """POST /v1/traces on `app`: OTLP/HTTP spans (protobuf or JSON) into `store`. The app's BodyLimit caps the body
    as sent (413 beyond, answered as `otlp_or` says); MAX_OTLP_BYTES caps it decompressed."""
    body_doc = {
        "requestBody": {
            "required": True,
            "content": {
                PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
                JSON: {"schema": {"type": "object", "description": "OTLP JSON encoding"}},
            },
        }
    }

    @app.post(TRACES_PATH, tags=["otlp"], openapi_extra=body_doc, response_class=Response)
    async def export_traces(request: Request) -> Response:
        """OTLP/HTTP trace export (protobuf or JSON; gzip, deflate or none). Each span needs the resource (or span)
        attributes `lightning.rollout_id` and `lightning.attempt_id` (`agentlightning.*` also accepted);
        `lightning.span_sequence_id` is optional. Spans without them are rejected one by one: the answer is 200 with
        `partial_success` saying how many and why, or 400 when no span of the request could be stored."""
        media_type = _media_type(request.headers)
        if media_type is None:
            given = request.headers.get("content-type", "")
            return status_response(
                415, f"Content-Type {given!r} is not an OTLP encoding: send {PROTOBUF} or {JSON}", JSON
            )
        try:
            message = _parse_otlp(await _otlp_body(request), media_type == JSON)
            spans, rejections, total = _spans_from_otlp(message)
            rejections += await _store_spans(store, spans)
        except OtlpError as exc:
            return status_response(exc.status_code, str(exc), media_type, headers=exc.headers)
        except ClientDisconnect:
            return status_response(400, CLIENT_GONE, media_type)
        except StoreError as exc:
            return status_response(_status_of(exc), str(exc), media_type)
        except Exception:
            logger.exception("unexpected error in POST %s", TRACES_PATH)
            return status_response(500, "internal server error; see the store server's log", media_type)
        answer = ExportTraceServiceResponse()
        if rejections:
            summary = _summary(rejections, total)
            logger.warning("OTLP export: %s", summary)
            violations = [(r.field, f"span {r.name!r} ({r.span_id}): {r.reason}") for r in rejections]
            if len(rejections) == total:
                return status_response(400, summary, media_type, violations)
            answer.partial_success.rejected_spans = len(rejections)
            answer.partial_success.error_message = summary
        return Response(_encode(answer, media_type), media_type=media_type)


def otlp_or(answer: Response, status_code: int, message: str, headers: dict[str, str] | None = None) -> Any:
    """An ASGI app that answers `answer` (a refusal in the server's own shape), but an OTLP request as OTLP/HTTP
    wants every 4xx answered: `status_code` and `message` as a google.rpc.Status in the request's encoding."""

    async def refuse(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("path") == TRACES_PATH:
            media_type = _media_type(Headers(scope=scope)) or JSON
            await status_response(status_code, message, media_type, headers=headers)(scope, receive, send)
        else:
            await answer(scope, receive, send)

    return refuse


def otlp_refusal(refusal: Callable[[], Response]) -> Callable[[], Any]:
    """An auth middleware's `refusal` (answering 401) that answers OTLP requests as `otlp_or` says."""
    return lambda: otlp_or(refusal(), 401, UNAUTHORISED, headers={"WWW-Authenticate": "Bearer"})


# --- answers ----------------------------------------------------------------------------------


def status_response(
    status_code: int,
    message: str,
    media_type: str,
    violations: Sequence[tuple[str, str]] = (),
    headers: dict[str, str] | None = None,
) -> Response:
    """An OTLP/HTTP error answer: a google.rpc.Status (with a BadRequest for `violations`) in `media_type`."""
    status = status_pb2.Status(code=_RPC_CODES.get(status_code, code_pb2.UNKNOWN), message=message)
    if violations:
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
                for field, description in violations
            ]
        )
        status.details.add().Pack(bad_request)
    return Response(_encode(status, media_type), status_code=status_code, media_type=media_type, headers=headers)


def _encode(message: Message, media_type: str) -> bytes:
    if media_type == JSON:
        # The proto3 JSON mapping OTLP/JSON uses: lowerCamelCase keys, 64-bit integers as strings.
        return json_format.MessageToJson(message, indent=None).encode()
    return message.SerializeToString()


def _media_type(headers: Headers) -> str | None:
    """PROTOBUF or JSON by the Content-Type (PROTOBUF when none is given), or None for any other."""
    given = headers.get("content-type", "").split(";")[0].strip().lower()
    if given in ("", PROTOBUF):
        return PROTOBUF
    return JSON if given == JSON else None


def _status_of(exc: StoreError) -> int:
    if isinstance(exc, InvalidArgumentError | NotFoundError):
        return 400  # "Bad Data": permanent, not retried
    if isinstance(exc, ConflictError):
        return 409
    return 503  # the store is there but cannot serve now: OTLP clients retry a 503


def _summary(rejections: list[Rejection], total: int) -> str:
    """`N of M spans rejected: <reason> (spans 'a' (id), ...); <reason> (...)`: each reason once, a few spans each."""
    by_reason: dict[str, list[Rejection]] = {}
    for rejection in rejections:
        by_reason.setdefault(rejection.reason, []).append(rejection)
    parts = []
    for reason, group in by_reason.items():
        named = ", ".join(f"{r.name!r} ({r.span_id})" for r in group[:3])
        more = f" and {len(group) - 3} more" if len(group) > 3 else ""
        parts.append(f"{reason} [{'span' if len(group) == 1 else 'spans'} {named}{more}]")
    return f"{len(rejections)} of {total} spans rejected: " + "; ".join(parts)


# --- the request ------------------------------------------------------------------------------


async def _otlp_body(request: Request) -> bytes:
    """The body, decompressed by its Content-Encoding: gzip, deflate (zlib format, or raw as some clients send it)
    or none."""
    body = await request.body()
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity") or not body:
        return body
    if encoding in ("gzip", "x-gzip"):
        return _inflate(body, 16 + zlib.MAX_WBITS, "gzip")  # wbits 16+: a gzip header and trailer
    if encoding == "deflate":
        # RFC 9110's "deflate" is the zlib format (what OpenTelemetry's exporters send); some clients send a raw
        # deflate stream, told apart by the zlib header: compression method 8, and a multiple of 31 in two bytes.
        is_zlib = len(body) >= 2 and body[0] & 0x0F == 8 and ((body[0] << 8) | body[1]) % 31 == 0
        return _inflate(body, zlib.MAX_WBITS if is_zlib else -zlib.MAX_WBITS, "deflate")
    raise OtlpError(
        f"Content-Encoding {encoding!r} is not supported: send the body with gzip, deflate or no compression",
        415,
        headers={"Accept-Encoding": ACCEPTED_ENCODINGS},
    )


def _inflate(body: bytes, wbits: int, encoding: str) -> bytes:
    inflater = zlib.decompressobj(wbits)
    try:
        data = inflater.decompress(body, MAX_OTLP_BYTES)  # max_length stops a compressed bomb
    except zlib.error as exc:
        raise OtlpError(f"the body is not valid {encoding} data (Content-Encoding: {encoding}): {exc}") from None
    if inflater.unconsumed_tail:
        raise OtlpError(f"the OTLP payload is larger than {MAX_OTLP_BYTES:,} bytes once decompressed", 413)
    if not inflater.eof:
        raise OtlpError(f"the body ends before its {encoding} data does (Content-Encoding: {encoding}): cut short?")
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


def _spans_from_otlp(message: ExportTraceServiceRequest) -> tuple[list[tuple[str, Span]], list[Rejection], int]:
    """The request's spans as store spans (sequence id -1 where none was sent), each with its place in the request;
    the spans rejected; and how many spans the request held."""
    spans: list[tuple[str, Span]] = []
    rejections: list[Rejection] = []
    total = 0
    for r, resource_spans in enumerate(message.resource_spans):
        resource_attributes = _attributes(resource_spans.resource.attributes)
        resource = OtelResource(attributes=resource_attributes, schema_url=resource_spans.schema_url)
        for s, scope_spans in enumerate(resource_spans.scope_spans):
            for i, proto in enumerate(scope_spans.spans):
                total += 1
                field = f"resource_spans[{r}].scope_spans[{s}].spans[{i}]"
                try:
                    spans.append((field, _span(proto, _attributes(proto.attributes), resource_attributes, resource)))
                except _SpanRejected as exc:
                    rejections.append(Rejection(field, proto.name, proto.span_id.hex(), str(exc)))
    return spans, rejections, total


async def _store_spans(store: LightningStore, spans: list[tuple[str, Span]]) -> list[Rejection]:
    """Number the spans sent without a sequence id and store them all; the spans rejected because the store has no
    such attempt. One pair of store calls for the whole request, unless some attempt is missing: then one pair per
    attempt, so the spans of the others are stored."""
    try:
        await _number_and_add(store, [span for _, span in spans])
        return []
    except NotFoundError:
        pass
    by_attempt: dict[tuple[str, str], list[tuple[str, Span]]] = {}
    for field, span in spans:
        by_attempt.setdefault((span.rollout_id, span.attempt_id), []).append((field, span))
    rejections = []
    for (rollout_id, attempt_id), group in by_attempt.items():
        try:
            await _number_and_add(store, [span for _, span in group])
        except NotFoundError:
            reason = (
                f"the store has no attempt {attempt_id!r} in rollout {rollout_id!r}: send the ids of an attempt the "
                "store started (a runner's trace context has them)"
            )
            rejections += [Rejection(field, span.name, span.span_id, reason) for field, span in group]
    return rejections


async def _number_and_add(store: LightningStore, spans: list[Span]) -> None:
    unnumbered = [span for span in spans if span.sequence_id < 0]
    if unnumbered:
        pairs = [(span.rollout_id, span.attempt_id) for span in unnumbered]
        for span, sequence_id in zip(unnumbered, await store.get_many_span_sequence_ids(pairs), strict=True):
            span.sequence_id = sequence_id
    if spans:
        await store.add_many_spans(spans)


def _span(proto: ProtoSpan, attributes: dict[str, Any], resource_attributes: dict[str, Any], resource: Any) -> Span:
    """The store span of an OTLP span; raises _SpanRejected, saying why and what to do, for one it cannot take."""
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
    found = ((rollout_id, semconv.ROLLOUT_ID), (attempt_id, semconv.ATTEMPT_ID))
    missing = [key for value, key in found if value is None]
    if missing:
        names = " nor ".join(missing)
        raise _SpanRejected(
            f"no {names} attribute (the agentlightning.* names count too): set {' and '.join(missing)} on the "
            "exporter's Resource (Resource.create({...}) or OTEL_RESOURCE_ATTRIBUTES) or on the span, to the ids of "
            "the rollout attempt it belongs to"
        )
    try:
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
    except pydantic.ValidationError as exc:
        raise _SpanRejected(f"not a span the store can hold: {describe_validation_error(exc, 'span')}") from None


def _sequence_id(value: Any) -> int:
    if value is None:
        return -1
    try:
        sequence_id = int(value)
    except (TypeError, ValueError):
        sequence_id = 0
    if isinstance(value, bool) or sequence_id < 1:
        raise _SpanRejected(
            f"{semconv.SPAN_SEQUENCE_ID} must be an integer >= 1, got {value!r}: send one, or leave it out and the "
            "store numbers the span"
        )
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
