"""The data model shared by every layer: rollouts, attempts, spans, resources, workers, triplets.

Field names follow agent-lightning 0.3 so that agent code and stored data carry over.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any, Generic, Literal, Protocol, SupportsIndex, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from lightning.agl_import_paths import lookup

POLICY_MODEL_NAME = "policy"
"""The model name agents ask a run's LLM proxy for by default: the policy being trained, whatever the backend
serves it as."""
NO_NUL = r"^[^\x00]*$"
StoreText = Annotated[str, StringConstraints(pattern=NO_NUL)]
"""Text the store keeps in a column of its own (ids, names, keys): anything but NUL, which PostgreSQL cannot hold.
Checked by pydantic's compiled pattern, so it costs a span nothing measurable."""
MAX_SEQUENCE_ID = 2**31 - 1
"""The largest span sequence id (a 32-bit column)."""

RolloutStatus = Literal["queuing", "preparing", "running", "succeeded", "failed", "cancelled", "requeuing"]
AttemptStatus = Literal["preparing", "running", "succeeded", "failed", "timeout", "unresponsive"]
RolloutMode = Literal["train", "val", "test"]
WorkerStatus = Literal["idle", "busy", "unknown"]
TaskInput = Any

ROLLOUT_STATUSES: tuple[RolloutStatus, ...] = (
    "queuing",
    "preparing",
    "running",
    "succeeded",
    "failed",
    "cancelled",
    "requeuing",
)
ATTEMPT_STATUSES: tuple[AttemptStatus, ...] = (
    "preparing",
    "running",
    "succeeded",
    "failed",
    "timeout",
    "unresponsive",
)


# 64 random bits; os.urandom is ten times cheaper than uuid4 and ids are made on every enqueue.
def new_rollout_id() -> str:
    return f"ro-{os.urandom(8).hex()}"


def new_rollout_ids(count: int) -> list[str]:
    """`count` rollout ids from one os.urandom call, for a batch enqueue."""
    random = os.urandom(8 * count).hex()
    return [f"ro-{random[i : i + 16]}" for i in range(0, 16 * count, 16)]


def new_attempt_id() -> str:
    return f"at-{os.urandom(8).hex()}"


def new_resources_id() -> str:
    # 48 random bits: agent-lightning's length ("rs-" and 12 hex digits), which its clients and tests expect.
    return f"rs-{os.urandom(6).hex()}"


# --- Rollouts and attempts -------------------------------------------------------------------


class RolloutConfig(BaseModel):
    """Retry and timeout policy of one rollout, enforced by the store's watchdog.

    Frozen: change a rollout's policy with `update_rollout(config=...)`, not in place.
    """

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    timeout_seconds: float | None = Field(default=None, gt=0)
    """An attempt running longer than this is marked `timeout`. None: no limit."""
    unresponsive_seconds: float | None = Field(default=None, gt=0)
    """An attempt with no heartbeat or span for this long is marked `unresponsive`. None: never."""
    max_attempts: int = Field(default=1, ge=1)
    """Attempts allowed in all, the first one included."""
    retry_condition: list[AttemptStatus] = Field(default_factory=list)
    """Attempt statuses that requeue the rollout while attempts remain."""


class Rollout(BaseModel):
    """One task to run: its input, its resources, its status."""

    rollout_id: str
    input: TaskInput
    start_time: float
    end_time: float | None = None
    mode: RolloutMode | None = None
    resources_id: str | None = None
    status: RolloutStatus = "queuing"
    config: RolloutConfig = Field(default_factory=RolloutConfig)
    metadata: dict[str, Any] | None = None


class Attempt(BaseModel):
    """One execution of a rollout by a worker; a retry is a new attempt."""

    rollout_id: str
    attempt_id: str
    sequence_id: int
    """1 for the first attempt of its rollout, 2 for the first retry, and so on."""
    start_time: float
    end_time: float | None = None
    status: AttemptStatus = "preparing"
    worker_id: str | None = None
    last_heartbeat_time: float | None = None
    metadata: dict[str, Any] | None = None


