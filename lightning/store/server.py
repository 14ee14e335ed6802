"""The store over HTTP: one FastAPI route per store method, plus OTLP/HTTP trace ingestion at /v1/traces."""

from __future__ import annotations

import base64
import hmac
import json
import logging
import typing
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

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
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from lightning import semconv
from lightning.store.base import LightningStore
from lightning.store.errors import ConflictError, InvalidArgumentError, NotFoundError, StoreError
from lightning.types import (
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    EnqueueRolloutRequest,
    Event,
    Link,
    NamedResources,
    OtelResource,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
    Span,
    SpanContext,
    TaskInput,
    TraceStatus,
    Worker,
    WorkerStatus,
)

logger = logging.getLogger(__name__)

MAX_WAIT_SECONDS = 30.0
"""The longest one request waits (dequeue, wait_for_rollouts); the client asks again for longer waits."""
DISCONNECT_CHECK_SECONDS = 1.0
"""A waiting dequeue looks this often whether its client is gone, so it claims nothing for nobody."""
MAX_OTLP_BYTES = 64 * 1024 * 1024
"""Largest OTLP payload accepted, after gunzip (a guard against compressed bombs)."""
PROTOBUF = "application/x-protobuf"

SortOrder = Literal["asc", "desc"]
FilterLogic = Literal["and", "or"]


# --- request bodies ---------------------------------------------------------------------------


class _Body(BaseModel):
    """A request body; unknown fields are a 422 that names them, not silently dropped."""

    model_config = ConfigDict(extra="forbid")


class EnqueueManyBody(_Body):
    rollouts: list[EnqueueRolloutRequest]


class StartRolloutBody(_Body):
    input: TaskInput
    mode: RolloutMode | None = None
    resources_id: str | None = None
    config: RolloutConfig | None = None
    metadata: dict[str, Any] | None = None
    worker_id: str | None = None


class DequeueBody(_Body):
    limit: int = 1
    worker_id: str | None = None
    wait: float = Field(default=0.0, ge=0, description=f"seconds to wait for work; at most {MAX_WAIT_SECONDS:g}")


class StartAttemptBody(_Body):
    rollout_id: str
    worker_id: str | None = None


class RolloutIdBody(_Body):
    rollout_id: str


class QueryRolloutsBody(_Body):
    status_in: list[RolloutStatus] | None = None
    rollout_id_in: list[str] | None = None
    rollout_id_contains: str | None = None
    mode: RolloutMode | None = None
    filter_logic: FilterLogic = "and"
    sort_by: str | None = None
    sort_order: SortOrder = "asc"
    limit: int = -1
    offset: int = 0


class UpdateRolloutBody(_Body):
    """Fields left out stay as they are; an explicit null clears."""

    rollout_id: str
    input: TaskInput = None
    mode: RolloutMode | None = None
    resources_id: str | None = None
    status: RolloutStatus | None = None
    config: RolloutConfig | None = None
    metadata: dict[str, Any] | None = None


class WaitForRolloutsBody(_Body):
    rollout_ids: list[str]
    timeout: float | None = Field(default=None, ge=0, description=f"seconds; at most {MAX_WAIT_SECONDS:g}")


class QueryAttemptsBody(_Body):
    rollout_id: str
    sort_by: str | None = "sequence_id"
    sort_order: SortOrder = "asc"
    limit: int = -1
    offset: int = 0


class UpdateAttemptBody(_Body):
    """Fields left out stay as they are; an explicit null clears."""

    rollout_id: str
    attempt_id: str
    status: AttemptStatus | None = None
    worker_id: str | None = None
    last_heartbeat_time: float | None = None
    metadata: dict[str, Any] | None = None


class AddManySpansBody(_Body):
    spans: list[Span]


class SequenceIdBody(_Body):
    rollout_id: str
    attempt_id: str


class ManySequenceIdsBody(_Body):
    rollout_attempt_ids: list[tuple[str, str]]


class QuerySpansBody(_Body):
    rollout_id: str
    attempt_id: str | None = None
    trace_id: str | None = None
    span_id: str | None = None
    parent_id: str | None = None
    name: str | None = None
    name_contains: str | None = None
    filter_logic: FilterLogic = "and"
    sort_by: str | None = "sequence_id"
    sort_order: SortOrder = "asc"
    limit: int = -1
    offset: int = 0


class AddResourcesBody(_Body):
    resources: NamedResources


