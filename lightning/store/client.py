"""The store protocol spoken over HTTP to `lightning store serve`, usable from any thread and event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
import pydantic

from lightning.store.base import UNSET, FilterLogic, SortOrder
from lightning.store.errors import ConflictError, InvalidArgumentError, NotFoundError, StoreError
from lightning.store.server import MAX_WAIT_SECONDS
from lightning.types import (
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    EnqueueRolloutRequest,
    NamedResources,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
    Span,
    TaskInput,
    Worker,
    WorkerStatus,
)

logger = logging.getLogger(__name__)

_ROLLOUT = pydantic.TypeAdapter(Rollout)
_ROLLOUTS = pydantic.TypeAdapter(list[Rollout])
_MAYBE_ROLLOUT = pydantic.TypeAdapter(Rollout | None)
# AttemptedRollout first: a rollout that comes with its attempt keeps it.
_ANY_ROLLOUTS = pydantic.TypeAdapter(list[AttemptedRollout | Rollout])
_ATTEMPTED = pydantic.TypeAdapter(AttemptedRollout)
_MAYBE_ATTEMPTED = pydantic.TypeAdapter(AttemptedRollout | None)
_ATTEMPTED_LIST = pydantic.TypeAdapter(list[AttemptedRollout])
_ATTEMPT = pydantic.TypeAdapter(Attempt)
_MAYBE_ATTEMPT = pydantic.TypeAdapter(Attempt | None)
_ATTEMPTS = pydantic.TypeAdapter(list[Attempt])
_MAYBE_SPAN = pydantic.TypeAdapter(Span | None)
_SPANS = pydantic.TypeAdapter(list[Span])
_INT = pydantic.TypeAdapter(int)
_INTS = pydantic.TypeAdapter(list[int])
_RESOURCES = pydantic.TypeAdapter(ResourcesUpdate)
_MAYBE_RESOURCES = pydantic.TypeAdapter(ResourcesUpdate | None)
_RESOURCES_LIST = pydantic.TypeAdapter(list[ResourcesUpdate])
_WORKER = pydantic.TypeAdapter(Worker)
_MAYBE_WORKER = pydantic.TypeAdapter(Worker | None)
_WORKERS = pydantic.TypeAdapter(list[Worker])
_DICT = pydantic.TypeAdapter(dict[str, Any])

_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_ERRORS: dict[int, type[StoreError]] = {404: NotFoundError, 409: ConflictError, 422: InvalidArgumentError}
_FIRST_BACKOFF, _MAX_BACKOFF = 0.1, 2.0


class HttpLightningStore:
    """The store at `base_url` (e.g. `http://127.0.0.1:4747`), served by `lightning store serve`.

    `token`: the server's bearer token. `timeout`: seconds per request (waits come on top).
    `retries`: further tries, with backoff, after a transport error or a 503 - only for calls that
    are safe to repeat (reads, keyed enqueues, spans, sequence ids, heartbeats); every other call
    is sent once and its failure raised, never turned into an empty answer."""

    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 30.0, retries: int = 3) -> None:
        if retries < 0:
            raise InvalidArgumentError(f"retries must be >= 0, got {retries}")
        self.base_url = base_url.rstrip("/")
        headers = {"content-type": "application/json", "accept": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._headers = httpx.Headers(headers)
        self._urls: dict[str, httpx.URL] = {}
        self._timeout = timeout
        self._retries = retries
        # httpx clients belong to the event loop that made them: one per loop that calls us.
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"HttpLightningStore({self.base_url!r})"

    # --- transport ---------------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise StoreError("the store client is closed")
            client = self._clients.get(loop)
            if client is None:
                # A loop that has ended cannot close its client any more; let go of it.
                for ended in [other for other in self._clients if other.is_closed()]:
                    del self._clients[ended]
                client = self._clients[loop] = httpx.AsyncClient(
                    limits=httpx.Limits(max_connections=100, max_keepalive_connections=32),
                    # Proxies and .netrc from the environment have no business between us and our store.
                    trust_env=False,
                )
        return client

    def _url(self, method: str) -> httpx.URL:
        url = self._urls.get(method)
        if url is None:
            url = self._urls[method] = httpx.URL(f"{self.base_url}/v1/store/{method}")
        return url

    async def _call(self, method: str, body: bytes = b"{}", *, safe: bool, wait: float = 0.0) -> bytes:
        """POST /v1/store/<method>; the response body. `safe`: the call may be repeated without harm."""
        client = self._client()
        timeouts = {"timeout": httpx.Timeout(self._timeout + wait).as_dict()}
        tries = 1 + (self._retries if safe else 0)
        problem: StoreError | None = None
        for attempt in range(tries):
            if attempt:
                delay = min(_FIRST_BACKOFF * 2 ** (attempt - 1), _MAX_BACKOFF)
                await asyncio.sleep(delay * random.uniform(0.75, 1.25))  # spread out clients that failed together
            # A request built by hand skips the client's URL and header merging: a twentieth of a call.
            request = httpx.Request("POST", self._url(method), headers=self._headers, content=body, extensions=timeouts)
            try:
                response = await client.send(request)
            except httpx.TransportError as exc:
                problem = StoreError(
                    f"{method}: no answer from the store at {self.base_url}: {type(exc).__name__}: {exc}"
                )
                problem.__cause__ = exc
                continue
            if response.status_code == 200:
                return response.content
            problem = _error_from(method, response)
            if response.status_code != 503:
                raise problem
        assert problem is not None
        if tries > 1:
            logger.warning("%s failed after %d tries: %s", method, tries, problem)
        raise problem

    async def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = self._clients, {}
        current = asyncio.get_running_loop()
        for loop, client in clients.items():
            if loop is current:
                await client.aclose()
            elif loop.is_running():
                closing = asyncio.run_coroutine_threadsafe(client.aclose(), loop)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.wrap_future(closing), timeout=2.0)
            # A loop that has stopped cannot run aclose; its sockets go with the client object.

    async def __aenter__(self) -> HttpLightningStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- rollouts ----------------------------------------------------------------------------

    async def enqueue_rollout(
        self,
        input: TaskInput,
        mode: RolloutMode | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> Rollout:
        body = _enqueue_fields(input, mode, resources_id, config, metadata, idempotency_key)
        # With a key, a repeat returns the first rollout instead of enqueuing a second one.
        content = await self._call("enqueue_rollout", _encode(body), safe=idempotency_key is not None)
        return _ROLLOUT.validate_json(content)

    async def enqueue_many_rollouts(self, rollouts: Sequence[EnqueueRolloutRequest]) -> list[Rollout]:
        requests = [
            r if isinstance(r, EnqueueRolloutRequest) else EnqueueRolloutRequest.model_validate(r) for r in rollouts
        ]
        if not requests:
            return []
        body = {
            "rollouts": [
                _enqueue_fields(r.input, r.mode, r.resources_id, r.config, r.metadata, r.idempotency_key)
                for r in requests
            ]
        }
        safe = all(r.idempotency_key is not None for r in requests)
        return _ROLLOUTS.validate_json(await self._call("enqueue_many_rollouts", _encode(body), safe=safe))

    async def start_rollout(
        self,
        input: TaskInput,
        mode: RolloutMode | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        worker_id: str | None = None,
    ) -> AttemptedRollout:
        body = _enqueue_fields(input, mode, resources_id, config, metadata, None)
        del body["idempotency_key"]
        body["worker_id"] = worker_id
        return _ATTEMPTED.validate_json(await self._call("start_rollout", _encode(body), safe=False))

    async def dequeue_rollout(self, worker_id: str | None = None, *, wait: float = 0.0) -> AttemptedRollout | None:
        """The oldest queued rollout, now preparing with a new attempt; None if the queue stays empty
        for `wait` seconds. Never retried: a lost answer would leave a claimed rollout nobody runs."""
        return await self._wait_in_slices("dequeue_rollout", {"worker_id": worker_id}, wait, _MAYBE_ATTEMPTED)

    async def dequeue_many_rollouts(
        self, *, limit: int = 1, worker_id: str | None = None, wait: float = 0.0
    ) -> list[AttemptedRollout]:
        fields = {"limit": limit, "worker_id": worker_id}
        return await self._wait_in_slices("dequeue_many_rollouts", fields, wait, _ATTEMPTED_LIST)

    async def _wait_in_slices(self, method: str, fields: dict[str, Any], wait: float, adapter: Any) -> Any:
        # The server waits at most MAX_WAIT_SECONDS per request; longer waits are several requests.
        if wait < 0:
            raise InvalidArgumentError(f"wait must be >= 0 seconds, got {wait}")
        deadline = time.monotonic() + wait
        while True:
            slice_ = min(max(deadline - time.monotonic(), 0.0), MAX_WAIT_SECONDS)
            body = _encode({**fields, "wait": slice_})
            claimed = adapter.validate_json(await self._call(method, body, safe=False, wait=slice_))
            if claimed or time.monotonic() >= deadline:
                return claimed

    async def start_attempt(self, rollout_id: str, worker_id: str | None = None) -> AttemptedRollout:
        body = _encode({"rollout_id": rollout_id, "worker_id": worker_id})
        return _ATTEMPTED.validate_json(await self._call("start_attempt", body, safe=False))

    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | None:
        content = await self._call("get_rollout_by_id", _encode({"rollout_id": rollout_id}), safe=True)
        return _MAYBE_ROLLOUT.validate_json(content)

    async def query_rollouts(
        self,
        *,
        status_in: Sequence[RolloutStatus] | None = None,
        rollout_id_in: Sequence[str] | None = None,
        rollout_id_contains: str | None = None,
        mode: RolloutMode | None = None,
        filter_logic: FilterLogic = "and",
        sort_by: str | None = None,
        sort_order: SortOrder = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> list[Rollout]:
        body = {
            "status_in": _listed(status_in),
            "rollout_id_in": _listed(rollout_id_in),
            "rollout_id_contains": rollout_id_contains,
            "mode": mode,
            "filter_logic": filter_logic,
            "sort_by": sort_by,
            "sort_order": sort_order,
            "limit": limit,
            "offset": offset,
        }
        return _ANY_ROLLOUTS.validate_json(await self._call("query_rollouts", _encode(body), safe=True))

    async def update_rollout(
        self,
        rollout_id: str,
        input: TaskInput = UNSET,
        mode: RolloutMode | None = UNSET,
        resources_id: str | None = UNSET,
        status: RolloutStatus = UNSET,
        config: RolloutConfig = UNSET,
        metadata: dict[str, Any] | None = UNSET,
    ) -> Rollout:
        given = _without_unset(
            input=input, mode=mode, resources_id=resources_id, status=status, config=config, metadata=metadata
        )
        body = _encode({"rollout_id": rollout_id, **given})
        return _ROLLOUT.validate_json(await self._call("update_rollout", body, safe=False))

    async def wait_for_rollouts(self, *, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        """The rollouts among `rollout_ids` that finished, waiting up to `timeout` seconds (None: until
        all finish). The server waits at most MAX_WAIT_SECONDS per request; this asks again until done."""
        if timeout is not None and timeout < 0:
            raise InvalidArgumentError(f"timeout must be >= 0 seconds or None, got {timeout}")
        wanted = list(dict.fromkeys(rollout_ids))
        deadline = None if timeout is None else time.monotonic() + timeout
        finished: dict[str, Rollout] = {}
        pending = wanted
        while True:
            remaining = MAX_WAIT_SECONDS if deadline is None else max(deadline - time.monotonic(), 0.0)
            slice_ = min(remaining, MAX_WAIT_SECONDS)
            body = _encode({"rollout_ids": pending, "timeout": slice_})
            done = _ROLLOUTS.validate_json(await self._call("wait_for_rollouts", body, safe=True, wait=slice_))
            finished.update((r.rollout_id, r) for r in done)
            pending = [rid for rid in pending if rid not in finished]
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                return [finished[rid] for rid in wanted if rid in finished]

    # --- attempts ----------------------------------------------------------------------------

    async def query_attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: SortOrder = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> list[Attempt]:
        body = {
            "rollout_id": rollout_id,
            "sort_by": sort_by,
            "sort_order": sort_order,
            "limit": limit,
            "offset": offset,
        }
        return _ATTEMPTS.validate_json(await self._call("query_attempts", _encode(body), safe=True))

    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None:
        content = await self._call("get_latest_attempt", _encode({"rollout_id": rollout_id}), safe=True)
        return _MAYBE_ATTEMPT.validate_json(content)

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: AttemptStatus = UNSET,
        worker_id: str | None = UNSET,
        last_heartbeat_time: float = UNSET,
        metadata: dict[str, Any] | None = UNSET,
    ) -> Attempt:
        given = _without_unset(
            status=status, worker_id=worker_id, last_heartbeat_time=last_heartbeat_time, metadata=metadata
        )
        body = _encode({"rollout_id": rollout_id, "attempt_id": attempt_id, **given})
        # A heartbeat alone only moves a timestamp forward: safe to send twice. Anything else may move statuses.
        heartbeat_only = set(given) == {"last_heartbeat_time"}
        return _ATTEMPT.validate_json(await self._call("update_attempt", body, safe=heartbeat_only))

    # --- spans -------------------------------------------------------------------------------

    async def add_span(self, span: Span) -> Span | None:
        # The store ignores a span_id it already has, so a repeat cannot duplicate.
        return _MAYBE_SPAN.validate_json(await self._call("add_span", span.model_dump_json().encode(), safe=True))

    async def add_many_spans(self, spans: Sequence[Span]) -> list[Span]:
        if not spans:
            return []
        body = b'{"spans":' + _SPANS.dump_json(list(spans)) + b"}"
        return _SPANS.validate_json(await self._call("add_many_spans", body, safe=True))

    async def add_otel_span(
        self, rollout_id: str, attempt_id: str, readable_span: Any, sequence_id: int | None = None
    ) -> Span | None:
        if sequence_id is None:
            sequence_id = await self.get_next_span_sequence_id(rollout_id, attempt_id)
        return await self.add_span(Span.from_opentelemetry(readable_span, rollout_id, attempt_id, sequence_id))

    async def get_next_span_sequence_id(self, rollout_id: str, attempt_id: str) -> int:
        # A repeat after a lost answer only leaves a gap in the sequence.
        body = _encode({"rollout_id": rollout_id, "attempt_id": attempt_id})
        return _INT.validate_json(await self._call("get_next_span_sequence_id", body, safe=True))

    async def get_many_span_sequence_ids(self, rollout_attempt_ids: Sequence[tuple[str, str]]) -> list[int]:
        if not rollout_attempt_ids:
            return []
        body = _encode({"rollout_attempt_ids": [list(pair) for pair in rollout_attempt_ids]})
        return _INTS.validate_json(await self._call("get_many_span_sequence_ids", body, safe=True))

    async def query_spans(
        self,
        rollout_id: str,
        attempt_id: str | None = None,
        *,
        trace_id: str | None = None,
        span_id: str | None = None,
        parent_id: str | None = None,
        name: str | None = None,
        name_contains: str | None = None,
        filter_logic: FilterLogic = "and",
        sort_by: str | None = "sequence_id",
        sort_order: SortOrder = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> list[Span]:
        body = {
            "rollout_id": rollout_id,
            "attempt_id": attempt_id,
            "trace_id": trace_id,
            "span_id": span_id,
            "parent_id": parent_id,
            "name": name,
            "name_contains": name_contains,
            "filter_logic": filter_logic,
            "sort_by": sort_by,
            "sort_order": sort_order,
            "limit": limit,
            "offset": offset,
        }
        return _SPANS.validate_json(await self._call("query_spans", _encode(body), safe=True))

    # --- resources ---------------------------------------------------------------------------

    async def add_resources(self, resources: NamedResources) -> ResourcesUpdate:
        # Not repeated: each call makes a new resources id.
        body = _encode({"resources": resources})
        return _RESOURCES.validate_json(await self._call("add_resources", body, safe=False))

    async def update_resources(self, resources_id: str, resources: NamedResources) -> ResourcesUpdate:
        # Not repeated: each call bumps the version.
        body = _encode({"resources_id": resources_id, "resources": resources})
        return _RESOURCES.validate_json(await self._call("update_resources", body, safe=False))

    async def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate | None:
        content = await self._call("get_resources_by_id", _encode({"resources_id": resources_id}), safe=True)
        return _MAYBE_RESOURCES.validate_json(content)

    async def get_latest_resources(self) -> ResourcesUpdate | None:
        return _MAYBE_RESOURCES.validate_json(await self._call("get_latest_resources", safe=True))

    async def query_resources(
        self,
        *,
        resources_id: str | None = None,
        resources_id_contains: str | None = None,
        sort_by: str | None = None,
        sort_order: SortOrder = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> list[ResourcesUpdate]:
        body = {
            "resources_id": resources_id,
            "resources_id_contains": resources_id_contains,
            "sort_by": sort_by,
            "sort_order": sort_order,
            "limit": limit,
            "offset": offset,
        }
        return _RESOURCES_LIST.validate_json(await self._call("query_resources", _encode(body), safe=True))

    # --- workers -----------------------------------------------------------------------------

    async def update_worker(self, worker_id: str, heartbeat_stats: dict[str, Any] = UNSET) -> Worker:
        body = _encode({"worker_id": worker_id, **_without_unset(heartbeat_stats=heartbeat_stats)})
        return _WORKER.validate_json(await self._call("update_worker", body, safe=True))

    async def get_worker_by_id(self, worker_id: str) -> Worker | None:
        content = await self._call("get_worker_by_id", _encode({"worker_id": worker_id}), safe=True)
        return _MAYBE_WORKER.validate_json(content)

    async def query_workers(
        self,
        *,
        status_in: Sequence[WorkerStatus] | None = None,
        worker_id_contains: str | None = None,
        filter_logic: FilterLogic = "and",
        sort_by: str | None = None,
        sort_order: SortOrder = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> list[Worker]:
        body = {
            "status_in": _listed(status_in),
            "worker_id_contains": worker_id_contains,
            "filter_logic": filter_logic,
            "sort_by": sort_by,
            "sort_order": sort_order,
            "limit": limit,
            "offset": offset,
        }
        return _WORKERS.validate_json(await self._call("query_workers", _encode(body), safe=True))

    # --- housekeeping ------------------------------------------------------------------------

    async def statistics(self) -> dict[str, Any]:
        return _DICT.validate_json(await self._call("statistics", safe=True))

    async def run_watchdog(self) -> int:
        """One watchdog pass on the server's store now; how many attempts it marked."""
        return _INT.validate_json(await self._call("run_watchdog", safe=False))