class AttemptedRollout(Rollout):
    """A rollout together with its current (latest) attempt."""

    attempt: Attempt

    @model_validator(mode="after")
    def _same_rollout(self) -> AttemptedRollout:
        if self.attempt.rollout_id != self.rollout_id:
            raise ValueError(
                f"attempt.rollout_id {self.attempt.rollout_id!r} differs from rollout_id {self.rollout_id!r}"
            )
        return self


class EnqueueRolloutRequest(BaseModel):
    """The arguments of one `enqueue_rollout` call, for the batch form."""

    input: TaskInput
    mode: RolloutMode | None = None
    resources_id: StoreText | None = None
    config: RolloutConfig | None = None
    metadata: dict[str, Any] | None = None
    idempotency_key: StoreText | None = Field(default=None, min_length=1, max_length=255)
    """Enqueuing the same key twice returns the first rollout instead of a new one."""
    queue: StoreText | None = Field(default=None, min_length=1, max_length=255)
    """The queue it waits in (None: the default queue); runners take from one queue. A training run uses its own."""


class Worker(BaseModel):
    """A runner as the store sees it: status and heartbeat times."""

    worker_id: str
    status: WorkerStatus = "unknown"
    heartbeat_stats: dict[str, Any] | None = None
    last_heartbeat_time: float | None = None
    last_dequeue_time: float | None = None
    last_busy_time: float | None = None
    last_idle_time: float | None = None
    current_rollout_id: str | None = None
    current_attempt_id: str | None = None


# --- Resources -------------------------------------------------------------------------------


class LLM(BaseModel):
    """An OpenAI-compatible endpoint and the sampling parameters to call it with."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    resource_type: Literal["llm"] = "llm"
    """What this resource is: an LLM endpoint."""
    endpoint: str
    """The OpenAI base URL (".../v1")."""
    model: str
    """The model name to ask the endpoint for."""
    api_key: str | None = Field(default=None, repr=False)
    """The key to send (None: none)."""
    sampling_parameters: dict[str, Any] = Field(default_factory=dict)
    """Sampling parameters to call it with (temperature, max_tokens, ...)."""

    @property
    def base_url(self) -> str:
        """What the OpenAI SDK takes as `base_url`."""
        return self.endpoint

    def get_base_url(self, *args: Any, **kwargs: Any) -> str:
        return self.endpoint

    async def http_session(self) -> Any:
        """A kept-alive `aiohttp.ClientSession` to call the endpoint with, shared by the agents on this event loop
        and closed with it (`lightning.agent_session`): not yours to close. A session per rollout costs a new TCP
        connection per call; give each request its own timeout."""
        from lightning.agent_session import loop_session

        return await loop_session()


def route_signature(token: str, rollout_id: str, attempt_id: str) -> str:
    """The mark of a proxy route made from a claimed attempt: an HMAC of the ids under the proxy's token (which the
    run's LLM resource carries as its api_key). It proves nothing the store would not; it saves the proxy asking."""
    message = f"{rollout_id}/{attempt_id}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()[:32]


