"""The store's public face: agent-lightning 0.3's LightningStore method set, async, with batch forms and queues.

Every method turns its arguments into its request model of `lightning.store.contract` (a bad argument is an
`InvalidArgumentError` that names it) and hands it to `handle`, which each store implements once:
`SqlLightningStore` runs it as a transaction, `HttpLightningStore` sends it to a store server. Arguments a method
lists are its positional ones; the rest (filters, sorting, paging, changed fields) are the request model's
fields, passed by keyword.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypedDict

import pydantic

from lightning.store import contract
from lightning.store.contract import FilterLogic, Request, SortOrder  # noqa: F401 (re-exported)
from lightning.store.errors import InvalidArgumentError
from lightning.types import (
    NO_NUL,
    Attempt,
    AttemptedRollout,
    Claim,
    EnqueueRolloutRequest,
    NamedResources,
    PaginatedResult,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    Span,
    TaskInput,
    Worker,
)

DISCONNECT_CHECK_SECONDS = 1.0
"""A server waiting to claim work for a client looks this often whether the client is gone."""


class Unset:
    """The type of UNSET: 'argument not given', as opposed to an explicit None that clears a field."""

    _instance: Unset | None = None

    def __new__(cls) -> Unset:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "UNSET"


UNSET: Any = Unset()
"""Passing UNSET is the same as leaving the argument out (an update keeps that field as it is)."""


def describe_validation_error(exc: pydantic.ValidationError, whole: str = "arguments") -> str:
    """`field.path: what is wrong (got X)` for each problem (the first five), fields named as the caller names them;
    `whole` names what a problem of no one field is about."""
    problems = []
    for error in exc.errors()[:5]:
        where = ".".join(str(part) for part in error.get("loc", ())) or whole
        message = error.get("msg", "invalid").removeprefix("Value error, ")
        if error.get("type") == "extra_forbidden":
            message = "unknown argument"
        elif error.get("type") == "string_pattern_mismatch" and error.get("ctx", {}).get("pattern") == NO_NUL:
            message = "contains a NUL character (\\x00), which the store cannot hold"
        elif error.get("type") not in ("missing", "json_invalid") and "input" in error:
            given = repr(error["input"])
            message += f" (got {given if len(given) <= 80 else given[:77] + '...'})"
        problems.append(f"{where}: {message}")
    return "; ".join(problems)


async def handle_one_http_request(
    store: LightningStore, request: Request, client_gone: Callable[[], Awaitable[bool]]
) -> Any:
    """`request` as the store servers' routes carry it out (ours and agent-lightning's wire): a wait capped at
    MAX_WAIT_SECONDS (the contract's `capped`); a claim waits in slices of DISCONNECT_CHECK_SECONDS and stops waiting
    once `client_gone()`."""
    request = request.capped()
    if not request.claims:
        return await store.handle(request)
    remaining = request.waits_for() or 0.0
    while True:
        slice_ = min(remaining, DISCONNECT_CHECK_SECONDS)
        claimed = await store.handle(request.waiting(slice_))
        remaining -= slice_
        if contract.claimed_any(claimed) or remaining <= 0 or await client_gone():
            return claimed


class LightningStoreCapabilities(TypedDict, total=False):
    """What a store can do (agent-lightning's `store.capabilities`): every store here is thread-safe and async-safe
    and keeps one copy that all its users share; a store server (an HttpLightningStore) also takes OTLP/HTTP
    traces (`otlp_traces_endpoint()`)."""

    thread_safe: bool
    async_safe: bool
    zero_copy: bool
    otlp_traces: bool


class LightningStoreStatistics(TypedDict, total=False):
    """agent-lightning's keys of `statistics()`; ours adds counts by status (rollouts_queuing, ...)."""

    name: str
    total_rollouts: int
    total_attempts: int
    total_spans: int
    total_resources: int
    total_workers: int
    uptime: float


class LightningStore(ABC):
    """Rollouts, attempts, spans, resources and workers, with the lifecycle of `lightning.store.lifecycle`.

    Unknown ids raise `NotFoundError`; malformed arguments raise `InvalidArgumentError`. Rollouts wait in queues:
    `enqueue_rollout(..., queue=Q)` and `dequeue_rollout(queue=Q)`; without `queue`, both use the default queue.
    """

    @abstractmethod
    async def handle(self, request: Request) -> Any:
        """Carry out one request of `lightning.store.contract` and answer with its `response` type."""

    async def close(self) -> None:  # noqa: B027 (a store that holds nothing has nothing to close)
        """Release what the store holds (connections, threads); the base holds nothing."""

    async def __aenter__(self) -> LightningStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _request(self, request_type: type[Request], /, **arguments: Any) -> Any:
        fields = {name: value for name, value in arguments.items() if value is not UNSET}
        try:
            request = request_type.model_validate(fields)
        except pydantic.ValidationError as exc:
            raise InvalidArgumentError(f"{request_type.method}: {describe_validation_error(exc)}") from None
        return await self.handle(request)

    # --- rollouts ----------------------------------------------------------------------------

    async def enqueue_rollout(
        self,
        input: TaskInput,
        mode: RolloutMode | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        **options: Any,
    ) -> Rollout:
        """Queue a rollout of `input` (resources: the given id, else the latest); `queue=` picks the queue."""
        return await self._request(
            contract.EnqueueRollout, input=input, mode=mode, resources_id=resources_id, config=config,
            metadata=metadata, idempotency_key=idempotency_key, **options,
        )  # fmt: skip

    async def enqueue_many_rollouts(self, rollouts: Sequence[EnqueueRolloutRequest | dict[str, Any]]) -> list[Rollout]:
        """Queue a batch in one transaction; the rollouts in the batch's order."""
        if not rollouts:
            return []
        return await self._request(contract.EnqueueManyRollouts, rollouts=list(rollouts))

    async def start_rollout(
        self,
        input: TaskInput,
        mode: RolloutMode | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        worker_id: str | None = None,
        **options: Any,
    ) -> AttemptedRollout:
        """A rollout that starts now, outside the queue, with its first attempt."""
        return await self._request(
            contract.StartRollout, input=input, mode=mode, resources_id=resources_id, config=config,
            metadata=metadata, worker_id=worker_id, **options,
        )  # fmt: skip

    async def dequeue_rollout(self, worker_id: str | None = None, **options: Any) -> AttemptedRollout | None:
        """The oldest rollout of the queue (`queue=`, default the default queue), now preparing with a new attempt;
        None if the queue stays empty (at once, or after up to `wait=` seconds)."""
        return await self._request(contract.DequeueRollout, worker_id=worker_id, **options)

    async def dequeue_many_rollouts(self, **options: Any) -> list[AttemptedRollout]:
        """Up to `limit=` rollouts of the queue at once (`worker_id=`, `wait=`, `queue=` as for one)."""
        return await self._request(contract.DequeueRollouts, **options)

    async def claim_rollouts(
        self,
        worker_ids: Sequence[str],
        *,
        wait: float = 0.0,
        queue: str | None = None,
        known_resources: dict[str, int] | None = None,
    ) -> Claim:
        """A runner's claim in one request (see contract.ClaimRollouts): up to one rollout per worker id, each
        attempt already running under its worker, with the resources the caller lacks (`known_resources`: id ->
        the version it has)."""
        return await self._request(
            contract.ClaimRollouts, worker_ids=list(worker_ids), wait=wait, queue=queue,
            known_resources=known_resources or {},
        )  # fmt: skip

    async def start_attempt(self, rollout_id: str, worker_id: str | None = None) -> AttemptedRollout:
        return await self._request(contract.StartAttempt, rollout_id=rollout_id, worker_id=worker_id)

    async def get_rollout_by_id(self, rollout_id: str) -> AttemptedRollout | Rollout | None:
        """The rollout, with its latest attempt if it has one (an AttemptedRollout); None for an unknown id."""
        return await self._request(contract.GetRolloutById, rollout_id=rollout_id)

    async def query_rollouts(self, **filters: Any) -> PaginatedResult[AttemptedRollout | Rollout]:
        """Rollouts by `status_in`, `rollout_id_in`, `rollout_id_contains`, `mode`, `queue` (see QueryRollouts),
        sorted and paged; those with an attempt come with their latest one. (`status=` and `rollout_ids=`, the
        older names agent-lightning still takes, mean `status_in` and `rollout_id_in`.)"""
        for old, new in (("status", "status_in"), ("rollout_ids", "rollout_id_in")):
            if old in filters:
                value = filters.pop(old)
                if filters.get(new) is None:
                    filters[new] = value
        return await self._request(contract.QueryRollouts, **filters)

    async def update_rollout(self, rollout_id: str, **changes: Any) -> Rollout:
        """Set the fields given (`input`, `mode`, `resources_id`, `status`, `config`, `metadata`); None clears."""
        return await self._request(contract.UpdateRollout, rollout_id=rollout_id, **changes)

    async def wait_for_rollouts(self, *, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        """The rollouts among `rollout_ids` that finished, waiting up to `timeout` seconds (None: until all have)."""
        return await self._request(contract.WaitForRollouts, rollout_ids=rollout_ids, timeout=timeout)

    async def wait_for_finished_ids(self, *, rollout_ids: list[str], timeout: float | None = None) -> list[str]:
        """The ids among `rollout_ids` of the rollouts that finished, waiting up to `timeout` seconds (None: until
        all have): `wait_for_rollouts` for a waiter that needs no more than which (it reads no rollout)."""
        return await self._request(contract.WaitForFinishedIds, rollout_ids=rollout_ids, timeout=timeout)

    # --- attempts ----------------------------------------------------------------------------

    async def query_attempts(self, rollout_id: str, **options: Any) -> PaginatedResult[Attempt]:
        return await self._request(contract.QueryAttempts, rollout_id=rollout_id, **options)

    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None:
        return await self._request(contract.GetLatestAttempt, rollout_id=rollout_id)

    async def update_attempt(self, rollout_id: str, attempt_id: str, **changes: Any) -> Attempt:
        """Set the fields given (`status`, `worker_id`, `last_heartbeat_time`, `metadata`); None clears."""
        return await self._request(contract.UpdateAttempt, rollout_id=rollout_id, attempt_id=attempt_id, **changes)

    async def finish_attempt(
        self, rollout_id: str, attempt_id: str, status: str, spans: Sequence[Span] = ()
    ) -> Attempt:
        """Store the attempt's last `spans` (numbered by the store) and set its final `status` ("succeeded" or
        "failed") unless the store moved it on meanwhile; the attempt as it stands after (see
        contract.FinishAttempt)."""
        return await self._request(
            contract.FinishAttempt, rollout_id=rollout_id, attempt_id=attempt_id, status=status, spans=list(spans)
        )

    # --- spans -------------------------------------------------------------------------------

    async def add_span(self, span: Span) -> Span | None:
        """The span as stored, or None if one with its span_id was there already."""
        return await self._request(contract.AddSpan, span=span)

    async def add_many_spans(self, spans: Sequence[Span], *, number: bool = False) -> list[Span]:
        """The spans stored (a span_id the store has is skipped). `number=True`: the store numbers them itself, in
        this order (their own `sequence_id` is ignored), saving a get_many_span_sequence_ids request."""
        if not spans:
            return []
        return await self._request(contract.AddManySpans, spans=list(spans), number=number)

    async def add_otel_span(
        self, rollout_id: str, attempt_id: str, readable_span: Any, sequence_id: int | None = None
    ) -> Span | None:
        """An OpenTelemetry SDK span (ReadableSpan) of the attempt, numbered next unless `sequence_id` is given."""
        if sequence_id is None:
            sequence_id = await self.get_next_span_sequence_id(rollout_id, attempt_id)
        return await self.add_span(Span.from_opentelemetry(readable_span, rollout_id, attempt_id, sequence_id))

    async def get_next_span_sequence_id(self, rollout_id: str, attempt_id: str) -> int:
        return await self._request(contract.GetNextSpanSequenceId, rollout_id=rollout_id, attempt_id=attempt_id)

    async def get_many_span_sequence_ids(self, rollout_attempt_ids: Sequence[tuple[str, str]]) -> list[int]:
        if not rollout_attempt_ids:
            return []
        return await self._request(contract.GetManySpanSequenceIds, rollout_attempt_ids=list(rollout_attempt_ids))

    async def query_spans(
        self, rollout_id: str, attempt_id: str | None = None, **filters: Any
    ) -> PaginatedResult[Span]:
        """Spans of a rollout (of one attempt; "latest" for its latest), by `trace_id`, `span_id`, `parent_id`,
        `name` and their `*_contains` forms (see QuerySpans), sorted and paged."""
        return await self._request(contract.QuerySpans, rollout_id=rollout_id, attempt_id=attempt_id, **filters)

    async def query_latest_spans(
        self, rollout_ids: Sequence[str], *, rewards_only: bool = False
    ) -> dict[str, list[Span]]:
        """Each rollout's latest attempt's spans, in sequence order, in one request: rollout id -> spans (an
        unknown id is left out). `rewards_only`: only the spans that may carry a reward (`find_final_reward` reads
        the same reward from them as from all)."""
        if not rollout_ids:
            return {}
        return await self._request(contract.QueryLatestSpans, rollout_ids=list(rollout_ids), rewards_only=rewards_only)

    # --- resources ---------------------------------------------------------------------------

    async def add_resources(self, resources: NamedResources) -> ResourcesUpdate:
        return await self._request(contract.AddResources, resources=resources)

    async def update_resources(self, resources_id: str, resources: NamedResources) -> ResourcesUpdate:
        return await self._request(contract.UpdateResources, resources_id=resources_id, resources=resources)

    async def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate | None:
        return await self._request(contract.GetResourcesById, resources_id=resources_id)

    async def get_latest_resources(self) -> ResourcesUpdate | None:
        return await self._request(contract.GetLatestResources)

    async def query_resources(self, **filters: Any) -> PaginatedResult[ResourcesUpdate]:
        return await self._request(contract.QueryResources, **filters)

    # --- workers -----------------------------------------------------------------------------

    async def update_worker(self, worker_id: str, heartbeat_stats: dict[str, Any] | None = UNSET) -> Worker:
        """A heartbeat of `worker_id`, with its stats if given (None clears them)."""
        return await self._request(contract.UpdateWorker, worker_id=worker_id, heartbeat_stats=heartbeat_stats)

    async def get_worker_by_id(self, worker_id: str) -> Worker | None:
        return await self._request(contract.GetWorkerById, worker_id=worker_id)

    async def query_workers(self, **filters: Any) -> PaginatedResult[Worker]:
        return await self._request(contract.QueryWorkers, **filters)

    # --- housekeeping ------------------------------------------------------------------------

    async def statistics(self) -> dict[str, Any]:
        """agl's keys (LightningStoreStatistics) and counts by status."""
        return await self._request(contract.Statistics)

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        """agent-lightning's capability flags: the same for every store here but a server's OTLP route."""
        return LightningStoreCapabilities(thread_safe=True, async_safe=True, zero_copy=True, otlp_traces=False)

    async def run_watchdog(self) -> int:
        """One watchdog pass now: mark timed-out and unresponsive attempts, move their rollouts; how many it marked."""
        return await self._request(contract.RunWatchdog)
