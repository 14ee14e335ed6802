"""The store protocol: agent-lightning 0.3's LightningStore method set, async, with batch forms.

One implementation holds the data (`SqlLightningStore`); the HTTP client speaks the same protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

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

SortOrder = Literal["asc", "desc"]
FilterLogic = Literal["and", "or"]


@runtime_checkable
class LightningStore(Protocol):
    """Rollouts, attempts, spans, resources and workers, with the lifecycle of lightning.store.lifecycle.

    Unknown ids raise `NotFoundError`; malformed arguments raise `InvalidArgumentError`.
    """

    # --- rollouts ----------------------------------------------------------------------------
    async def enqueue_rollout(
        self,
        input: TaskInput,
        mode: RolloutMode | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> Rollout: ...

    async def enqueue_many_rollouts(self, rollouts: Sequence[EnqueueRolloutRequest]) -> list[Rollout]: ...

    async def start_rollout(
        self,
        input: TaskInput,
        mode: RolloutMode | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        worker_id: str | None = None,
    ) -> AttemptedRollout: ...

    async def dequeue_rollout(self, worker_id: str | None = None, *, wait: float = 0.0) -> AttemptedRollout | None:
        """The oldest queued rollout, now preparing with a new attempt; None if the queue stays empty
        (at once, or after up to `wait` seconds)."""
        ...

    async def dequeue_many_rollouts(
        self, *, limit: int = 1, worker_id: str | None = None, wait: float = 0.0
    ) -> list[AttemptedRollout]: ...

    async def start_attempt(self, rollout_id: str, worker_id: str | None = None) -> AttemptedRollout: ...

    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | None: ...

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
    ) -> list[Rollout]: ...

    async def update_rollout(
        self,
        rollout_id: str,
        input: TaskInput = UNSET,
        mode: RolloutMode | None = UNSET,
        resources_id: str | None = UNSET,
        status: RolloutStatus = UNSET,
        config: RolloutConfig = UNSET,
        metadata: dict[str, Any] | None = UNSET,
    ) -> Rollout: ...

    async def wait_for_rollouts(self, *, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]: ...

    # --- attempts ----------------------------------------------------------------------------
    async def query_attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: SortOrder = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> list[Attempt]: ...

    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None: ...

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: AttemptStatus = UNSET,
        worker_id: str | None = UNSET,
        last_heartbeat_time: float = UNSET,
        metadata: dict[str, Any] | None = UNSET,
    ) -> Attempt: ...

    # --- spans -------------------------------------------------------------------------------
    async def add_span(self, span: Span) -> Span | None: ...

    async def add_many_spans(self, spans: Sequence[Span]) -> list[Span]: ...

    async def add_otel_span(
        self, rollout_id: str, attempt_id: str, readable_span: Any, sequence_id: int | None = None
    ) -> Span | None: ...

    async def get_next_span_sequence_id(self, rollout_id: str, attempt_id: str) -> int: ...

    async def get_many_span_sequence_ids(self, rollout_attempt_ids: Sequence[tuple[str, str]]) -> list[int]: ...

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
    ) -> list[Span]: ...

    # --- resources ---------------------------------------------------------------------------
    async def add_resources(self, resources: NamedResources) -> ResourcesUpdate: ...

    async def update_resources(self, resources_id: str, resources: NamedResources) -> ResourcesUpdate: ...

    async def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate | None: ...

    async def get_latest_resources(self) -> ResourcesUpdate | None: ...

    async def query_resources(
        self,
        *,
        resources_id: str | None = None,
        resources_id_contains: str | None = None,
        sort_by: str | None = None,
        sort_order: SortOrder = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> list[ResourcesUpdate]: ...

    # --- workers -----------------------------------------------------------------------------
    async def update_worker(self, worker_id: str, heartbeat_stats: dict[str, Any] = UNSET) -> Worker: ...

    async def get_worker_by_id(self, worker_id: str) -> Worker | None: ...

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
    ) -> list[Worker]: ...

    # --- housekeeping ------------------------------------------------------------------------
    async def statistics(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...