class ProxyLLM(LLM):
    """An LLM reached through the LLM proxy, which routes calls per rollout and attempt."""

    resource_type: Literal["proxy_llm"] = "proxy_llm"  # type: ignore[assignment]

    def get_base_url(self, rollout_id: str | None = None, attempt_id: str | None = None) -> str:
        """The endpoint with `/rollout/{rollout_id}/attempt/{attempt_id}` spliced in before `/v1`; with an
        `api_key` (the proxy's token), followed by `/signed/{route_signature(...)}`: the proxy then knows the route
        came from a runner and does not ask the store whether the attempt exists."""
        if rollout_id is None and attempt_id is None:
            return self.endpoint
        return self._route(rollout_id, attempt_id, self.api_key)

    def _route(self, rollout_id: str | None, attempt_id: str | None, key: str | None) -> str:
        if not rollout_id or not attempt_id:
            raise ValueError("ProxyLLM.get_base_url needs both rollout_id and attempt_id, or neither")
        prefix = self.endpoint.rstrip("/")
        has_v1 = prefix.endswith("/v1")
        if has_v1:
            prefix = prefix[: -len("/v1")]
        routed = f"{prefix}/rollout/{rollout_id}/attempt/{attempt_id}"
        if key:
            routed += f"/signed/{route_signature(key, rollout_id, attempt_id)}"
        return f"{routed}/v1" if has_v1 else routed

    def with_attempted_rollout(self, rollout: AttemptedRollout) -> LLM:
        """A plain `LLM` whose endpoint already carries this rollout's route; a rollout enqueued with a sampling
        seed (`metadata["seed"]`, see `lightning.seeding`) gets it in `sampling_parameters` unless they set one."""
        return self.for_attempt(rollout, self.api_key)

    def for_attempt(self, rollout: AttemptedRollout, key: str | None) -> LLM:
        """`with_attempted_rollout`, its route signed with and its `api_key` set to `key` (the runner's: the proxy's
        token from its environment, as the store never holds it)."""
        parameters = dict(self.sampling_parameters)
        seed = (rollout.metadata or {}).get("seed")
        if isinstance(seed, int) and "seed" not in parameters:
            parameters["seed"] = seed
        return self._plain(self._route(rollout.rollout_id, rollout.attempt.attempt_id, key), key, parameters)

    def with_attempted_rollout_ids(self, rollout_id: str, attempt_id: str) -> LLM:
        """A plain `LLM` whose endpoint carries the route of this rollout and attempt."""
        return self._plain(
            self._route(rollout_id, attempt_id, self.api_key), self.api_key, dict(self.sampling_parameters)
        )

    def _plain(self, endpoint: str, key: str | None, parameters: dict[str, Any]) -> LLM:
        # Built from this validated resource's fields, not validated again: a rollout's runner makes one, 18 us.
        return LLM.model_construct(endpoint=endpoint, model=self.model, api_key=key, sampling_parameters=parameters)


class PromptTemplate(BaseModel):
    """A prompt with placeholders, rendered with Python's str.format or with Jinja2."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    resource_type: Literal["prompt_template"] = "prompt_template"
    """What this resource is: a prompt template."""
    template: str
    """The text, with {placeholders} (f-string) or {{ placeholders }} (jinja)."""
    engine: Literal["f-string", "jinja"] = "f-string"
    """How the template is rendered: Python's str.format or Jinja2."""

    def format(self, **kwargs: Any) -> str:
        if self.engine == "f-string":
            try:
                return self.template.format(**kwargs)
            except KeyError as exc:
                raise ValueError(f"PromptTemplate needs a value for placeholder {exc.args[0]!r}") from None
        import jinja2

        env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
        try:
            return env.from_string(self.template).render(**kwargs)
        except jinja2.UndefinedError as exc:
            raise ValueError(f"PromptTemplate (jinja): {exc.message}") from None


Resource = Annotated[LLM | ProxyLLM | PromptTemplate, Field(discriminator="resource_type")]
ResourceUnion = Resource  # agent-lightning's name for the union
NamedResources = dict[str, Resource]


class ResourcesUpdate(BaseModel):
    """A versioned snapshot of named resources (models, prompts, endpoints) that rollouts run with."""

    resources_id: str
    create_time: float
    update_time: float
    version: int
    resources: NamedResources


class Claim(BaseModel):
    """What `claim_rollouts` answers: the rollouts claimed, each with its new attempt already running, and the
    resources they name that the caller did not have (or had at an older version)."""

    rollouts: list[AttemptedRollout]
    resources: list[ResourcesUpdate] = []