class UpdateResourcesBody(_Body):
    resources_id: str
    resources: NamedResources


class ResourcesIdBody(_Body):
    resources_id: str


class QueryResourcesBody(_Body):
    resources_id: str | None = None
    resources_id_contains: str | None = None
    sort_by: str | None = None
    sort_order: SortOrder = "asc"
    limit: int = -1
    offset: int = 0


class UpdateWorkerBody(_Body):
    """heartbeat_stats left out keeps the stored stats; null clears them."""

    worker_id: str
    heartbeat_stats: dict[str, Any] | None = None


class WorkerIdBody(_Body):
    worker_id: str


class QueryWorkersBody(_Body):
    status_in: list[WorkerStatus] | None = None
    worker_id_contains: str | None = None
    filter_logic: FilterLogic = "and"
    sort_by: str | None = None
    sort_order: SortOrder = "asc"
    limit: int = -1
    offset: int = 0


def _given(body: BaseModel, *exclude: str) -> dict[str, Any]:
    """The fields the client sent (explicit nulls included), as keyword arguments."""
    return {name: getattr(body, name) for name in body.model_fields_set if name not in exclude}


# --- errors -----------------------------------------------------------------------------------


def _status_of(exc: Exception) -> int:
    if isinstance(exc, NotFoundError):
        return 404
    if isinstance(exc, ConflictError):
        return 409
    if isinstance(exc, InvalidArgumentError):
        return 422
    return 503  # a StoreError the store raised on purpose: it is there but cannot serve now


def _validation_message(errors: Sequence[Any]) -> str:
    """`field.path: what is wrong` for each problem (the first few), the field named as in the body."""
    problems = []
    for error in errors[:5]:
        loc = [str(part) for part in error.get("loc", ())]
        problems.append(f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}")
    return "; ".join(problems)


def _error(status_code: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status_code)


