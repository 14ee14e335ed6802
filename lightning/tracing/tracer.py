"""The tracer: a private OpenTelemetry provider whose finished spans stream into the store, per attempt."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace as trace_api
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Status, StatusCode

from lightning import semconv
from lightning.store.base import LightningStore
from lightning.tracing.instrument import API_BASE, HEADER_ATTRIBUTES, instrument_openai
from lightning.types import Span

logger = logging.getLogger(__name__)

_SCOPE_KEY = otel_context.create_key("lightning-trace-context")
_RECENT_FAILURES = 64


class SpanExportError(RuntimeError):
    """Spans could not be written to the store; the attempt's trace is incomplete."""


@dataclass(eq=False)
class _Scope:
    """One entered trace context: which attempt its spans belong to, and how many are still unwritten."""

    processor: _StoreSpanProcessor
    otel_tracer: trace_api.Tracer
    rollout_id: str
    attempt_id: str
    open: int = 0
    pending: int = 0
    waited_on: bool = False
    error: BaseException | None = None
    ended: list[ReadableSpan] = field(default_factory=list)
    """Its spans that ended, in order (`Tracer.get_last_trace`)."""
    proxied: frozenset[str] = frozenset()
    """host:port of the LLM proxies its rollout calls, which record those calls themselves."""
    tracer: Tracer | None = None
    """The tracer whose trace context it is (`get_active_tracer`)."""


@dataclass(eq=False, slots=True)
class _Ended:
    span: ReadableSpan
    scope: _Scope
    index: int


def current_scope() -> _Scope | None:
    """The trace context active in this thread or asyncio task, if any."""
    return otel_context.get_value(_SCOPE_KEY)  # type: ignore[return-value]


def get_active_tracer() -> Tracer | None:
    """The tracer whose trace context is active in this thread or asyncio task (inside a rollout: the runner's), or
    None (agent-lightning's call; its active tracer is one per process, ours one per trace context)."""
    scope = current_scope()
    return scope.tracer if scope is not None else None