# --- helpers ----------------------------------------------------------------------------------


def _enqueue_fields(
    input: Any,
    mode: Any,
    resources_id: Any,
    config: RolloutConfig | None,
    metadata: Any,
    idempotency_key: str | None,
) -> dict[str, Any]:
    return {
        "input": input,
        "mode": mode,
        "resources_id": resources_id,
        "config": config,
        "metadata": metadata,
        "idempotency_key": idempotency_key,
    }


def _encode(body: dict[str, Any]) -> bytes:
    """JSON for a request body; what JSON cannot carry (NaN, sets, objects) is refused here, as the
    store would refuse it, rather than sent in a lossy form."""
    try:
        return _ENCODER.encode(_plain(body)).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"arguments must be JSON-serialisable (input, metadata, ...): {exc}") from None


def _plain(value: Any) -> Any:
    """Pydantic models (configs, resources) as JSON-ready dicts; everything else as given."""
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def _listed(values: Sequence[str] | None) -> Any:
    # A bare string stays a string, so the server says it wants a list (instead of splitting it into letters).
    return values if values is None or isinstance(values, str) else list(values)


def _without_unset(**fields: Any) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not UNSET}


def _error_from(method: str, response: httpx.Response) -> StoreError:
    """The typed store error for an error answer, with the server's message."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if detail is None:
        detail = response.text[:500] or response.reason_phrase
    elif not isinstance(detail, str):
        detail = json.dumps(detail)
    error_type = _ERRORS.get(response.status_code, StoreError)
    if error_type is StoreError:
        detail = f"{method}: HTTP {response.status_code}: {detail}"
    return error_type(detail)