# --- Datasets and query results --------------------------------------------------------------

T_co = TypeVar("T_co", covariant=True)


class Dataset(Protocol[T_co]):
    """agent-lightning's dataset type: anything with `len()` and `[i]` (a list will do)."""

    def __getitem__(self, index: SupportsIndex, /) -> T_co: ...

    def __len__(self) -> int: ...


T = TypeVar("T")


class PaginatedResult(BaseModel, Generic[T]):
    """One page of a query (agent-lightning 0.3's shape): `items`, the `limit` and `offset` asked for, and `total`,
    how many match the query in all. It reads like the list of its items: `len`, iteration, indexing, and `==` a
    list compares the items."""

    items: list[T]
    limit: int = -1
    offset: int = 0
    total: int = 0

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[T]:  # type: ignore[override] (pydantic iterates over fields; a page over items)
        return iter(self.items)

    def __getitem__(self, index: Any) -> Any:
        return self.items[index]

    def __bool__(self) -> bool:
        return bool(self.items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list | tuple):
            return self.items == list(other)
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PaginatedResult({self.items!r}, limit={self.limit}, offset={self.offset}, total={self.total})"


# --- Spans -----------------------------------------------------------------------------------

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]
Attributes = dict[str, Any]
StatusCode = Literal["UNSET", "OK", "ERROR"]
TraceState = dict[str, str]


class SpanContext(BaseModel):
    model_config = ConfigDict(extra="allow")

    trace_id: str
    span_id: str
    is_remote: bool = False
    trace_state: dict[str, str] = Field(default_factory=dict)


class TraceStatus(BaseModel):
    model_config = ConfigDict(extra="allow")

    status_code: StatusCode = "UNSET"
    description: str | None = None


class Event(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    attributes: Attributes = Field(default_factory=dict)
    timestamp: float | None = None


class Link(BaseModel):
    model_config = ConfigDict(extra="allow")

    context: SpanContext
    attributes: Attributes | None = None


class OtelResource(BaseModel):
    attributes: Attributes = Field(default_factory=dict)
    schema_url: str = ""


class Span(BaseModel):
    """An OpenTelemetry span plus the rollout, attempt and per-rollout sequence id it belongs to."""

    model_config = ConfigDict(extra="allow")

    rollout_id: StoreText
    attempt_id: StoreText
    sequence_id: int = Field(le=MAX_SEQUENCE_ID)
    trace_id: StoreText
    span_id: StoreText
    parent_id: StoreText | None = None
    name: StoreText
    status: TraceStatus = Field(default_factory=TraceStatus)
    attributes: Attributes = Field(default_factory=dict)
    events: list[Event] = Field(default_factory=list)
    links: list[Link] = Field(default_factory=list)
    start_time: float | None = None
    end_time: float | None = None
    context: SpanContext | None = None
    parent: SpanContext | None = None
    resource: OtelResource = Field(default_factory=OtelResource)

    @classmethod
    def from_opentelemetry(cls, src: Any, rollout_id: str, attempt_id: str, sequence_id: int) -> Span:
        """Convert an `opentelemetry.sdk.trace.ReadableSpan`. (Plain data validated once: a rollout's reward span
        is converted on the runner's path, where nested models and a JSON round trip per mapping cost 30-55 us.)"""
        ctx = src.get_span_context()
        parent = src.parent
        status = src.status
        return cls.model_validate(
            {
                "rollout_id": rollout_id,
                "attempt_id": attempt_id,
                "sequence_id": sequence_id,
                "trace_id": f"{ctx.trace_id:032x}" if ctx else "0" * 32,
                "span_id": f"{ctx.span_id:016x}" if ctx else "0" * 16,
                "parent_id": f"{parent.span_id:016x}" if parent else None,
                "name": src.name,
                "status": {"status_code": status.status_code.name, "description": status.description},
                "attributes": _jsonable(src.attributes),
                "events": [
                    {"name": e.name, "attributes": _jsonable(e.attributes), "timestamp": _seconds(e.timestamp)}
                    for e in src.events
                ],
                "links": [
                    {"context": _otel_context(link.context), "attributes": _jsonable(link.attributes)}
                    for link in src.links
                ],
                "start_time": _seconds(src.start_time),
                "end_time": _seconds(src.end_time),
                "context": _otel_context(ctx) if ctx else None,
                "parent": _otel_context(parent) if parent else None,
                "resource": _resource(src.resource),
            }
        )


def _seconds(nanoseconds: int | None) -> float | None:
    return None if nanoseconds is None else nanoseconds / 1e9


def _otel_context(ctx: Any) -> dict[str, Any]:
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "is_remote": bool(ctx.is_remote),
        "trace_state": dict(ctx.trace_state.items()) if ctx.trace_state else {},
    }


