"""The store over HTTP: `POST /v1/store/<method>` for every request of `lightning.store.contract` (the request
model is the body, its `response` the answer), plus OTLP/HTTP trace ingestion at /v1/traces."""

from __future__ import annotations

import base64
import json
import logging
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

from lightning import semconv
from lightning.serving import BearerAuth
from lightning.store import contract
from lightning.store.agl_routes import PathToken, agl_routes
from lightning.store.base import LightningStore, describe_validation_error
from lightning.store.contract import MAX_WAIT_SECONDS, REQUESTS
from lightning.store.errors import BodyTooLarge, InvalidArgumentError, StoreError, http_status
from lightning.types import Event, Link, OtelResource, Span, SpanContext, TraceStatus

logger = logging.getLogger(__name__)

DISCONNECT_CHECK_SECONDS = 1.0
"""A waiting dequeue looks this often whether its client is gone, so it claims nothing for nobody."""
MAX_OTLP_BYTES = 64 * 1024 * 1024
"""Largest OTLP payload accepted, after gunzip (a guard against compressed bombs)."""
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
"""Largest request body accepted (413 beyond): a rollout's input or a batch of spans is far smaller."""
PROTOBUF = "application/x-protobuf"


# --- errors -----------------------------------------------------------------------------------


def _error(status_code: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status_code)


