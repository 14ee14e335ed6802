"""The store's contract, written once: one typed request model per store method.

Each model is the method's arguments, validated (a bad argument is an error that names it), its name
(`method`), what it answers (`response`) and whether sending it twice is harmless (`repeatable`). From
`REQUESTS`:

- `LightningStore` (base.py) turns a call's arguments into the request and hands it to `handle`;
- `SqlLightningStore` (sql.py) handles it with one transaction;
- the HTTP server (server.py) serves `POST /v1/store/<method>` with the model as its body (and in its
  OpenAPI schema), and the client (client.py) sends it there.

Adding a filter to a query is a field here plus its name in the query's `_filters` in sql.py.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field

from lightning.types import (
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    Claim,
    EnqueueRolloutRequest,
    NamedResources,
    PaginatedResult,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
    Span,
    StoreText,
    TaskInput,
    Worker,
    WorkerStatus,
)

DEFAULT_QUEUE = "default"
"""The queue of rollouts enqueued without one, and the one a runner without a queue takes from. A training run
enqueues into a queue of its own (its run name), so runs that share a store never take each other's rollouts."""

MAX_WAIT_SECONDS = 30.0
"""The longest one HTTP request waits (dequeue, wait_for_rollouts); the client asks again for longer waits."""
MAX_COUNT = 2**53
"""Largest limit or offset: beyond it SQLite and PostgreSQL overflow, and no store holds that many rows."""

SortOrder = Literal["asc", "desc"]
FilterLogic = Literal["and", "or"]
QueueName = StoreText


class Request(BaseModel):
    """A store call's arguments. Unknown fields are an error that names them, not silently dropped; NaN and
    infinity travel as such (pydantic would turn them into null), so the store can refuse them."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    method: ClassVar[str]
    response: ClassVar[Any]
    wait_field: ClassVar[str | None] = None
    """The field saying how long the request may wait for work or results (None: it answers at once). One HTTP
    request waits at most MAX_WAIT_SECONDS (`capped`); a client waits longer in several."""
    claims: ClassVar[bool] = False
    """It claims rollouts: a server waiting for work on its behalf stops once its client is gone, so that it claims
    nothing for nobody (a rollout claimed so would sit in `preparing` until the watchdog notices)."""

    def repeatable(self) -> bool:
        """Sending this request twice does no harm (the client repeats it after a lost answer)."""
        return False

    def waits_for(self) -> float | None:
        """Seconds it may wait (None: as long as it takes, for a wait without a timeout; 0: it does not wait)."""
        return None if self.wait_field is None else getattr(self, self.wait_field)

    def waiting(self, seconds: float | None) -> Self:
        """This request, waiting `seconds` instead."""
        assert self.wait_field is not None, f"{self.method} does not wait"
        return self.model_copy(update={self.wait_field: seconds})

    def capped(self) -> Self:
        """This request as one HTTP request may carry it: waiting at most MAX_WAIT_SECONDS."""
        if self.wait_field is None:
            return self
        seconds = self.waits_for()
        return self.waiting(MAX_WAIT_SECONDS if seconds is None else min(seconds, MAX_WAIT_SECONDS))


class Read(Request):
    def repeatable(self) -> bool:
        return True


class Page(Read):
    """Sorting and paging of a query; `sort_by` names a field of the answer's type."""

    sort_order: SortOrder = "asc"
    limit: int = Field(default=-1, ge=-1, le=MAX_COUNT, description="-1: no limit")
    offset: int = Field(default=0, ge=0, le=MAX_COUNT)


# --- rollouts ---------------------------------------------------------------------------------


class EnqueueRollout(EnqueueRolloutRequest, Request):
    """Put a rollout of `input` in a queue (`queue`, default the default queue); with `idempotency_key`, a second
    enqueue of the same key returns the first rollout instead."""

    method: ClassVar[str] = "enqueue_rollout"
    response: ClassVar[Any] = Rollout

    def repeatable(self) -> bool:
        return self.idempotency_key is not None


class EnqueueManyRollouts(Request):
    """Enqueue a batch in one transaction; the rollouts in the batch's order."""

    method: ClassVar[str] = "enqueue_many_rollouts"
    response: ClassVar[Any] = list[Rollout]
    rollouts: list[EnqueueRolloutRequest]

    def repeatable(self) -> bool:
        return all(r.idempotency_key is not None for r in self.rollouts)


class StartRollout(Request):
    """A rollout that starts now, outside the queue, with its first attempt (preparing)."""

    method: ClassVar[str] = "start_rollout"
    response: ClassVar[Any] = AttemptedRollout
    input: TaskInput
    mode: RolloutMode | None = None
    resources_id: StoreText | None = None
    config: RolloutConfig | None = None
    metadata: dict[str, Any] | None = None
    worker_id: StoreText | None = None
    queue: QueueName | None = Field(default=None, min_length=1, max_length=255)
    """Where a retry of it is queued (default: the default queue)."""