_PLAIN = (str, bool, int, float)


def _jsonable(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """OpenTelemetry attributes as JSON data: tuples as lists; a value of another kind through JSON (as text)."""
    plain: dict[str, Any] = {}
    for key, value in (attributes or {}).items():
        if value is None or isinstance(value, _PLAIN):
            plain[key] = value
        elif isinstance(value, tuple | list) and all(isinstance(item, _PLAIN) for item in value):
            plain[key] = list(value)
        else:
            plain[key] = json.loads(json.dumps(value, default=str))
    return plain


_last_resource: tuple[Any, dict[str, Any]] = (None, {})  # the last OpenTelemetry resource converted, and its data


def _resource(resource: Any) -> dict[str, Any]:
    """An OpenTelemetry resource (immutable, and one a tracer provider: the same for all its spans) as plain data."""
    global _last_resource
    last = _last_resource
    if last[0] is not resource:
        last = (resource, {"attributes": _jsonable(resource.attributes), "schema_url": resource.schema_url or ""})
        _last_resource = last
    return last[1]


# --- Training data ---------------------------------------------------------------------------


class Triplet(BaseModel):
    """One LLM call made trainable: the exact prompt and response tokens and the reward it earned."""

    prompt: Any
    """Prompt token ids (or a prompt payload for non-token algorithms such as APO)."""
    response: Any
    """Response token ids (or a response payload)."""
    reward: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    """rollout_id, turn index, group id for group-relative advantages, and anything else."""
    response_mask: list[int] | None = None
    """One 0 or 1 per response token: 1 where the model generated the token (trained on), 0 where it came
    from elsewhere (tool results, user turns appended between calls of a multi-turn trajectory).
    None: every response token is the model's."""

    @model_validator(mode="after")
    def _mask_fits_response(self) -> Triplet:
        if self.response_mask is None:
            return self
        if any(bit not in (0, 1) for bit in self.response_mask):
            raise ValueError("response_mask holds only 0 and 1")
        if isinstance(self.response, list) and len(self.response_mask) != len(self.response):
            raise ValueError(
                f"response_mask has {len(self.response_mask)} entries for {len(self.response)} response tokens"
            )
        return self


SpanLike = Span
"""agent-lightning's name for what its span readers take (a Span or an OpenTelemetry ReadableSpan); ours read Spans
(`Span.from_opentelemetry` converts a ReadableSpan)."""


def __getattr__(name: str) -> Any:
    # agent-lightning's `types` also offers Hook, RolloutRawResult and SpanCoreFields, which live with the agent and
    # the tracing here (both import this module: they are looked up on first use), and SpanNames / SpanAttributeNames,
    # with our names in lightning.semconv.
    return lookup(__name__, ("lightning.agent", "lightning.tracing", "lightning.semconv"), name)


__path__: list[str] = []
"""A package for agent-lightning's paths below `agentlightning.types` (lightning.types.core, .resources, .tracer),
which lightning.agl_import_paths answers for."""