class _StoreSpanProcessor(SpanProcessor):
    """Queues finished spans with their attempt and writes them to the store in batches from its own thread.

    All shared state is guarded by `_cond`; the thread only releases it to talk to the store.
    """

    def __init__(
        self, store: LightningStore | None, flush_interval: float, max_batch: int, shutdown_timeout: float
    ) -> None:
        self.store = store
        """Where spans go; set before the first trace context (a tracer made without one gets its runner's)."""
        self._flush_interval = flush_interval
        self._max_batch = max_batch
        self._shutdown_timeout = shutdown_timeout
        self._cond = threading.Condition()
        self._queue: list[_Ended] = []  # in the order the spans ended
        self._in_flight: list[_Ended] = []
        self._scopes_of_open_spans: dict[int, _Scope] = {}
        self._ended = 0  # spans queued so far; the next one gets this index
        self._failures: list[tuple[set[int], BaseException]] = []  # recent failures: span indices, error
        self._waiters = 0
        self._scopes_waited_on = 0
        self._listeners: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._export_loop, name="lightning-span-exporter", daemon=True)
        self._thread.start()

    # --- called by the OpenTelemetry SDK, on the thread that starts or ends the span ---------

    def on_start(self, span: SdkSpan, parent_context: otel_context.Context | None = None) -> None:
        # An explicit parent context wins (instrumentation may carry one across threads);
        # a context built from scratch falls back to the caller's own.
        scope = (parent_context is not None and otel_context.get_value(_SCOPE_KEY, parent_context)) or current_scope()
        if scope is None or scope.processor is not self:
            return
        with self._cond:
            self._scopes_of_open_spans[span.context.span_id] = scope
            scope.open += 1

    def on_end(self, span: ReadableSpan) -> None:
        with self._cond:
            scope = self._scopes_of_open_spans.pop(span.context.span_id, None)
            if scope is None:
                return
            scope.open -= 1
            self._queue_ended(span, scope)

    def add_ended(self, span: ReadableSpan, scope: _Scope) -> None:
        """A span that never was open (`Tracer.record_instant`'s), queued as `on_end` queues one."""
        with self._cond:
            self._queue_ended(span, scope)

    def _queue_ended(self, span: ReadableSpan, scope: _Scope) -> None:
        scope.ended.append(span)
        if self._stopping:
            scope.error = scope.error or SpanExportError(f"span {span.name!r} ended after the tracer shut down")
            return
        self._queue.append(_Ended(span, scope, self._ended))
        self._ended += 1
        scope.pending += 1
        if len(self._queue) == 1 or len(self._queue) >= self._max_batch or self._waiters:
            self._cond.notify_all()

    def discard(self, span: ReadableSpan) -> None:
        """Forget a span started in a scope, instead of ending it there (lightning.tracing.instrument's call)."""
        with self._cond:
            scope = self._scopes_of_open_spans.pop(span.context.span_id, None)
            if scope is not None:
                scope.open -= 1

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(self._shutdown_timeout)
        if self._thread.is_alive():
            logger.warning("the span exporter is still writing after %s s; leaving it behind", self._shutdown_timeout)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            self.flush(timeout_millis / 1000)
        except (TimeoutError, SpanExportError):
            return False
        return True

    # --- waiting for spans to reach the store -------------------------------------------------

    def flush(self, timeout: float) -> None:
        """Block until every span ended so far is written; raise if writing any of them failed."""
        with self._cond:
            first, stop = self._oldest_unwritten(), self._ended
        self._wait_until(lambda: self._oldest_unwritten() >= stop, timeout, "spans")
        self._raise_failures_between(first, stop)

    async def aflush(self, timeout: float) -> None:
        with self._cond:
            first, stop = self._oldest_unwritten(), self._ended
        await self._await_until(lambda: self._oldest_unwritten() >= stop, timeout, "spans")
        self._raise_failures_between(first, stop)

    def flush_scope(self, scope: _Scope, timeout: float) -> None:
        with self._waiting_on(scope):
            self._wait_until(lambda: scope.pending == 0, timeout, _describe(scope))
        _raise_scope_error(scope)

    async def aflush_scope(self, scope: _Scope, timeout: float) -> None:
        with self._cond:
            written = scope.pending == 0  # the runner's exits, mostly: it took the scope's spans (`take_scope`)
        if not written:
            with self._waiting_on(scope):
                await self._await_until(lambda: scope.pending == 0, timeout, _describe(scope))
        _raise_scope_error(scope)

    def take_scope(self, scope: _Scope) -> list[Span]:
        """Take the scope's spans that wait in the queue out of it, as store spans (their sequence id left for the
        store to give): the caller writes them itself. Spans already being written stay with the exporter."""
        with self._cond:
            taken = [item for item in self._queue if item.scope is scope]
            listeners = []
            if taken:
                self._queue = [item for item in self._queue if item.scope is not scope]
                scope.pending -= len(taken)
                if self._waiters:  # waiters on "everything up to here is written" may be done now
                    self._cond.notify_all()
                    listeners = list(self._listeners)
        _wake(listeners)
        return [Span.from_opentelemetry(item.span, scope.rollout_id, scope.attempt_id, 0) for item in taken]

    @contextlib.contextmanager
    def _waiting_on(self, scope: _Scope) -> Iterator[None]:
        """While a trace context waits at its exit, its spans jump the queue: under load, the exit
        costs one store write rather than the whole backlog of other attempts."""
        with self._cond:
            scope.waited_on = True
            self._scopes_waited_on += 1
        try:
            yield
        finally:
            with self._cond:
                scope.waited_on = False
                self._scopes_waited_on -= 1

    def _oldest_unwritten(self) -> int:
        """Index of the oldest span not yet written (or failed); every older one is done."""
        oldest = [items[0].index for items in (self._queue, self._in_flight) if items]
        return min(oldest, default=self._ended)

    def _wait_until(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            self._waiters += 1  # tells the exporter not to wait for the interval
            self._cond.notify_all()
            try:
                while not done():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(f"{what} not written to the store within {timeout} s")
                    self._cond.wait(remaining)
            finally:
                self._waiters -= 1

    async def _await_until(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        wake = asyncio.Event()
        listener = (asyncio.get_running_loop(), wake)
        with self._cond:
            self._waiters += 1
            self._listeners.add(listener)
            self._cond.notify_all()
        try:
            while True:
                wake.clear()
                with self._cond:
                    if done():
                        return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{what} not written to the store within {timeout} s")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), remaining)
        finally:
            with self._cond:
                self._waiters -= 1
                self._listeners.discard(listener)

    def _raise_failures_between(self, first: int, stop: int) -> None:
        with self._cond:
            errors = [error for indices, error in self._failures if any(first <= i < stop for i in indices)]
        if errors:
            raise SpanExportError(f"spans could not be written to the store: {errors[0]}") from errors[0]

    # --- the exporter thread ------------------------------------------------------------------

    def _export_loop(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            while (batch := self._take_batch()) is not None:
                try:
                    failures = loop.run_until_complete(self._write_batch(batch))
                except BaseException as exc:  # never leave waiters hanging on a dead thread
                    failures = [(batch, exc)]
                self._mark_processed(batch, failures)
        finally:
            # As asyncio.run ends a loop: async generators closed first (an HTTP store client's session for this
            # loop is held by one, and closes with it instead of being reported unclosed later).
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _take_batch(self) -> list[_Ended] | None:
        """The next spans to write (None: shut down and drained). Waits for a first span, then up to
        flush_interval for more, unless someone is waiting for a flush or a batch is full. Spans taken out of the
        queue meanwhile (a trace context's hand-over, `take_scope`) leave it waiting for the next: an empty queue
        ends the thread only in a shutdown."""
        with self._cond:
            while True:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                self._cond.wait_for(self._should_write_now, timeout=self._flush_interval)
                if self._queue:
                    self._in_flight = self._pop_batch()
                    return self._in_flight
                if self._stopping:
                    return None

    def _pop_batch(self) -> list[_Ended]:
        """Up to max_batch spans: the oldest, or, while trace contexts wait at their exit, only theirs (so
        an exit under load costs one small write, not the backlog of other attempts). Sequence ids are per
        rollout, and each attempt's spans keep their order."""
        if self._scopes_waited_on:
            urgent = [item for item in self._queue if item.scope.waited_on][: self._max_batch]
            if urgent:
                taken = {id(item) for item in urgent}
                self._queue = [item for item in self._queue if id(item) not in taken]
                return urgent
        batch = self._queue[: self._max_batch]
        del self._queue[: self._max_batch]
        return batch

    def _should_write_now(self) -> bool:
        return self._stopping or len(self._queue) >= self._max_batch or (bool(self._queue) and self._waiters > 0)

    async def _write_batch(self, batch: list[_Ended]) -> list[tuple[list[_Ended], BaseException]]:
        """Write the batch; on failure write each attempt's spans apart, so that one bad attempt
        (deleted, say) does not cost the others their spans. Returns what failed, and why."""
        try:
            await self._write_spans(batch)
            return []
        except Exception as exc:
            by_attempt = _group_by_attempt(batch)
            if len(by_attempt) == 1:
                return [(batch, exc)]
        failures: list[tuple[list[_Ended], BaseException]] = []
        for group in by_attempt:
            try:
                await self._write_spans(group)
            except Exception as exc:
                failures.append((group, exc))
        return failures

    async def _write_spans(self, batch: list[_Ended]) -> None:
        # One request: the store numbers the spans in this order (per rollout).
        spans = [Span.from_opentelemetry(item.span, item.scope.rollout_id, item.scope.attempt_id, 0) for item in batch]
        assert self.store is not None, "a trace context opened before the tracer had a store"
        await self.store.add_many_spans(spans, number=True)

    def _mark_processed(self, batch: list[_Ended], failures: list[tuple[list[_Ended], BaseException]]) -> None:
        for group, error in failures:
            logger.error(
                "could not write %d span(s) of %s to the store: %s", len(group), _describe(group[0].scope), error
            )
        with self._cond:
            for group, error in failures:
                for item in group:
                    item.scope.error = item.scope.error or error
                self._failures.append(({item.index for item in group}, error))
            del self._failures[:-_RECENT_FAILURES]
            for item in batch:
                item.scope.pending -= 1
            self._in_flight = []
            self._cond.notify_all()
            listeners = list(self._listeners)
        _wake(listeners)


def _wake(listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
    """Wake the async waiters (`_await_until`) on their loops."""
    for loop, wake in listeners:
        with contextlib.suppress(RuntimeError):  # the waiter's loop has closed
            loop.call_soon_threadsafe(wake.set)


def _group_by_attempt(batch: list[_Ended]) -> list[list[_Ended]]:
    groups: dict[tuple[str, str], list[_Ended]] = {}
    for item in batch:
        groups.setdefault((item.scope.rollout_id, item.scope.attempt_id), []).append(item)
    return list(groups.values())


def _describe(scope: _Scope) -> str:
    return f"spans of rollout {scope.rollout_id!r} attempt {scope.attempt_id!r}"


def _raise_scope_error(scope: _Scope) -> None:
    if scope.error is not None:
        raise SpanExportError(f"{_describe(scope)} could not be written to the store: {scope.error}") from scope.error


def _raise_unless_block_failed(flush_error: BaseException, block_error: BaseException | None) -> None:
    # The block's own exception says more than a failed flush, and fails the attempt anyway.
    if block_error is None:
        raise flush_error
    logger.error("%s (while the block itself raised %r)", flush_error, block_error)


class TraceContext:
    """Marks the spans started inside it (in this thread or asyncio task) as the attempt's, and on exit
    blocks until they are all in the store. Use `with` in sync code, `async with` to wait without blocking
    the event loop; a plain `with` works in async code too, blocking the loop for one store write."""

    def __init__(self, tracer: Tracer, rollout_id: str, attempt_id: str, name: str | None, hand_over: bool) -> None:
        if not rollout_id or not attempt_id:
            raise ValueError(f"trace_context needs a rollout_id and an attempt_id, got {rollout_id!r}, {attempt_id!r}")
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id
        self.name = name
        self.root_span: trace_api.Span | None = None
        self.hand_over = hand_over
        self.proxied: frozenset[str] = frozenset()
        """host:port of the LLM proxies the attempt calls: calls to them that the OpenAI SDK's instrumentation sees
        are left to the proxy's spans (lightning.tracing.instrument)."""
        self.handed_over: list[Span] = []
        """With `hand_over`: after the exit, the spans the exporter had not started writing, for the caller to
        write (the runner sends them with the attempt's final status, one request for both)."""
        self._tracer = tracer
        self._scope: _Scope | None = None
        self._token: object | None = None

    def __enter__(self) -> TraceContext:
        self._open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        scope = self._close(exc)
        try:
            scope.processor.flush_scope(scope, self._tracer.flush_timeout)
        except (SpanExportError, TimeoutError) as flush_error:
            _raise_unless_block_failed(flush_error, exc)

    async def __aenter__(self) -> TraceContext:
        self._open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        scope = self._close(exc)
        try:
            await scope.processor.aflush_scope(scope, self._tracer.flush_timeout)
        except (SpanExportError, TimeoutError) as flush_error:
            _raise_unless_block_failed(flush_error, exc)

    def _open(self) -> None:
        if self._scope is not None:
            raise RuntimeError("this trace context is already active; make a new one with tracer.trace_context()")
        self._scope = self._tracer._new_scope(self.rollout_id, self.attempt_id)
        self._scope.proxied = self.proxied
        ctx = otel_context.set_value(_SCOPE_KEY, self._scope)
        # The attempt's spans form their own traces: a span around the runner is not in the store,
        # and a parent id pointing at it would dangle.
        ctx = trace_api.set_span_in_context(trace_api.INVALID_SPAN, ctx)
        if self.name is not None:
            self.root_span = self._scope.otel_tracer.start_span(
                self.name,
                context=ctx,
                attributes={semconv.ROLLOUT_ID: self.rollout_id, semconv.ATTEMPT_ID: self.attempt_id},
            )
            ctx = trace_api.set_span_in_context(self.root_span, ctx)
        self._token = otel_context.attach(ctx)

    def _close(self, exc: BaseException | None) -> _Scope:
        scope = self._scope
        assert scope is not None, "trace context exited without being entered"
        if self.root_span is not None:
            if exc is not None:
                self.root_span.record_exception(exc)
                self.root_span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            self.root_span.end()
        otel_context.detach(self._token)  # type: ignore[arg-type]
        self._scope = None
        if self.hand_over:
            self.handed_over = scope.processor.take_scope(scope)
        if scope.open:
            logger.warning(
                "%d span(s) of %s are still open; each is written when it ends", scope.open, _describe(scope)
            )
        return scope


class Tracer:
    """Records spans with a private OpenTelemetry TracerProvider and streams them into `store`.

    Finished spans are written in batches of up to `max_batch` every `flush_interval` seconds (so a long
    rollout's spans reach the store as it runs), and at once when a trace context exits or `flush` is called.

    Made without a store (agent-lightning's `OtelTracer()`), it takes its runner's: `LitAgentRunner(tracer)`'s
    `run_context(agent=, store=)` hands it over (`init_worker`).
    """

    def __init__(
        self,
        store: LightningStore | None = None,
        *,
        flush_interval: float = 0.2,
        max_batch: int = 512,
        flush_timeout: float = 30.0,
    ) -> None:
        if flush_interval <= 0 or max_batch <= 0 or flush_timeout <= 0:
            raise ValueError(
                f"flush_interval, max_batch and flush_timeout must be > 0, got {flush_interval}, {max_batch}, "
                f"{flush_timeout}"
            )
        self.flush_timeout = flush_timeout
        self._processor = _StoreSpanProcessor(store, flush_interval, max_batch, flush_timeout)
        self._provider = _Provider(
            # Explicit sampler, resource and limits: the SDK would otherwise read OTEL_* environment
            # variables, which could sample spans away, put env values in every span, or truncate JSON.
            sampler=ALWAYS_ON,
            resource=Resource({"service.name": "lightning"}),
            span_limits=_unlimited(),
            shutdown_on_exit=False,
        )
        self._provider.add_span_processor(self._processor)
        instrument_openai(_INSTRUMENTED_CALLS, _unlimited())  # the agent's own OpenAI client's calls: spans too
        self._otel_tracer = self._provider.get_tracer(_SCOPE_NAME)
        self._scope_info = InstrumentationScope(_SCOPE_NAME)
        self._shut_down = False
        self._last_scope: _Scope | None = None
        if isinstance(self._otel_tracer, trace_api.NoOpTracer):
            logger.warning("OTEL_SDK_DISABLED is set: no spans (and no rewards) will be recorded")

    @property
    def store(self) -> LightningStore | None:
        return self._processor.store

    def init_worker(self, worker_id: int | str = 0, store: LightningStore | None = None) -> None:
        """Write to `store` from now on (agent-lightning's call, made by its runner's `run_context`). A tracer keeps
        one store: handing it another is an error, as the spans already queued are bound for the first."""
        if store is None or store is self.store:
            return
        if self.store is not None:
            raise ValueError(f"this tracer writes to {self.store!r}; make another tracer for {store!r}")
        self._processor.store = store

    def init(self, *args: object, **kwargs: object) -> None:
        """agent-lightning's setup call: nothing to set up (the provider is made with the tracer)."""

    def teardown_worker(self, *args: object, **kwargs: object) -> None:
        """agent-lightning's call at a worker's end: the spans of every trace context are in the store already."""

    def teardown(self, *args: object, **kwargs: object) -> None:
        """agent-lightning's call at the runner's end; `shutdown` stops the tracer for good."""

    def get_last_trace(self) -> list[Span]:
        """The spans of the latest trace context so far, in the order they ended (agent-lightning's debugging call,
        made from a `Hook.on_trace_end`)."""
        scope = self._last_scope
        if scope is None:
            return []
        with self._processor._cond:
            ended = list(scope.ended)
        return [Span.from_opentelemetry(span, scope.rollout_id, scope.attempt_id, 0) for span in ended]

    @property
    def otel_tracer(self) -> trace_api.Tracer:
        """An OpenTelemetry tracer for manual spans; its spans inside a trace context go to the store."""
        return self._otel_tracer

    @property
    def tracer_provider(self) -> TracerProvider:
        """The private provider, for instrumentation libraries that take `tracer_provider=`."""
        return self._provider

    def record_instant(self, scope: _Scope, name: str, attributes: dict[str, Any]) -> bool:
        """Record a span that starts and ends at once (an emitter's: a reward, a message) in `scope`, one of this
        tracer's trace contexts, as the SDK records it (a child of the current span, ids from the provider's
        generator, its resource) without the SDK's span machinery: its sampler, limits, locks and two processor
        calls were half of a reward span's cost to the runner (86.5 -> 43.2 us: benchmarks/call_paths.py). False,
        recording nothing, where the provider has processors besides ours (someone's exporter, which must see the
        span) or the SDK is disabled: the caller starts and ends the span through the SDK."""
        if self._provider.processors != 1 or isinstance(self._otel_tracer, trace_api.NoOpTracer):
            return False
        parent = trace_api.get_current_span().get_span_context()
        ids = self._provider.id_generator
        if parent.is_valid:
            context = trace_api.SpanContext(
                parent.trace_id, ids.generate_span_id(), False, _SAMPLED, trace_state=parent.trace_state
            )
        else:
            parent = None
            context = trace_api.SpanContext(ids.generate_trace_id(), ids.generate_span_id(), False, _SAMPLED)
        now = time.time_ns()
        span = ReadableSpan(
            name,
            context=context,
            parent=parent,
            resource=self._provider.resource,
            attributes=MappingProxyType(dict(attributes)),  # read-only, as the SDK's ended span's
            status=_UNSET,
            start_time=now,
            end_time=now,
            instrumentation_scope=self._scope_info,
        )
        self._processor.add_ended(span, scope)
        return True

    def trace_context(
        self, rollout_id: str, attempt_id: str, *, name: str | None = None, hand_over: bool = False
    ) -> TraceContext:
        """Attribute spans to this attempt inside the block, optionally under a root span called `name`;
        on exit, wait (up to flush_timeout) until they are in the store, raising if writing failed. With
        `hand_over`, the spans still queued at the exit are not written but left in the context's `handed_over`
        for the caller to write (the exit then waits only for those already being written)."""
        return TraceContext(self, rollout_id, attempt_id, name, hand_over)

    def get_langchain_handler(self) -> None:
        """agent-lightning's LangChain callback handler: None here, as the LLM proxy records every call the agent
        makes through its LLM resource (agent-lightning code passes `callbacks=[handler] if handler else []`)."""
        return None

    def flush(self, timeout: float = 30.0) -> None:
        """Block until every span ended so far is in the store; raise SpanExportError if writing failed."""
        self._processor.flush(timeout)

    async def aflush(self, timeout: float = 30.0) -> None:
        """`flush` without blocking the event loop."""
        await self._processor.aflush(timeout)

    def shutdown(self) -> None:
        """Write what is queued (waiting up to flush_timeout), stop the exporter thread and the provider.
        Spans ending later are not recorded. The store stays open."""
        if self._shut_down:
            return
        self._shut_down = True
        self._provider.shutdown()

    def _new_scope(self, rollout_id: str, attempt_id: str) -> _Scope:
        if self._shut_down:
            raise RuntimeError("the tracer is shut down")
        if self.store is None:
            raise RuntimeError(
                "this tracer has no store: make it with Tracer(store), or run it under a runner "
                "(LitAgentRunner(tracer).run_context(agent=..., store=...))"
            )
        self._last_scope = _Scope(self._processor, self._otel_tracer, rollout_id, attempt_id, tracer=self)
        return self._last_scope


class _Provider(TracerProvider):
    """The tracer's private provider, counting its span processors: with ours alone, `Tracer.record_instant` may
    record a span without the SDK (no other processor misses it)."""

    processors = 0

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        self.processors += 1


_SCOPE_NAME = "lightning.tracing"
_SAMPLED = trace_api.TraceFlags(trace_api.TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)


class _ToTraceContext(SpanProcessor):
    """Hands each span of the instrumented OpenAI SDK (lightning.tracing.instrument) to the tracer whose trace context
    is active where it starts: a call outside any is dropped, a call to the rollout's LLM proxy is left to the proxy's
    span (which has the token ids), and the request headers are never kept."""

    def __init__(self) -> None:
        self._scopes: dict[int, _Scope] = {}
        self._guard = threading.Lock()

    def on_start(self, span: SdkSpan, parent_context: otel_context.Context | None = None) -> None:
        scope = current_scope()
        if scope is None:
            return
        with self._guard:
            self._scopes[span.context.span_id] = scope
        scope.processor.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        with self._guard:
            scope = self._scopes.pop(span.context.span_id, None)
        if scope is None:
            return
        if urlsplit(str((span.attributes or {}).get(API_BASE, ""))).netloc in scope.proxied:
            scope.processor.discard(span)
        else:
            scope.processor.on_end(_as_recorded(span))


AGL_SPAN_NAMES = {"openai.chat": "openai.chat.completion"}
"""The instrumentation's span names that agent-lightning's tracer (AgentOps) names otherwise, as agl's scripts look
for them (`"chat.completion" in span.name`)."""


def _as_recorded(span: ReadableSpan) -> ReadableSpan:
    """The span as the store gets it: without request headers (they may hold credentials), named as agl names it."""
    attributes = span.attributes or {}
    if not any(name in attributes for name in HEADER_ATTRIBUTES) and span.name not in AGL_SPAN_NAMES:
        return span
    return ReadableSpan(
        name=AGL_SPAN_NAMES.get(span.name, span.name),
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes={name: value for name, value in attributes.items() if name not in HEADER_ATTRIBUTES},
        events=span.events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


_INSTRUMENTED_CALLS = _ToTraceContext()

OtelTracer = Tracer
"""agent-lightning's OpenTelemetry tracer, by its name: ours is OpenTelemetry underneath (a provider of its own)."""


class AgentOpsTracer(Tracer):
    """agent-lightning's AgentOps tracer, by its name: where agl's examples pick it, it only selects a tracer, so
    this is ours. AgentOps's keywords are accepted and change nothing; no AgentOps service or account is used."""

    def __init__(
        self,
        store: LightningStore | None = None,
        *,
        agentops_managed: bool = True,
        instrument_managed: bool = True,
        daemon: bool = True,
        **options: float,
    ) -> None:
        super().__init__(store, **options)  # type: ignore[arg-type]


_SPAN_LIMITS = ("max_attributes", "max_events", "max_links", "max_span_attributes", "max_event_attributes",
                "max_link_attributes", "max_attribute_length", "max_span_attribute_length")  # fmt: skip
"""Every limit a SpanLimits takes (OpenTelemetry's defaults cap attributes at 128 and their length not at all)."""


def _unlimited() -> SpanLimits:
    # Spans are training data: a truncated JSON attribute or a dropped token-id attribute corrupts it.
    return SpanLimits(**dict.fromkeys(_SPAN_LIMITS, SpanLimits.UNSET))