class Claiming(Request):
    """A request that claims rollouts of `queue` (None: the default queue), waiting up to `wait` seconds for work."""

    wait_field: ClassVar[str | None] = "wait"
    claims: ClassVar[bool] = True
    wait: float = Field(default=0.0, ge=0, description=f"seconds; one HTTP request waits at most {MAX_WAIT_SECONDS:g}")
    queue: QueueName | None = Field(default=None, min_length=1, max_length=255)


class DequeueRollouts(Claiming):
    """Claim up to `limit` rollouts of `queue`, oldest first: each becomes preparing with a new attempt. With an
    empty queue, answer at once, or wait up to `wait` seconds for work."""

    method: ClassVar[str] = "dequeue_many_rollouts"
    response: ClassVar[Any] = list[AttemptedRollout]
    limit: int = Field(default=1, ge=0, le=MAX_COUNT)
    worker_id: StoreText | None = None


class DequeueRollout(Claiming):
    """Claim the oldest rollout of `queue` (None when it stays empty for `wait` seconds)."""

    method: ClassVar[str] = "dequeue_rollout"
    response: ClassVar[Any] = AttemptedRollout | None
    worker_id: StoreText | None = None


class ClaimRollouts(Claiming):
    """A runner's claim in one request: up to one rollout of `queue` for each of `worker_ids`, oldest first (the
    i-th claimed goes to `worker_ids[i]`), each with a new attempt already `running` under its worker, and the
    resources they name that the caller lacks: those whose id is not in `known_resources` (id -> the version the
    caller has) or whose version there differs. With an empty queue, answer at once, or wait up to `wait` seconds.

    It stands for `dequeue_many_rollouts`, an `update_attempt(status="running", worker_id=...)` per rollout and a
    `get_resources_by_id` per resources id, the requests a runner would otherwise send."""

    method: ClassVar[str] = "claim_rollouts"
    response: ClassVar[Any] = Claim
    worker_ids: list[StoreText] = Field(min_length=1, max_length=1024)
    known_resources: dict[StoreText, int] = {}


def claimed_any(answer: AttemptedRollout | list[AttemptedRollout] | Claim | None) -> bool:
    """Whether a dequeue or claim answer holds a rollout (a waiting claim asks again until one does)."""
    return bool(answer.rollouts if isinstance(answer, Claim) else answer)


class StartAttempt(Request):
    """A new attempt of `rollout_id` (its latest from now on)."""

    method: ClassVar[str] = "start_attempt"
    response: ClassVar[Any] = AttemptedRollout
    rollout_id: StoreText
    worker_id: StoreText | None = None


class GetRolloutById(Read):
    """The rollout (with its latest attempt, if it has one), or null for an unknown id."""

    method: ClassVar[str] = "get_rollout_by_id"
    response: ClassVar[Any] = AttemptedRollout | Rollout | None
    rollout_id: StoreText


class QueryRollouts(Page):
    """Rollouts matching the filters (all given filters combined with `filter_logic`); those with an attempt come
    with their latest one."""

    method: ClassVar[str] = "query_rollouts"
    # AttemptedRollout first: a rollout that comes with its attempt keeps it.
    response: ClassVar[Any] = PaginatedResult[AttemptedRollout | Rollout]
    status_in: list[RolloutStatus] | None = None
    rollout_id_in: list[StoreText] | None = None
    rollout_id_contains: StoreText | None = None
    mode: RolloutMode | None = None
    queue: QueueName | None = None
    """Only the rollouts of this queue (None: every queue)."""
    filter_logic: FilterLogic = "and"
    sort_by: Literal["rollout_id", "start_time", "end_time", "status", "mode", "resources_id"] | None = None


class UpdateRollout(Request):
    """Change the fields given (an explicit null clears one); `status` moves the rollout as the lifecycle says."""

    method: ClassVar[str] = "update_rollout"
    response: ClassVar[Any] = Rollout
    rollout_id: StoreText
    input: TaskInput = None
    mode: RolloutMode | None = None
    resources_id: StoreText | None = None
    status: RolloutStatus | None = None
    config: RolloutConfig | None = None
    metadata: dict[str, Any] | None = None


class WaitForRollouts(Read):
    """The rollouts among `rollout_ids` that have finished, waiting up to `timeout` seconds (None: until all have)
    for the others."""

    method: ClassVar[str] = "wait_for_rollouts"
    wait_field: ClassVar[str | None] = "timeout"
    response: ClassVar[Any] = list[Rollout]
    rollout_ids: list[StoreText]
    timeout: float | None = Field(
        default=None, ge=0, description=f"seconds; one HTTP request waits at most {MAX_WAIT_SECONDS:g}"
    )