def _unauthorised() -> JSONResponse:
    return JSONResponse(
        {"detail": "missing or wrong bearer token (Authorization: Bearer <token>)"},
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


async def read_body(request: Request) -> bytes:
    """The request's body, refused (BodyTooLarge) past the app's `max_body_bytes`, by its declared length or as read."""
    limit = request.app.state.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the request body is {int(declared):,} bytes; this server takes at most {limit:,}")
    body = await request.body()
    if len(body) > limit:
        raise BodyTooLarge(f"the request body is {len(body):,} bytes; this server takes at most {limit:,}")
    return body


class _StoreRoute(APIRoute):
    """A route whose endpoint takes `body` (a request model) and `request`. FastAPI builds the OpenAPI schema from
    that signature as usual; a request takes a shorter path than FastAPI's own (a quarter of a millisecond less
    per call): pydantic validates the body straight from the JSON bytes and dumps the answer straight to JSON
    bytes. Every error becomes status code + message; tracebacks stay in the server log."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        body_model: type[pydantic.BaseModel] | None = self.endpoint.__annotations__.get("body")
        answer = pydantic.TypeAdapter(Any if self.response_model is None else self.response_model)
        endpoint = self.endpoint

        async def handle(request: Request) -> Response:
            try:
                arguments: dict[str, Any] = {"request": request}
                if body_model is not None:
                    arguments["body"] = body_model.model_validate_json(await read_body(request) or b"{}")
                result = await endpoint(**arguments)
                if isinstance(result, Response):
                    return result
                return Response(answer.dump_json(result), media_type="application/json")
            except pydantic.ValidationError as exc:
                return _error(422, describe_validation_error(exc, "body"))
            except StoreError as exc:
                return _error(http_status(exc), str(exc))
            except Exception:
                logger.exception("unexpected error in %s %s", request.method, request.url.path)
                return _error(500, "internal server error; see the store server's log")

        return handle


# --- the app ----------------------------------------------------------------------------------


def create_app(
    store: LightningStore, *, token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> FastAPI:
    """The HTTP face of `store`. With `token`, every request needs `Authorization: Bearer <token>`; a body over
    `max_body_bytes` is answered 413.

    The app does not close the store: whoever opened it does (`lightning store serve` on shutdown)."""
    app = FastAPI(
        title="lightning store",
        description="The store protocol (lightning.store.contract) over HTTP, and OTLP/HTTP traces.",
        version="1",
    )
    app.state.store = store
    app.state.max_body_bytes = max_body_bytes
    # Routes go on the app itself: through include_router, FastAPI's route matching costs 0.15 ms a request.
    app.router.route_class = _StoreRoute

    @app.get("/health", tags=["health"])
    async def health(request: Request) -> dict[str, Any]:
        """The store answers: its statistics."""
        return {"status": "ok", "statistics": await store.statistics()}

    for request_type in REQUESTS:
        app.router.add_api_route(
            f"/v1/store/{request_type.method}",
            _endpoint(store, request_type),
            methods=["POST"],
            response_model=request_type.response,
            tags=[_tag(request_type.method)],
            description=request_type.__doc__,
        )
    # agent-lightning 0.3's wire (/v1/agl/...), for its own client and runners.
    app.router.routes.extend(agl_routes(store, read_body))
    _add_otlp_route(app, store)
    if token is not None:
        if not token:
            raise InvalidArgumentError("token must be a non-empty string, or None for no authentication")
        app.add_middleware(BearerAuth, token=token, refusal=_unauthorised)
        app.add_middleware(PathToken)  # outermost: /t/<token>/... becomes a bearer token before the check
    return app


def _endpoint(store: LightningStore, request_type: type[contract.Request]) -> Callable[..., Awaitable[Any]]:
    """The route of one store method: the body is its request, handed to the store; waits are capped per request."""

    async def endpoint(body: contract.Request, request: Request) -> Any:
        if isinstance(body, contract.DequeueRollout | contract.DequeueRollouts):
            return await _dequeue(store, body, request)
        if isinstance(body, contract.WaitForRollouts):
            timeout = MAX_WAIT_SECONDS if body.timeout is None else min(body.timeout, MAX_WAIT_SECONDS)
            body = body.model_copy(update={"timeout": timeout})
        return await store.handle(body)

    endpoint.__name__ = request_type.method
    endpoint.__doc__ = request_type.__doc__
    endpoint.__annotations__ = {"body": request_type, "request": Request, "return": request_type.response}
    return endpoint


def _tag(method: str) -> str:
    for tag in ("span", "attempt", "resources", "worker", "rollout"):
        if tag in method:
            return f"{tag}s".replace("resourcess", "resources")
    return "housekeeping"


async def _dequeue(
    store: LightningStore, body: contract.DequeueRollout | contract.DequeueRollouts, request: Request
) -> Any:
    """Claim rollouts, waiting up to `wait` seconds (capped) in slices: a rollout claimed for a client that has
    gone away would sit in `preparing` until the watchdog notices."""
    remaining = min(body.wait, MAX_WAIT_SECONDS)
    while True:
        slice_ = min(remaining, DISCONNECT_CHECK_SECONDS)
        claimed = await store.handle(body.model_copy(update={"wait": slice_}))
        remaining -= slice_
        if claimed or remaining <= 0 or await request.is_disconnected():
            return claimed


# --- OTLP/HTTP --------------------------------------------------------------------------------

_OTLP_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}
_ROLLOUT_ID_KEYS = (semconv.ROLLOUT_ID, semconv.PEER_ROLLOUT_ID)
_ATTEMPT_ID_KEYS = (semconv.ATTEMPT_ID, semconv.PEER_ATTEMPT_ID)
_SEQUENCE_ID_KEYS = (semconv.SPAN_SEQUENCE_ID, semconv.PEER_SPAN_SEQUENCE_ID)
_PARENT_IS_REMOTE = 0x200  # SpanFlags: bit 8 says the flag is known, bit 9 is its value


class OtlpError(Exception):
    """A malformed OTLP request: answered with 400 and this message."""


def _add_otlp_route(app: FastAPI, store: LightningStore) -> None:
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
            return _error(400, str(exc))
        if spans:
            await store.add_many_spans(spans)
        if is_json:
            return Response(b"{}", media_type="application/json")
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type=PROTOBUF)


async def _otlp_body(request: Request) -> bytes:
    body = await read_body(request)
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