class _StoreRoute(APIRoute):
    """A route whose endpoint takes `body` (a pydantic model) and/or `request`. FastAPI builds the OpenAPI
    schema from that signature as usual; a request takes a shorter path than FastAPI's own (a quarter
    of a millisecond less per call): pydantic validates the body straight from the JSON bytes and dumps
    the result straight to JSON bytes. Every error becomes status code + message; tracebacks stay in
    the server log."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        hints = typing.get_type_hints(self.endpoint)
        body_model: type[BaseModel] | None = hints.get("body")
        wants_request = "request" in hints
        answer = pydantic.TypeAdapter(Any if self.response_model is None else self.response_model)
        endpoint = self.endpoint

        async def handle(request: Request) -> Response:
            try:
                arguments: dict[str, Any] = {}
                if body_model is not None:
                    arguments["body"] = body_model.model_validate_json(await request.body() or b"{}")
                if wants_request:
                    arguments["request"] = request
                result = await endpoint(**arguments)
                if isinstance(result, Response):
                    return result
                return Response(answer.dump_json(result), media_type="application/json")
            except pydantic.ValidationError as exc:
                return _error(422, _validation_message(exc.errors()))
            except StoreError as exc:
                return _error(_status_of(exc), str(exc))
            except Exception:
                logger.exception("unexpected error in %s %s", request.method, request.url.path)
                return _error(500, "internal server error; see the store server's log")

        return handle


class _BearerAuth:
    """Every HTTP request, docs included, must carry `Authorization: Bearer <token>`."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not self._authorised(scope):
            response = JSONResponse(
                {"detail": "missing or wrong bearer token (Authorization: Bearer <token>)"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorised(self, scope: Scope) -> bool:
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)


# --- the app ----------------------------------------------------------------------------------


def create_app(store: LightningStore, *, token: str | None = None) -> FastAPI:
    """The HTTP face of `store`. With `token`, every request needs `Authorization: Bearer <token>`.

    The app does not close the store: whoever opened it does (`lightning store serve` on shutdown)."""
    app = FastAPI(
        title="lightning store",
        description="The store protocol (lightning.store.base.LightningStore) over HTTP, and OTLP/HTTP traces.",
        version="1",
    )
    app.state.store = store
    # Routes go on the app itself: through include_router, FastAPI's route matching costs 0.15 ms a request.
    app.router.route_class = _StoreRoute
    _add_store_routes(app, store)
    _add_otlp_route(app, store)
    if token is not None:
        if not token:
            raise InvalidArgumentError("token must be a non-empty string, or None for no authentication")
        app.add_middleware(_BearerAuth, token=token)
    return app


def _add_store_routes(app: FastAPI, store: LightningStore) -> None:
    post = app.post

    @app.get("/health", tags=["health"])
    async def health() -> dict[str, Any]:
        """The store answers: its statistics."""
        return {"status": "ok", "statistics": await store.statistics()}

    # --- rollouts ----------------------------------------------------------------------------

    @post("/v1/store/enqueue_rollout", response_model=Rollout, tags=["rollouts"])
    async def enqueue_rollout(body: EnqueueRolloutRequest) -> Rollout:
        return await store.enqueue_rollout(**_given(body))

    @post("/v1/store/enqueue_many_rollouts", response_model=list[Rollout], tags=["rollouts"])
    async def enqueue_many_rollouts(body: EnqueueManyBody) -> list[Rollout]:
        return list(await store.enqueue_many_rollouts(body.rollouts))

    @post("/v1/store/start_rollout", response_model=AttemptedRollout, tags=["rollouts"])
    async def start_rollout(body: StartRolloutBody) -> AttemptedRollout:
        return await store.start_rollout(**_given(body))

    @post("/v1/store/dequeue_rollout", response_model=AttemptedRollout | None, tags=["rollouts"])
    async def dequeue_rollout(body: DequeueBody, request: Request) -> AttemptedRollout | None:
        """Claims the oldest queued rollout; null when the queue stays empty for `wait` seconds."""
        claimed = await _dequeue(store, request, 1, body.worker_id, body.wait)
        return claimed[0] if claimed else None

    @post("/v1/store/dequeue_many_rollouts", response_model=list[AttemptedRollout], tags=["rollouts"])
    async def dequeue_many_rollouts(body: DequeueBody, request: Request) -> list[AttemptedRollout]:
        return await _dequeue(store, request, body.limit, body.worker_id, body.wait)

    @post("/v1/store/start_attempt", response_model=AttemptedRollout, tags=["rollouts"])
    async def start_attempt(body: StartAttemptBody) -> AttemptedRollout:
        return await store.start_attempt(body.rollout_id, worker_id=body.worker_id)

    @post("/v1/store/get_rollout_by_id", response_model=Rollout | None, tags=["rollouts"])
    async def get_rollout_by_id(body: RolloutIdBody) -> Rollout | None:
        return await store.get_rollout_by_id(body.rollout_id)

    # A rollout with an attempt comes back as AttemptedRollout (listed first so it keeps its attempt).
    @post("/v1/store/query_rollouts", response_model=list[AttemptedRollout | Rollout], tags=["rollouts"])
    async def query_rollouts(body: QueryRolloutsBody) -> list[Rollout]:
        return list(await store.query_rollouts(**body.model_dump()))

    @post("/v1/store/update_rollout", response_model=Rollout, tags=["rollouts"])
    async def update_rollout(body: UpdateRolloutBody) -> Rollout:
        """Only the fields present in the body change; an explicit null clears a field."""
        return await store.update_rollout(body.rollout_id, **_given(body, "rollout_id"))

    @post("/v1/store/wait_for_rollouts", response_model=list[Rollout], tags=["rollouts"])
    async def wait_for_rollouts(body: WaitForRolloutsBody) -> list[Rollout]:
        """The finished rollouts among `rollout_ids`, after waiting up to `timeout` seconds for the rest."""
        timeout = MAX_WAIT_SECONDS if body.timeout is None else min(body.timeout, MAX_WAIT_SECONDS)
        return await store.wait_for_rollouts(rollout_ids=body.rollout_ids, timeout=timeout)

    # --- attempts ----------------------------------------------------------------------------

    @post("/v1/store/query_attempts", response_model=list[Attempt], tags=["attempts"])
    async def query_attempts(body: QueryAttemptsBody) -> list[Attempt]:
        return await store.query_attempts(**body.model_dump())

    @post("/v1/store/get_latest_attempt", response_model=Attempt | None, tags=["attempts"])
    async def get_latest_attempt(body: RolloutIdBody) -> Attempt | None:
        return await store.get_latest_attempt(body.rollout_id)

    @post("/v1/store/update_attempt", response_model=Attempt, tags=["attempts"])
    async def update_attempt(body: UpdateAttemptBody) -> Attempt:
        """Only the fields present in the body change; an explicit null clears a field."""
        return await store.update_attempt(body.rollout_id, body.attempt_id, **_given(body, "rollout_id", "attempt_id"))

    # --- spans -------------------------------------------------------------------------------

    @post("/v1/store/add_span", response_model=Span | None, tags=["spans"])
    async def add_span(body: Span) -> Span | None:
        """The span as stored, or null if a span with its span_id was already there."""
        return await store.add_span(body)

    @post("/v1/store/add_many_spans", response_model=list[Span], tags=["spans"])
    async def add_many_spans(body: AddManySpansBody) -> list[Span]:
        return list(await store.add_many_spans(body.spans))

    @post("/v1/store/get_next_span_sequence_id", response_model=int, tags=["spans"])
    async def get_next_span_sequence_id(body: SequenceIdBody) -> int:
        return await store.get_next_span_sequence_id(body.rollout_id, body.attempt_id)

    @post("/v1/store/get_many_span_sequence_ids", response_model=list[int], tags=["spans"])
    async def get_many_span_sequence_ids(body: ManySequenceIdsBody) -> list[int]:
        return list(await store.get_many_span_sequence_ids(body.rollout_attempt_ids))

    @post("/v1/store/query_spans", response_model=list[Span], tags=["spans"])
    async def query_spans(body: QuerySpansBody) -> list[Span]:
        fields = body.model_dump()
        return await store.query_spans(fields.pop("rollout_id"), fields.pop("attempt_id"), **fields)

    # --- resources ---------------------------------------------------------------------------

    @post("/v1/store/add_resources", response_model=ResourcesUpdate, tags=["resources"])
    async def add_resources(body: AddResourcesBody) -> ResourcesUpdate:
        return await store.add_resources(body.resources)

    @post("/v1/store/update_resources", response_model=ResourcesUpdate, tags=["resources"])
    async def update_resources(body: UpdateResourcesBody) -> ResourcesUpdate:
        return await store.update_resources(body.resources_id, body.resources)

    @post("/v1/store/get_resources_by_id", response_model=ResourcesUpdate | None, tags=["resources"])
    async def get_resources_by_id(body: ResourcesIdBody) -> ResourcesUpdate | None:
        return await store.get_resources_by_id(body.resources_id)

    @post("/v1/store/get_latest_resources", response_model=ResourcesUpdate | None, tags=["resources"])
    async def get_latest_resources() -> ResourcesUpdate | None:
        return await store.get_latest_resources()

    @post("/v1/store/query_resources", response_model=list[ResourcesUpdate], tags=["resources"])
    async def query_resources(body: QueryResourcesBody) -> list[ResourcesUpdate]:
        return await store.query_resources(**body.model_dump())

    # --- workers -----------------------------------------------------------------------------

    @post("/v1/store/update_worker", response_model=Worker, tags=["workers"])
    async def update_worker(body: UpdateWorkerBody) -> Worker:
        return await store.update_worker(body.worker_id, **_given(body, "worker_id"))

    @post("/v1/store/get_worker_by_id", response_model=Worker | None, tags=["workers"])
    async def get_worker_by_id(body: WorkerIdBody) -> Worker | None:
        return await store.get_worker_by_id(body.worker_id)

    @post("/v1/store/query_workers", response_model=list[Worker], tags=["workers"])
    async def query_workers(body: QueryWorkersBody) -> list[Worker]:
        return await store.query_workers(**body.model_dump())

    # --- housekeeping ------------------------------------------------------------------------

    @post("/v1/store/statistics", tags=["housekeeping"])
    async def statistics() -> dict[str, Any]:
        return await store.statistics()

    @post("/v1/store/run_watchdog", response_model=int, tags=["housekeeping"])
    async def run_watchdog() -> int:
        """One watchdog pass now; how many attempts it marked timeout or unresponsive."""
        run = getattr(store, "run_watchdog", None)
        if run is None:
            raise InvalidArgumentError(f"{type(store).__name__} has no watchdog to run")
        return await run()


async def _dequeue(
    store: LightningStore, request: Request, limit: int, worker_id: str | None, wait: float
) -> list[AttemptedRollout]:
    """Claim up to `limit` rollouts, waiting up to `wait` seconds (capped) in slices: a rollout claimed
    for a client that has gone away would sit in `preparing` until the watchdog notices."""
    remaining = min(wait, MAX_WAIT_SECONDS)
    while True:
        slice_ = min(remaining, DISCONNECT_CHECK_SECONDS)
        claimed = list(await store.dequeue_many_rollouts(limit=limit, worker_id=worker_id, wait=slice_))
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
    body = await request.body()
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