class WaitForFinishedIds(WaitForRollouts):
    """The ids of the rollouts among `rollout_ids` that have finished, waiting up to `timeout` seconds (None: until
    all have) for the others: `wait_for_rollouts` without reading the rollouts, for a waiter that only counts them
    (a runner task's fleet, which waits on its phase's rollouts to know when they are all done)."""

    method: ClassVar[str] = "wait_for_finished_ids"
    response: ClassVar[Any] = list[str]


# --- attempts ---------------------------------------------------------------------------------


class QueryAttempts(Page):
    method: ClassVar[str] = "query_attempts"
    response: ClassVar[Any] = PaginatedResult[Attempt]
    rollout_id: StoreText
    sort_by: (
        Literal["sequence_id", "attempt_id", "start_time", "end_time", "status", "worker_id", "last_heartbeat_time"]
        | None
    ) = "sequence_id"


class GetLatestAttempt(Read):
    method: ClassVar[str] = "get_latest_attempt"
    response: ClassVar[Any] = Attempt | None
    rollout_id: StoreText


class UpdateAttempt(Request):
    """Change the fields given (an explicit null clears one); `status` moves the attempt and, for the latest
    attempt, its rollout."""

    method: ClassVar[str] = "update_attempt"
    response: ClassVar[Any] = Attempt
    rollout_id: StoreText
    attempt_id: StoreText
    status: AttemptStatus | None = None
    worker_id: StoreText | None = None
    last_heartbeat_time: float | None = None
    metadata: dict[str, Any] | None = None

    def repeatable(self) -> bool:
        # A heartbeat alone only moves a timestamp forward; anything else may move statuses.
        return self.model_fields_set == {"rollout_id", "attempt_id", "last_heartbeat_time"}


class FinishAttempt(Read):
    """A runner's last word on an attempt, in one transaction: store `spans` (numbered by the store, as
    `add_many_spans(number=True)`), then set the attempt's `status` if it is still its rollout's latest and active.
    The answer is the attempt as it stands after: a status other than the one sent means the store had moved the
    attempt on (timed out, marked unresponsive, superseded) and its verdict stands. It stands for the runner's
    span write, `get_latest_attempt` and `update_attempt(status=...)`. Repeating it changes nothing."""

    method: ClassVar[str] = "finish_attempt"
    response: ClassVar[Any] = Attempt
    rollout_id: StoreText
    attempt_id: StoreText
    status: Literal["succeeded", "failed"]
    spans: list[Span] = []


# --- spans ------------------------------------------------------------------------------------


class AddSpan(Read):
    """Store a span (the store ignores a span_id it has, so a repeat cannot duplicate); the span as stored, or
    null when it was there already."""

    method: ClassVar[str] = "add_span"
    response: ClassVar[Any] = Span | None
    span: Span


class AddManySpans(Read):
    """Store spans (each span_id once, as add_span); the spans stored. With `number`, the store gives them their
    sequence ids itself, in the list's order after each rollout's latest (what the spans carry is ignored): one
    request where get_many_span_sequence_ids + add_many_spans are two. Repeating it leaves only a gap in the
    sequence."""

    method: ClassVar[str] = "add_many_spans"
    response: ClassVar[Any] = list[Span]
    spans: list[Span]
    number: bool = False


class GetNextSpanSequenceId(Read):
    # Repeating it only leaves a gap in the sequence.
    method: ClassVar[str] = "get_next_span_sequence_id"
    response: ClassVar[Any] = int
    rollout_id: StoreText
    attempt_id: StoreText


class GetManySpanSequenceIds(Read):
    method: ClassVar[str] = "get_many_span_sequence_ids"
    response: ClassVar[Any] = list[int]
    rollout_attempt_ids: list[tuple[StoreText, StoreText]]


class QuerySpans(Page):
    """Spans of a rollout (of one attempt, with `attempt_id`), filtered, in `sequence_id` order by default."""

    method: ClassVar[str] = "query_spans"
    response: ClassVar[Any] = PaginatedResult[Span]
    rollout_id: StoreText
    attempt_id: StoreText | None = None
    trace_id: StoreText | None = None
    trace_id_contains: StoreText | None = None
    span_id: StoreText | None = None
    span_id_contains: StoreText | None = None
    parent_id: StoreText | None = None
    parent_id_contains: StoreText | None = None
    name: StoreText | None = None
    name_contains: StoreText | None = None
    filter_logic: FilterLogic = "and"
    sort_by: Literal["sequence_id", "start_time", "end_time", "name", "trace_id", "span_id", "parent_id"] | None = (
        "sequence_id"
    )


class QueryLatestSpans(Read):
    """The spans of each rollout's latest attempt, in `sequence_id` order, for many rollouts in one request (an
    adapter's read): rollout id -> spans, in the order of `rollout_ids`. A rollout without an attempt has none; an
    unknown rollout id is left out of the answer (query_spans would raise NotFoundError)."""

    method: ClassVar[str] = "query_latest_spans"
    response: ClassVar[Any] = dict[str, list[Span]]
    rollout_ids: list[StoreText] = Field(max_length=10_000)
    rewards_only: bool = False
    """Only the spans that may carry a reward: a name with `reward` in it, agent-lightning's annotation span, or
    agent-lightning's primary reward among the attributes (a summary of rewards reads these, not the LLM calls'
    spans, which hold whole prompts and token ids)."""


# --- resources --------------------------------------------------------------------------------


class AddResources(Request):
    """New resources under a new id (the latest from now on). Not repeatable: each call makes a new id."""

    method: ClassVar[str] = "add_resources"
    response: ClassVar[Any] = ResourcesUpdate
    resources: NamedResources


class UpdateResources(Request):
    """Replace the resources under `resources_id` (created if new), bump its version, make it the latest."""

    method: ClassVar[str] = "update_resources"
    response: ClassVar[Any] = ResourcesUpdate
    resources_id: StoreText = Field(min_length=1, max_length=64)
    resources: NamedResources


class GetResourcesById(Read):
    method: ClassVar[str] = "get_resources_by_id"
    response: ClassVar[Any] = ResourcesUpdate | None
    resources_id: StoreText


class GetLatestResources(Read):
    method: ClassVar[str] = "get_latest_resources"
    response: ClassVar[Any] = ResourcesUpdate | None


class QueryResources(Page):
    method: ClassVar[str] = "query_resources"
    response: ClassVar[Any] = PaginatedResult[ResourcesUpdate]
    resources_id: StoreText | None = None
    resources_id_contains: StoreText | None = None
    sort_by: Literal["resources_id", "create_time", "update_time", "version"] | None = None


# --- workers ----------------------------------------------------------------------------------


class UpdateWorker(Read):
    """A heartbeat of `worker_id` (created if new), with its stats if given (null clears them)."""

    method: ClassVar[str] = "update_worker"
    response: ClassVar[Any] = Worker
    worker_id: StoreText = Field(min_length=1, max_length=255)
    heartbeat_stats: dict[str, Any] | None = None


class GetWorkerById(Read):
    method: ClassVar[str] = "get_worker_by_id"
    response: ClassVar[Any] = Worker | None
    worker_id: StoreText


class QueryWorkers(Page):
    method: ClassVar[str] = "query_workers"
    response: ClassVar[Any] = PaginatedResult[Worker]
    status_in: list[WorkerStatus] | None = None
    worker_id_contains: StoreText | None = None
    filter_logic: FilterLogic = "and"
    sort_by: (
        Literal["worker_id", "status", "last_heartbeat_time", "last_dequeue_time", "last_busy_time", "last_idle_time"]
        | None
    ) = None


# --- housekeeping -----------------------------------------------------------------------------


class Statistics(Read):
    """Counts: agent-lightning's `total_rollouts`, `total_attempts`, `total_spans`, `total_resources`,
    `total_workers`, and by status (`rollouts`, `attempts`, `workers`)."""

    method: ClassVar[str] = "statistics"
    response: ClassVar[Any] = dict[str, Any]


class RunWatchdog(Request):
    """One watchdog pass now; how many attempts it marked timeout or unresponsive."""

    method: ClassVar[str] = "run_watchdog"
    response: ClassVar[Any] = int


REQUESTS: tuple[type[Request], ...] = (
    EnqueueRollout,
    EnqueueManyRollouts,
    StartRollout,
    DequeueRollout,
    DequeueRollouts,
    ClaimRollouts,
    StartAttempt,
    GetRolloutById,
    QueryRollouts,
    UpdateRollout,
    WaitForRollouts,
    WaitForFinishedIds,
    QueryAttempts,
    GetLatestAttempt,
    UpdateAttempt,
    FinishAttempt,
    AddSpan,
    AddManySpans,
    GetNextSpanSequenceId,
    GetManySpanSequenceIds,
    QuerySpans,
    QueryLatestSpans,
    AddResources,
    UpdateResources,
    GetResourcesById,
    GetLatestResources,
    QueryResources,
    UpdateWorker,
    GetWorkerById,
    QueryWorkers,
    Statistics,
    RunWatchdog,
)
"""Every store method, in the order of the HTTP API's documentation."""
