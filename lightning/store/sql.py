"""The store on SQLAlchemy: a SQLite file (WAL) by default, in-memory SQLite for tests, PostgreSQL by URL.

How it runs: each store call is one short transaction written as a plain function over a
SQLAlchemy connection (`_op_*` below); the async methods only choose where that function runs.
- SQLite: inline on the caller's thread, on one connection guarded by a lock. SQLite serialises
  writers anyway; a thread hop would cost more than the statement. Writes take the write lock
  up front (BEGIN IMMEDIATE), so several processes on one file never interleave a transaction.
- PostgreSQL: on a small thread pool with a connection pool; dequeue locks rows with
  FOR UPDATE SKIP LOCKED, so concurrent workers never claim the same rollout.
Running plain functions rather than an async driver keeps one code path for both databases
and lets the same store object serve any thread or event loop (runner threads each have one).
Statements on the hot paths (`_Sql`) are built with SQLAlchemy but run on the driver's cursor;
composed queries (filters, sorting) go through SQLAlchemy as usual.

Status changes are decided by lightning.store.lifecycle; this module only applies them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import operator
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pydantic
from sqlalchemy import (
    ColumnElement,
    Connection,
    and_,
    bindparam,
    case,
    create_engine,
    event,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import IntegrityError, OperationalError, StatementError
from sqlalchemy.pool import StaticPool

from lightning import semconv
from lightning.credentials import expand
from lightning.store import contract, lifecycle
from lightning.store.base import UNSET, LightningStore
from lightning.store.contract import DEFAULT_QUEUE, Request
from lightning.store.errors import InvalidArgumentError, NotFoundError, StoreError
from lightning.store.tables import attempts, metadata, migrate, resources, rollouts, spans, workers
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
    RolloutStatus,
    Span,
    Worker,
    new_attempt_id,
    new_resources_id,
    new_rollout_id,
    new_rollout_ids,
)

logger = logging.getLogger(__name__)

DEFAULT_URL = "sqlite:///.lightning/store.db"
T = TypeVar("T")

_SPAN_LIST = pydantic.TypeAdapter(list[Span])
_NAMED_RESOURCES = pydantic.TypeAdapter(NamedResources)

_ROLLOUT_COLUMNS = [
    rollouts.c.rollout_id,
    rollouts.c.input,
    rollouts.c.start_time,
    rollouts.c.end_time,
    rollouts.c.mode,
    rollouts.c.resources_id,
    rollouts.c.status,
    rollouts.c.config,
    rollouts.c.metadata,
]
_ATTEMPT_COLUMNS = [
    attempts.c.rollout_id,
    attempts.c.attempt_id,
    attempts.c.sequence_id,
    attempts.c.start_time,
    attempts.c.end_time,
    attempts.c.status,
    attempts.c.worker_id,
    attempts.c.last_heartbeat_time,
    attempts.c.metadata,
]
_ROLLOUT_WITH_LATEST_ATTEMPT = select(
    *_ROLLOUT_COLUMNS, *[c.label(f"a_{c.name}") for c in _ATTEMPT_COLUMNS]
).select_from(rollouts.outerjoin(attempts, attempts.c.attempt_id == rollouts.c.latest_attempt_id))


@dataclass(eq=False)
class _Job:
    """A transaction's work queued for the store's SQLite thread, and the future of the loop that waits for it."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    write: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    result: Any = None
    error: BaseException | None = None


def _settle(jobs: list[_Job]) -> None:
    """On the waiting loop: each job's future gets its outcome (unless its waiter was cancelled meanwhile)."""
    for job in jobs:
        if job.future.done():
            continue
        if job.error is not None:
            job.future.set_exception(job.error)
        else:
            job.future.set_result(job.result)


def _store_error(exc: Exception) -> Exception:
    """What a failed statement means to the store's callers."""
    if isinstance(exc, StatementError):
        return _translate(exc)
    if "locked" in str(exc):
        return StoreError(f"the SQLite database stayed locked by another process for 30 s: {exc}")
    return exc


_ROW_NUMBERS_KEPT = 100_000
"""Rollout row numbers a store object keeps for its waits (a few MB)."""

WAIT_COALESCE_SECONDS = 0.02
"""The shortest time between two polls of `wait_for_rollouts` (each finish through this store object wakes it)."""


class _Signal:
    """Wakes coroutines, in any thread's event loop, that wait for a change made through this store
    object (another process's changes are seen by polling)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    @contextlib.contextmanager
    def listening(self) -> Iterator[asyncio.Event]:
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiters.add(waiter)
        try:
            yield waiter[1]
        finally:
            with self._lock:
                self._waiters.discard(waiter)

    def notify(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        for loop, wake in waiters:
            if wake.is_set() or loop.is_closed():
                continue  # (already woken: a runner process's fleet finishes rollouts faster than its wait polls)
            if loop is here:
                wake.set()  # no hand-over through the loop's self-pipe (a write syscall) for a waiter on this loop
            else:
                loop.call_soon_threadsafe(wake.set)


async def _wait(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout=timeout)


class SqlLightningStore(LightningStore):
    """The store. `url`: `sqlite:///path.db` (default `.lightning/store.db`), `sqlite://` (in memory),
    or `postgresql://user:pass@host:port/db`. `watchdog_interval`: seconds between background
    watchdog passes (None: only when `run_watchdog()` is called). `pool_size`: PostgreSQL
    connections (and threads that use them). `threaded`: SQLite transactions run on a thread of the store's own, never
    blocking the caller's event loop; False runs them on the caller's loop, which pays for a loop that does nothing
    else (`lightning store serve`: a third less CPU per request, no hand-over to a thread and back) but blocks it
    while another process holds the database's write lock. PostgreSQL always uses its connections' threads."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        watchdog_interval: float | None = 1.0,
        pool_size: int = 8,
        threaded: bool = True,
    ) -> None:
        self._url = _normalise_url(expand(url) if isinstance(url, str) else url)
        self.backend = "sqlite" if self._url.get_backend_name() == "sqlite" else "postgresql"
        self._lock = threading.RLock()
        self._executor: ThreadPoolExecutor | None = None
        self._sqlite_conn: Connection | None = None
        self._queue_lock = threading.Lock()
        self._queue: list[_Job] = []  # SQLite's, waiting for the store's thread (`_drain`)
        self._draining = False
        self._finished = _Signal()  # some rollout may have finished
        self._row_numbers: dict[str, int] = {}  # rollout id -> seq, which never changes (`_numbers`)
        self._enqueued = _Signal()  # some rollout may have entered the queue
        self._closed = False
        self._opened = time.monotonic()
        self._span_cache = _SpanCache()

        if self.backend == "sqlite":
            self._engine = _sqlite_engine(self._url)
            self._sqlite_conn = self._engine.connect()
            # One thread runs the transactions (they take turns on the one connection anyway), so that a
            # transaction, or the wait for the connection's lock, never blocks the caller's event loop: the runners
            # of a stage share one loop, and the proxy's requests another.
            if threaded:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-store")
        else:
            self._engine = create_engine(self._url, pool_size=pool_size, max_overflow=0, pool_pre_ping=True)
            self._executor = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix="lightning-store")
        self._create_tables()

        self._watchdog_interval = watchdog_interval
        self._watchdog_stop = threading.Event()
        self._watchdog_thread: threading.Thread | None = None
        if watchdog_interval is not None:
            if watchdog_interval <= 0:
                raise InvalidArgumentError(f"watchdog_interval must be > 0 seconds or None, got {watchdog_interval}")
            self._watchdog_thread = threading.Thread(target=self._watchdog_loop, name="store-watchdog", daemon=True)
            self._watchdog_thread.start()

    def __repr__(self) -> str:
        return f"SqlLightningStore({self._url.render_as_string(hide_password=True)!r})"

    # --- running transactions ----------------------------------------------------------------

    def _transaction(self, fn: Callable[..., T], args: tuple[Any, ...], write: bool) -> T:
        """Run fn(conn, *args) in one transaction, on this thread."""
        if self._closed:
            raise StoreError("the store is closed")
        try:
            if self._sqlite_conn is not None:
                with self._lock:
                    return self._sqlite_transaction(self._sqlite_conn, fn, args, write)
            with self._engine.begin() as conn:
                return fn(_Tx(conn), *args)
        except (StatementError, sqlite3.OperationalError) as exc:
            translated = _store_error(exc)
            if translated is exc:
                raise
            raise translated from exc

    def _group(self, jobs: list[_Job]) -> None:
        """Run the SQLite `jobs` that queued up while the store's thread was busy in one transaction, each inside a
        savepoint of its own (one that raises is rolled back alone and gets its error), and hand each its outcome
        once they are committed: one BEGIN and COMMIT, and one wake-up of each waiting event loop, for all of them.
        A runner process's fleet finishes its rollouts a few milliseconds apart, each a transaction of its own, so
        that the hand-overs and commits were a quarter of that process's CPU (issue 39)."""
        if len(jobs) == 1:
            (job,) = jobs
            try:
                job.result = self._transaction(job.fn, job.args, job.write)
            except BaseException as exc:
                job.error = exc
        else:
            try:
                self._sqlite_group(jobs)
            except BaseException as exc:  # BEGIN or COMMIT failed: nothing was stored
                for job in jobs:
                    job.error = exc
        by_loop: dict[asyncio.AbstractEventLoop, list[_Job]] = {}
        for job in jobs:
            by_loop.setdefault(job.loop, []).append(job)
        for loop, theirs in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits there any more
                loop.call_soon_threadsafe(_settle, theirs)

    def _sqlite_group(self, jobs: list[_Job]) -> None:
        if self._closed:
            raise StoreError("the store is closed")
        conn = self._sqlite_conn
        assert conn is not None
        driver = conn.connection.dbapi_connection
        with self._lock:
            try:
                driver.execute("BEGIN IMMEDIATE" if any(job.write for job in jobs) else "BEGIN")
                try:
                    for job in jobs:
                        driver.execute("SAVEPOINT job")
                        try:
                            job.result = job.fn(_Tx(conn), *job.args)
                        except Exception as exc:
                            driver.execute("ROLLBACK TO job")
                            job.error = _store_error(exc) if isinstance(exc, StatementError) else exc
                        driver.execute("RELEASE job")
                except BaseException:
                    conn.rollback() if conn.in_transaction() else driver.rollback()
                    raise
                conn.commit() if conn.in_transaction() else driver.commit()
            except (StatementError, sqlite3.OperationalError) as exc:
                translated = _store_error(exc)
                if translated is exc:
                    raise
                raise translated from exc

    def _drain(self) -> None:
        """The store's thread: run what is queued, in groups, until nothing is."""
        while True:
            with self._queue_lock:
                jobs, self._queue = self._queue, []
                if not jobs:
                    self._draining = False
                    return
            self._group(jobs)

    @staticmethod
    def _sqlite_transaction(conn: Connection, fn: Callable[..., T], args: tuple[Any, ...], write: bool) -> T:
        # BEGIN and COMMIT go straight to sqlite3: through SQLAlchemy they cost more than the commit.
        # IMMEDIATE takes the write lock up front, so a writer never has to upgrade a read lock
        # (which fails at once in WAL mode when another process wrote in between).
        driver = conn.connection.dbapi_connection
        driver.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            result = fn(_Tx(conn), *args)
        except BaseException:
            conn.rollback() if conn.in_transaction() else driver.rollback()
            raise
        conn.commit() if conn.in_transaction() else driver.commit()
        return result

    async def _run(self, fn: Callable[..., T], *args: Any, write: bool = True) -> T:
        if self._executor is None:
            return self._transaction(fn, args, write)
        if self._closed:
            raise StoreError("the store is closed")  # (its executor takes no more work)
        loop = asyncio.get_running_loop()
        if self._sqlite_conn is None:  # PostgreSQL: a transaction on each of its connections' threads
            return await loop.run_in_executor(self._executor, self._transaction, fn, args, write)
        job = _Job(fn, args, write, loop, loop.create_future())
        with self._queue_lock:
            self._queue.append(job)
            start, self._draining = not self._draining, True
        if start:
            try:
                self._executor.submit(self._drain)
            except RuntimeError:  # close() shut the thread down meanwhile: the jobs fail here, as closed
                self._drain()
        return await job.future

    async def _read_first(self, select_: Callable[[_Tx, Any], list[T]], stmt: Any) -> T | None:
        """The first of what `select_` reads with `stmt`, or None."""
        found = await self._run(select_, stmt, write=False)
        return found[0] if found else None

    async def _read_page(
        self, select_: Callable[[_Tx, Any], list[T]], stmt: Any, table: Any, page: contract.Page, default_order: Any
    ) -> PaginatedResult[T]:
        """The page of `stmt` that `page` asks for (see `_order_and_page`), read by `select_`, with the total."""
        paged = _order_and_page(stmt, table, page, default_order)
        return await self._run(_op_page, select_, stmt, paged, page, write=False)

    def _create_tables(self) -> None:
        def create(tx: _Tx) -> None:
            metadata.create_all(tx.conn)
            migrate(tx.conn)

        for attempt in range(3):
            try:
                if self._sqlite_conn is not None:
                    with self._lock:
                        self._sqlite_transaction(self._sqlite_conn, create, (), True)
                else:
                    with self._engine.begin() as conn:
                        create(_Tx(conn))
                return
            except (OperationalError, IntegrityError):
                # Another process created the same tables at the same moment; look again.
                if attempt == 2:
                    raise
                time.sleep(0.05)

    async def close(self) -> None:
        if self._closed:
            return
        self._watchdog_stop.set()
        if self._watchdog_thread is not None:
            self._watchdog_thread.join(timeout=5)
        with self._lock:
            self._closed = True
            if self._sqlite_conn is not None:
                self._sqlite_conn.close()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._engine.dispose()

    # --- the requests: `handle` runs each as one transaction ---------------------------------

    async def handle(self, request: Request) -> Any:
        """Carry out `request` (a model of lightning.store.contract) with the method `_<its method name>` below."""
        return await getattr(self, f"_{request.method}")(request)

    # --- rollouts ----------------------------------------------------------------------------

    async def _enqueue_rollout(self, request: contract.EnqueueRollout) -> Rollout:
        (rollout,) = await self._enqueue_many_rollouts(contract.EnqueueManyRollouts(rollouts=[request]))
        return rollout

    async def _enqueue_many_rollouts(self, request: contract.EnqueueManyRollouts) -> list[Rollout]:
        requests = request.rollouts
        if not requests:
            return []
        encoded = [_json(r.input, f"rollouts[{i}].input") for i, r in enumerate(requests)]
        enqueued = await self._run(_op_enqueue, requests, encoded, time.time())
        self._enqueued.notify()
        return enqueued

    async def _start_rollout(self, request: contract.StartRollout) -> AttemptedRollout:
        encoded_input = _json(request.input, "input")
        return await self._run(_op_start_rollout, request, encoded_input, time.time())

    async def _dequeue_rollout(self, request: contract.DequeueRollout) -> AttemptedRollout | None:
        claimed = await self._dequeue(request.queue, 1, request.worker_id, request.wait)
        return claimed[0] if claimed else None

    async def _dequeue_many_rollouts(self, request: contract.DequeueRollouts) -> list[AttemptedRollout]:
        return await self._dequeue(request.queue, request.limit, request.worker_id, request.wait)

    async def _dequeue(
        self, queue: str | None, limit: int, worker_id: str | None, wait: float
    ) -> list[AttemptedRollout]:
        """Claim up to `limit` rollouts of the queue, oldest first (see `_claim_waiting`)."""
        if limit == 0:
            return []
        return await self._claim_waiting(wait, _op_dequeue, queue or DEFAULT_QUEUE, limit, worker_id)

    async def _claim_rollouts(self, request: contract.ClaimRollouts) -> Claim:
        """As `_dequeue`, claiming with `_op_claim`: the attempts start running under their workers, and the
        resources the caller lacks come along."""
        queue = request.queue or DEFAULT_QUEUE
        return await self._claim_waiting(request.wait, _op_claim, queue, request.worker_ids, request.known_resources)

    async def _claim_waiting(self, wait: float, op: Callable[..., T], *args: Any) -> T:
        """`op(tx, *args, now)`, a claim from a queue. With an empty queue, its empty answer at once, or with `wait`
        > 0 keep trying for up to `wait` seconds: an enqueue through this store object wakes the wait at once,
        others are seen within 0.5 s."""
        if wait <= 0:  # the common poll: no waiter to register
            return await self._run(op, *args, time.time())
        deadline = time.monotonic() + wait
        with self._enqueued.listening() as enqueued:
            while True:
                enqueued.clear()
                claimed = await self._run(op, *args, time.time())
                remaining = deadline - time.monotonic()
                if contract.claimed_any(claimed) or remaining <= 0:  # type: ignore[arg-type]
                    return claimed
                await _wait(enqueued, min(remaining, 0.5))

    async def _start_attempt(self, request: contract.StartAttempt) -> AttemptedRollout:
        return await self._run(_op_start_attempt, request.rollout_id, request.worker_id, time.time())

    async def _get_rollout_by_id(self, request: contract.GetRolloutById) -> Rollout | None:
        stmt = _ROLLOUT_WITH_LATEST_ATTEMPT.where(rollouts.c.rollout_id == request.rollout_id)
        return await self._read_first(_op_select_rollouts, stmt)

    async def _query_rollouts(self, request: contract.QueryRollouts) -> list[Rollout]:
        conditions = _filters(request, rollouts, ("status_in", "rollout_id_in", "rollout_id_contains", "mode", "queue"))
        stmt = _ROLLOUT_WITH_LATEST_ATTEMPT.where(*_combine(conditions, request.filter_logic))
        return await self._read_page(_op_select_rollouts, stmt, rollouts, request, rollouts.c.seq)

    async def _update_rollout(self, request: contract.UpdateRollout) -> Rollout:
        given = request.model_fields_set - {"rollout_id"}
        changes: dict[str, Any] = {}
        if "input" in given:
            changes["input"] = _json(request.input, "input")
        if "mode" in given:
            changes["mode"] = request.mode
        if "resources_id" in given:
            changes["resources_id"] = request.resources_id
        if "config" in given:
            changes["config"] = _not_null(request, "config", "a RolloutConfig").model_dump_json()
        if "metadata" in given:
            changes["metadata"] = _json_or_none(request.metadata, "metadata")
        status = _not_null(request, "status", "a rollout status") if "status" in given else UNSET
        rollout = await self._run(_op_update_rollout, request.rollout_id, changes, status, time.time())
        self._notify()
        return rollout

    async def _wait_for_rollouts(self, request: contract.WaitForRollouts) -> list[Rollout]:
        return await self._wait_finished(request, _op_finished_rollouts)

    async def _wait_for_finished_ids(self, request: contract.WaitForFinishedIds) -> list[str]:
        return await self._wait_finished(request, _op_finished_ids)

    async def _wait_finished(self, request: contract.WaitForRollouts, read: Callable[..., dict[str, Any]]) -> list[Any]:
        """What `read` makes of the rollouts among `rollout_ids` that finished (the rollouts, or their ids), waiting up
        to `timeout` seconds (None: until all finish). Polls with a growing interval; a rollout finished through
        this store object wakes the wait.

        A poll reads only what changed: the ids of the finished rows among the pending ones' row numbers (a range of
        the primary key: no list of hundreds of ids to bind), then whole (`wait_for_rollouts`) only the newly finished,
        each once. A runner process's fleet wakes its wait at every rollout it finishes (768 a phase, the demo):
        reading every pending rollout whole each time was half of that process's time, and an IN-list of the pending
        ids on every poll still a quarter (issue 39); it now waits for ids alone (`wait_for_finished_ids`)."""
        wanted = list(dict.fromkeys(request.rollout_ids))
        deadline = None if request.timeout is None else time.monotonic() + request.timeout
        finished: dict[str, Any] = {}
        with self._finished.listening() as wake:
            pending = await self._numbers(wanted)
            missing = [rid for rid in wanted if rid not in pending]
            if missing:
                raise NotFoundError(f"{request.method}: unknown rollout ids {missing}")
            delay = 0.01
            polled = -math.inf
            while pending:
                # Woken again within WAIT_COALESCE_SECONDS of the last poll: wait out the rest, so that a burst of
                # finishes (a runner process's fleet ends a rollout every few ms) is read in one poll, not one each.
                if (early := polled + WAIT_COALESCE_SECONDS - time.monotonic()) > 0:
                    await asyncio.sleep(early)
                wake.clear()
                polled = time.monotonic()
                found = await self._run(read, pending, write=False)
                finished.update(found)
                for rid in found:
                    del pending[rid]
                remaining = None if deadline is None else deadline - time.monotonic()
                if not pending or (remaining is not None and remaining <= 0):
                    return [finished[rid] for rid in wanted if rid in finished]
                await _wait(wake, delay if remaining is None else min(delay, remaining))
                delay = min(delay * 2, 0.5)
            return []

    async def _numbers(self, rollout_ids: list[str]) -> dict[str, int]:
        """The row number of each known one of `rollout_ids`, read once per rollout: a phase is waited for in
        slices, by the run and by each runner process, and every slice looked the phase's ids up again (768 in an
        IN-list; 6% of the run's process)."""
        found = {rid: number for rid in rollout_ids if (number := self._row_numbers.get(rid)) is not None}
        unseen = [rid for rid in rollout_ids if rid not in found]
        if unseen:
            read = await self._run(_op_rollout_numbers, unseen, write=False)
            if len(self._row_numbers) + len(read) > _ROW_NUMBERS_KEPT:
                self._row_numbers.clear()
            self._row_numbers.update(read)
            found.update(read)
        return found

    def _notify(self) -> None:
        """After a write that may have finished or queued rollouts."""
        self._finished.notify()
        self._enqueued.notify()

    # --- attempts ----------------------------------------------------------------------------

    async def _query_attempts(self, request: contract.QueryAttempts) -> list[Attempt]:
        stmt = select(*_ATTEMPT_COLUMNS).where(attempts.c.rollout_id == request.rollout_id)
        select_ = functools.partial(_op_query_attempts, rollout_id=request.rollout_id)
        return await self._read_page(select_, stmt, attempts, request, None)

    async def _get_latest_attempt(self, request: contract.GetLatestAttempt) -> Attempt | None:
        return await self._run(_op_latest_attempt, request.rollout_id, write=False)

    async def _update_attempt(self, request: contract.UpdateAttempt) -> Attempt:
        given = request.model_fields_set - {"rollout_id", "attempt_id"}
        changes: dict[str, Any] = {}
        if "worker_id" in given:
            changes["worker_id"] = request.worker_id
        if "last_heartbeat_time" in given:
            changes["last_heartbeat_time"] = request.last_heartbeat_time
        if "metadata" in given:
            changes["metadata"] = _json_or_none(request.metadata, "metadata")
        status = _not_null(request, "status", "an attempt status") if "status" in given else UNSET
        attempt = await self._run(
            _op_update_attempt, request.rollout_id, request.attempt_id, status, changes, time.time()
        )
        self._notify()
        return attempt

    async def _finish_attempt(self, request: contract.FinishAttempt) -> Attempt:
        attempt = await self._run(
            _op_finish_attempt, request.rollout_id, request.attempt_id, request.status, request.spans, time.time()
        )
        self._notify()
        return attempt

    # --- spans -------------------------------------------------------------------------------

    async def _add_span(self, request: contract.AddSpan) -> Span | None:
        added = await self._run(_op_add_spans, [request.span], [_span_json(request.span)], time.time())
        return added[0] if added else None

    async def _add_many_spans(self, request: contract.AddManySpans) -> list[Span]:
        if not request.spans:
            return []
        if request.number:
            return await self._run(_op_add_numbered_spans, request.spans, time.time())
        payloads = [_span_json(span) for span in request.spans]
        return await self._run(_op_add_spans, request.spans, payloads, time.time())

    async def _get_next_span_sequence_id(self, request: contract.GetNextSpanSequenceId) -> int:
        (sequence_id,) = await self._run(_op_allocate_sequence_ids, [(request.rollout_id, request.attempt_id)])
        return sequence_id

    async def _get_many_span_sequence_ids(self, request: contract.GetManySpanSequenceIds) -> list[int]:
        if not request.rollout_attempt_ids:
            return []
        return await self._run(_op_allocate_sequence_ids, request.rollout_attempt_ids)

    async def _query_spans(self, request: contract.QuerySpans) -> list[Span]:
        stmt, paged = _span_statements(request)
        if stmt is None and self._sqlite_conn is not None:
            return await self._cached_query_spans(request)
        return await self._run(_op_query_spans, request, stmt, paged, write=False)

    async def _query_latest_spans(self, request: contract.QueryLatestSpans) -> dict[str, list[Span]]:
        rollout_ids = list(dict.fromkeys(request.rollout_ids))
        return await self._run(_op_latest_spans, rollout_ids, request.rewards_only, write=False)

    async def query_spans_json(self, request: contract.QuerySpans) -> bytes:
        """query_spans' answer (PaginatedResult[Span]) as JSON made of the spans' stored JSON as is, for the HTTP
        server: no Span is built from it nor dumped back (for 100 spans, ~0.1 ms of SQL against ~1 ms of pydantic)."""
        stmt, paged = _span_statements(request)
        payloads, total = await self._run(_op_span_payloads, request, stmt, paged, write=False)
        page = f'"limit":{request.limit},"offset":{request.offset},"total":{total}'
        return f'{{"items":[{",".join(payloads)}],{page}}}'.encode()

    async def _cached_query_spans(self, request: contract.QuerySpans) -> PaginatedResult[Span]:
        """All spans of a rollout or attempt, from `_span_cache` while the database has not changed. Like every
        transaction, on the store's thread."""
        found = await self._run(self._cached_spans, request, write=False)
        return PaginatedResult(items=list(found), limit=request.limit, offset=request.offset, total=len(found))

    def _cached_spans(self, tx: _Tx, request: contract.QuerySpans) -> list[Span]:
        key = (request.rollout_id, request.attempt_id)
        version = _sqlite_version(tx.conn)
        found = self._span_cache.get(version, key)
        if found is None:
            found = _op_query_spans(tx, request, None, None).items
            self._span_cache.put(version, key, found)
        return found

    # --- resources ---------------------------------------------------------------------------

    async def _add_resources(self, request: contract.AddResources) -> ResourcesUpdate:
        encoded = _NAMED_RESOURCES.dump_json(request.resources).decode()
        return await self._run(_op_put_resources, new_resources_id(), encoded, time.time())

    async def _update_resources(self, request: contract.UpdateResources) -> ResourcesUpdate:
        encoded = _NAMED_RESOURCES.dump_json(request.resources).decode()
        return await self._run(_op_put_resources, request.resources_id, encoded, time.time())

    async def _get_resources_by_id(self, request: contract.GetResourcesById) -> ResourcesUpdate | None:
        stmt = select(resources).where(resources.c.resources_id == request.resources_id)
        return await self._read_first(_op_select_resources, stmt)

    async def _get_latest_resources(self, request: contract.GetLatestResources) -> ResourcesUpdate | None:
        stmt = select(resources).order_by(resources.c.latest_order.desc()).limit(1)
        return await self._read_first(_op_select_resources, stmt)

    async def _query_resources(self, request: contract.QueryResources) -> list[ResourcesUpdate]:
        stmt = select(resources).where(*_filters(request, resources, ("resources_id", "resources_id_contains")))
        return await self._read_page(_op_select_resources, stmt, resources, request, resources.c.create_time)

    # --- workers -----------------------------------------------------------------------------

    async def _update_worker(self, request: contract.UpdateWorker) -> Worker:
        values: dict[str, Any] = {"last_heartbeat_time": time.time()}
        if "heartbeat_stats" in request.model_fields_set:
            values["heartbeat_stats"] = _json_or_none(request.heartbeat_stats, "heartbeat_stats")
        return await self._run(_op_heartbeat_worker, request.worker_id, values)

    async def _get_worker_by_id(self, request: contract.GetWorkerById) -> Worker | None:
        stmt = select(workers).where(workers.c.worker_id == request.worker_id)
        return await self._read_first(_op_select_workers, stmt)

    async def _query_workers(self, request: contract.QueryWorkers) -> list[Worker]:
        conditions = _filters(request, workers, ("status_in", "worker_id_contains"))
        stmt = select(workers).where(*_combine(conditions, request.filter_logic))
        return await self._read_page(_op_select_workers, stmt, workers, request, workers.c.worker_id)

    # --- watchdog and housekeeping ------------------------------------------------------------

    async def _run_watchdog(self, request: contract.RunWatchdog) -> int:
        """One watchdog pass now: mark timed-out and unresponsive attempts and move their
        rollouts. Returns how many attempts it marked."""
        marked = await self._run(_op_watchdog, time.time())
        if marked:
            self._notify()
        return marked

    async def _statistics(self, request: contract.Statistics) -> dict[str, Any]:
        counts = await self._run(_op_statistics, write=False)
        return {
            "name": type(self).__name__,
            "backend": self.backend,
            "url": self._url.render_as_string(hide_password=True),
            "uptime": time.monotonic() - self._opened,
            **counts,
        }

    def _watchdog_loop(self) -> None:
        """The background thread: a watchdog pass, and for a SQLite file a WAL checkpoint, each interval."""
        assert self._watchdog_interval is not None
        checkpointer = self._wal_checkpointer()
        while not self._watchdog_stop.wait(self._watchdog_interval):
            try:
                if self._transaction(_op_watchdog, (time.time(),), True):
                    self._notify()
                if checkpointer is not None:
                    # PASSIVE copies what it can without blocking writers; commits then never pay for it.
                    checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except Exception:
                if self._closed:
                    break
                logger.exception("store watchdog pass failed; retrying in %.1fs", self._watchdog_interval)
        if checkpointer is not None:
            checkpointer.close()

    def _wal_checkpointer(self) -> sqlite3.Connection | None:
        if self.backend != "sqlite" or self._url.database in (None, "", ":memory:"):
            return None
        return sqlite3.connect(self._url.database, timeout=30, check_same_thread=False)


# --- running SQL ------------------------------------------------------------------------------


def _sqlite_version(conn: Connection) -> tuple[int, int]:
    """Changes whenever the database may have: rows this connection wrote (total_changes counts every insert,
    update and delete, even rolled back ones) and commits by any other connection (data_version)."""
    driver = conn.connection.dbapi_connection
    return driver.total_changes, driver.execute("PRAGMA data_version").fetchone()[0]


class _SpanCache:
    """Decoded results of recent `query_spans(rollout_id[, attempt_id])` calls on SQLite, for as long as the
    database stays as it was (`_sqlite_version`). Why: rebuilding the Span models from their JSON is ~90% of
    such a query (~7 µs a span; the SQL is a tenth), and readers often ask again for an unchanged rollout
    (dashboards polling, rewards then triplets). Any write empties it, so it never serves stale spans.
    The same Span objects go to every caller that hits an entry, as agent-lightning's in-memory store does:
    treat returned spans as read-only. PostgreSQL has no such cheap check, so it always queries."""

    MAX_SPANS = 20_000

    def __init__(self) -> None:
        self._version: tuple[int, int] | None = None
        self._entries: dict[tuple[str, str | None], list[Span]] = {}
        self._spans = 0

    def get(self, version: tuple[int, int], key: tuple[str, str | None]) -> list[Span] | None:
        if version != self._version:
            self._entries.clear()
            self._spans = 0
            self._version = version
            return None
        return self._entries.get(key)

    def put(self, version: tuple[int, int], key: tuple[str, str | None], found: list[Span]) -> None:
        if version != self._version or len(found) > self.MAX_SPANS:
            return
        if self._spans + len(found) > self.MAX_SPANS:
            self._entries.clear()
            self._spans = 0
        self._entries[key] = found
        self._spans += len(found)


class _Sql:
    """A statement on a hot path: built with SQLAlchemy once, rendered once per dialect, then run
    on the driver's cursor. SQLAlchemy's own per-execution overhead (~30 µs) is several times
    what SQLite needs to run such a statement."""

    def __init__(self, stmt: Any) -> None:
        self.stmt = stmt
        self.columns = tuple(c.key for c in stmt.exported_columns) if hasattr(stmt, "exported_columns") else ()
        self._rendered: dict[str, tuple[str, dict[str, Any]]] = {}

    def render(self, dialect: Any, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The SQL text for `dialect` and the parameters with the statement's own constants added."""
        rendered = self._rendered.get(dialect.name)
        if rendered is None:
            compiled = self.stmt.compile(dialect=dialect)
            # Values written into the statement (LIMIT 1, status='preparing'); the rest are bound per call.
            constants = {name: bind.value for name, bind in compiled.binds.items() if not bind.required}
            rendered = self._rendered[dialect.name] = (str(compiled), constants)
        sql, constants = rendered
        return sql, ({**constants, **params} if constants else params)

    def multi_row(self, dialect: Any) -> tuple[str, list[str]]:
        """For an INSERT of one row: the text before VALUES, and the row's parameter names in order."""
        text, _ = self.render(dialect, {})
        head, _, values = text.partition(" VALUES ")
        return head, re.findall(r":(\w+)", values)


class _Tx:
    """One open transaction: `conn` (SQLAlchemy) for composed queries, the methods below for _Sql."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.dialect = conn.dialect
        self.driver = conn.connection.dbapi_connection

    def _execute(self, sql: _Sql, params: dict[str, Any]) -> Any:
        return self.driver.execute(*sql.render(self.dialect, params))

    def rows(self, sql: _Sql, params: dict[str, Any]) -> list[dict[str, Any]]:
        return [dict(zip(sql.columns, row, strict=True)) for row in self._execute(sql, params).fetchall()]

    def first(self, sql: _Sql, params: dict[str, Any]) -> dict[str, Any] | None:
        row = self._execute(sql, params).fetchone()
        return None if row is None else dict(zip(sql.columns, row, strict=True))

    def run(self, sql: _Sql, params: dict[str, Any]) -> int:
        return self._execute(sql, params).rowcount

    def run_many(self, sql: _Sql, rows: list[dict[str, Any]]) -> None:
        text, _ = sql.render(self.dialect, {})
        cursor = self.driver.cursor()
        cursor.executemany(text, [sql.render(self.dialect, row)[1] for row in rows])
        cursor.close()

    def insert_rows(self, sql: _Sql, rows: list[dict[str, Any]]) -> None:
        """Run an INSERT of one row (bound by name) for each of `rows`. On SQLite as multi-row INSERTs: binding
        a whole batch to one statement costs about half of what executemany's step per row does."""
        if len(rows) == 1:
            self.run(sql, rows[0])
            return
        if self.dialect.name != "sqlite":
            self.run_many(sql, rows)
            return
        head, names = sql.multi_row(self.dialect)
        row_values = operator.itemgetter(*names)
        row_marks = "(" + ",".join("?" * len(names)) + ")"
        chunk = 32_766 // len(names)  # SQLite binds at most 32,766 values to one statement
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            params = [value for row in part for value in row_values(sql.render(self.dialect, row)[1])]
            self.driver.execute(f"{head} VALUES {','.join([row_marks] * len(part))}", params)

    def insert_each(self, sql: _Sql, rows: list[dict[str, Any]]) -> list[bool]:
        """Run an INSERT ... ON CONFLICT DO NOTHING per row; which rows went in."""
        cursor = self.driver.cursor()
        text, _ = sql.render(self.dialect, {})
        params = [sql.render(self.dialect, row)[1] for row in rows]
        if self.dialect.name == "sqlite":
            inserted = []
            for row in params:
                cursor.execute(text, row)
                inserted.append(cursor.rowcount == 1)
        else:  # psycopg sends the rows in one pipeline and keeps one result per row
            # SQLAlchemy already adds RETURNING of a serial key on PostgreSQL; any row back means inserted.
            returning = text if " RETURNING " in text else text + " RETURNING 1"
            cursor.executemany(returning, params, returning=True)
            inserted = [cursor.fetchone() is not None]
            while cursor.nextset():
                inserted.append(cursor.fetchone() is not None)
        cursor.close()
        return inserted


def _insert_row(table: Any, insert_: Any = insert) -> Any:
    """INSERT of every column but the autoincrement key, each bound by its column name."""
    return insert_(table).values(
        {c.key: bindparam(c.key) for c in table.columns if c is not table.autoincrement_column}
    )


def _insert_ignoring_duplicates(table: Any) -> _DialectSql:
    return _DialectSql(
        {
            "sqlite": _Sql(_insert_row(table, sqlite_dialect.insert).on_conflict_do_nothing()),
            "postgresql": _Sql(_insert_row(table, pg_dialect.insert).on_conflict_do_nothing()),
        }
    )


class _DialectSql:
    """Statements that SQLite and PostgreSQL spell differently (ON CONFLICT lives in each dialect)."""

    def __init__(self, by_dialect: dict[str, _Sql]) -> None:
        self.by_dialect = by_dialect

    def __getitem__(self, tx: _Tx) -> _Sql:
        return self.by_dialect[tx.dialect.name]


def _bp(name: str) -> Any:
    return bindparam(name)


# --- the statements of the hot paths ----------------------------------------------------------

_INSERT_ROLLOUT = _Sql(_insert_row(rollouts))
_INSERT_ROLLOUT_IF_NEW_KEY = _insert_ignoring_duplicates(rollouts)
_SELECT_ROLLOUT_BY_KEY = _Sql(select(*_ROLLOUT_COLUMNS).where(rollouts.c.idempotency_key == _bp("key")))
_SELECT_LATEST_RESOURCES_ID = _Sql(select(resources.c.resources_id).order_by(resources.c.latest_order.desc()).limit(1))
_SELECT_QUEUE_HEAD = _Sql(
    select(*_ROLLOUT_COLUMNS, rollouts.c.attempt_count)
    .where(rollouts.c.queue == _bp("queue"), rollouts.c.queued_at.is_not(None))
    .order_by(rollouts.c.queued_at, rollouts.c.seq)
    .limit(_bp("limit"))
    .with_for_update(skip_locked=True)
)
_SELECT_ROLLOUT_FOR_UPDATE = _Sql(
    select(*_ROLLOUT_COLUMNS, rollouts.c.attempt_count, rollouts.c.latest_attempt_id)
    .where(rollouts.c.rollout_id == _bp("r_id"))
    .with_for_update()
)
_INSERT_ATTEMPT = _Sql(_insert_row(attempts))
_UPDATE_ROLLOUT_FOR_NEW_ATTEMPT = _Sql(
    update(rollouts)
    .where(rollouts.c.rollout_id == _bp("r_id"))
    .values(
        status=_bp("status"),
        end_time=None,
        queued_at=None,
        attempt_count=_bp("attempt_count"),
        latest_attempt_id=_bp("a_id"),
    )
)
_SET_ROLLOUT_STATUS = _Sql(
    update(rollouts)
    .where(rollouts.c.rollout_id == _bp("r_id"))
    .values(status=_bp("status"), end_time=_bp("end_time"), queued_at=_bp("queued_at"))
)
_ATTEMPT_AND_ROLLOUT = select(
    *_ATTEMPT_COLUMNS,
    attempts.c.worker_id,
    rollouts.c.status.label("rollout_status"),
    rollouts.c.config,
    rollouts.c.latest_attempt_id,
    rollouts.c.next_span_sequence_id,
).select_from(attempts.join(rollouts, rollouts.c.rollout_id == attempts.c.rollout_id))
_SELECT_ATTEMPT_AND_ROLLOUT = _Sql(_ATTEMPT_AND_ROLLOUT.where(attempts.c.attempt_id == _bp("a_id")).with_for_update())
_SELECT_LATEST_ATTEMPT_ID = _Sql(select(rollouts.c.latest_attempt_id).where(rollouts.c.rollout_id == _bp("r_id")))
_SET_ATTEMPT_STATUS = _Sql(
    update(attempts).where(attempts.c.attempt_id == _bp("a_id")).values(status=_bp("status"), end_time=_bp("end_time"))
)
_HEARTBEAT = _Sql(update(attempts).where(attempts.c.attempt_id == _bp("a_id")).values(last_heartbeat_time=_bp("now")))
_SET_ATTEMPT_STATUS_AND_BEAT = _Sql(
    update(attempts)
    .where(attempts.c.attempt_id == _bp("a_id"))
    .values(status=_bp("status"), end_time=_bp("end_time"), last_heartbeat_time=_bp("now"))
)
_INSERT_SPAN_IF_NEW = _insert_ignoring_duplicates(spans)
_RAISE_SPAN_COUNTER = _Sql(
    update(rollouts)
    .where(rollouts.c.rollout_id == _bp("r_id"))
    .values(
        next_span_sequence_id=case(
            (rollouts.c.next_span_sequence_id <= _bp("seen"), _bp("seen") + 1),
            else_=rollouts.c.next_span_sequence_id,
        )
    )
)
_ALLOCATE_SPAN_IDS = _Sql(
    update(rollouts)
    .where(rollouts.c.rollout_id == _bp("r_id"))
    .values(next_span_sequence_id=rollouts.c.next_span_sequence_id + _bp("count"))
    .returning(rollouts.c.next_span_sequence_id)
)
_SELECT_SPANS_OF_ROLLOUT = _Sql(
    select(spans.c.payload).where(spans.c.rollout_id == _bp("r_id")).order_by(spans.c.sequence_id, spans.c.pk)
)
_SELECT_SPANS_OF_ATTEMPT = _Sql(
    select(spans.c.payload)
    .where(spans.c.rollout_id == _bp("r_id"), spans.c.attempt_id == _bp("a_id"))
    .order_by(spans.c.sequence_id, spans.c.pk)
)
_SELECT_ROLLOUT_EXISTS = _Sql(select(rollouts.c.seq).where(rollouts.c.rollout_id == _bp("r_id")))


def _upsert_worker(insert_: Any) -> _Sql:
    # Times not given stay as they were; status and the current rollout always follow the attempt.
    stmt = insert_(workers).values(
        worker_id=_bp("w_id"),
        status=_bp("status"),
        last_dequeue_time=_bp("dequeued"),
        last_busy_time=_bp("busy"),
        last_idle_time=_bp("idle"),
        current_rollout_id=_bp("r_id"),
        current_attempt_id=_bp("a_id"),
    )
    keep = stmt.excluded
    return _Sql(
        stmt.on_conflict_do_update(
            index_elements=[workers.c.worker_id],
            set_={
                "status": keep.status,
                "last_dequeue_time": func.coalesce(keep.last_dequeue_time, workers.c.last_dequeue_time),
                "last_busy_time": func.coalesce(keep.last_busy_time, workers.c.last_busy_time),
                "last_idle_time": func.coalesce(keep.last_idle_time, workers.c.last_idle_time),
                "current_rollout_id": keep.current_rollout_id,
                "current_attempt_id": keep.current_attempt_id,
            },
        )
    )


_UPSERT_WORKER_STATUS = _DialectSql(
    {"sqlite": _upsert_worker(sqlite_dialect.insert), "postgresql": _upsert_worker(pg_dialect.insert)}
)


# --- the transactions -------------------------------------------------------------------------
# Each function below runs inside one transaction and is the whole of one store call.


def _op_enqueue(tx: _Tx, requests: list[EnqueueRolloutRequest], encoded: list[str], now: float) -> list[Rollout]:
    latest = None
    if any(r.resources_id is None for r in requests):
        latest = tx.first(_SELECT_LATEST_RESOURCES_ID, {})
    latest_resources_id = latest["resources_id"] if latest else None

    results: list[Rollout | None] = [None] * len(requests)
    first_with_key: dict[str, int] = {}
    plain_rows: list[dict[str, Any]] = []
    rollout_ids = new_rollout_ids(len(requests))
    for index, request in enumerate(requests):
        key = request.idempotency_key
        if key is not None and key in first_with_key:
            continue  # the same key twice in one batch: both get the first one's rollout
        rollout = Rollout(
            rollout_id=rollout_ids[index],
            input=request.input,
            start_time=now,
            mode=request.mode,
            resources_id=request.resources_id or latest_resources_id,
            status="queuing",
            config=request.config or _DEFAULT_CONFIG,
            metadata=request.metadata,
        )
        row = _rollout_row(rollout, encoded[index], key, request.queue, queued_at=now)
        results[index] = rollout
        if key is None:
            plain_rows.append(row)
            continue
        first_with_key[key] = index
        if not tx.insert_each(_INSERT_ROLLOUT_IF_NEW_KEY[tx], [row])[0]:
            # The key was used by an earlier call: hand back that rollout, enqueue nothing.
            results[index] = _rollout(tx.first(_SELECT_ROLLOUT_BY_KEY, {"key": key}))
    if plain_rows:
        tx.insert_rows(_INSERT_ROLLOUT, plain_rows)
    for index, request in enumerate(requests):
        if results[index] is None:
            results[index] = results[first_with_key[request.idempotency_key]]
    return results  # type: ignore[return-value]


def _op_start_rollout(tx: _Tx, request: contract.StartRollout, encoded_input: str, now: float) -> AttemptedRollout:
    latest = None if request.resources_id else tx.first(_SELECT_LATEST_RESOURCES_ID, {})
    rollout = Rollout(
        rollout_id=new_rollout_id(),
        input=request.input,
        start_time=now,
        mode=request.mode,
        resources_id=request.resources_id or (latest["resources_id"] if latest else None),
        status="preparing",
        config=request.config or _DEFAULT_CONFIG,
        metadata=request.metadata,
    )
    tx.run(_INSERT_ROLLOUT, _rollout_row(rollout, encoded_input, None, request.queue, queued_at=None))
    attempt = _create_attempt(tx, rollout, 1, request.worker_id, now)
    return AttemptedRollout(**rollout.__dict__, attempt=attempt)


def _op_dequeue(tx: _Tx, queue: str, limit: int, worker_id: str | None, now: float) -> list[AttemptedRollout]:
    claimed = []
    for row in tx.rows(_SELECT_QUEUE_HEAD, {"queue": queue, "limit": limit}):
        rollout = _rollout(row)
        attempt = _create_attempt(tx, rollout, row["attempt_count"] + 1, worker_id, now)
        claimed.append(AttemptedRollout(**rollout.__dict__, attempt=attempt))
    return claimed


def _op_claim(tx: _Tx, queue: str, worker_ids: list[str], known: dict[str, int], now: float) -> Claim:
    """Up to one rollout per worker, oldest first, its new attempt moved on to running under that worker (the
    lifecycle as update_attempt would apply it); then the resources they name that are not in `known` at the same
    version."""
    claimed = []
    heads = tx.rows(_SELECT_QUEUE_HEAD, {"queue": queue, "limit": len(worker_ids)})
    for row, worker_id in zip(heads, worker_ids[: len(heads)], strict=True):
        rollout = _rollout(row)
        attempt = _create_attempt(tx, rollout, row["attempt_count"] + 1, worker_id, now, status="running")
        claimed.append(AttemptedRollout(**rollout.__dict__, attempt=attempt))
    named = sorted({r.resources_id for r in claimed if r.resources_id is not None})
    rows = tx.conn.execute(select(resources).where(resources.c.resources_id.in_(named))).all() if named else []
    lacking = [_resources_update(row) for row in rows if known.get(row.resources_id) != row.version]
    return Claim(rollouts=claimed, resources=lacking)


def _op_start_attempt(tx: _Tx, rollout_id: str, worker_id: str | None, now: float) -> AttemptedRollout:
    row = tx.first(_SELECT_ROLLOUT_FOR_UPDATE, {"r_id": rollout_id})
    if row is None:
        raise NotFoundError(f"start_attempt: no rollout {rollout_id!r}")
    rollout = _rollout(row)
    attempt = _create_attempt(tx, rollout, row["attempt_count"] + 1, worker_id, now)
    return AttemptedRollout(**rollout.__dict__, attempt=attempt)


def _create_attempt(
    tx: _Tx,
    rollout: Rollout,
    sequence_id: int,
    worker_id: str | None,
    now: float,
    status: AttemptStatus = "preparing",
) -> Attempt:
    """A new attempt becomes the rollout's latest and the rollout leaves the queue: preparing, or, for an attempt
    that starts `running` (a claim's), running, as `update_attempt(status="running")` would move it, in the same
    three writes (the attempt, the rollout, the worker) instead of six."""
    attempt = Attempt(
        rollout_id=rollout.rollout_id,
        attempt_id=new_attempt_id(),
        sequence_id=sequence_id,
        start_time=now,
        status=status,
        worker_id=worker_id,
    )
    config = rollout.config
    rollout.status = (
        lifecycle.rollout_status_after_attempt(status, sequence_id, True, "preparing", config) or "preparing"
    )
    rollout.end_time = None
    tx.run(
        _INSERT_ATTEMPT,
        {
            **attempt.__dict__,
            "metadata": None,
            "timeout_at": None if config.timeout_seconds is None else now + config.timeout_seconds,
            "unresponsive_seconds": config.unresponsive_seconds,
        },
    )
    tx.run(
        _UPDATE_ROLLOUT_FOR_NEW_ATTEMPT,
        {
            "r_id": rollout.rollout_id,
            "attempt_count": sequence_id,
            "a_id": attempt.attempt_id,
            "status": rollout.status,
        },
    )
    if worker_id:
        _record_worker_status(tx, worker_id, attempt, now, dequeued=True)
    return attempt


def _op_update_rollout(tx: _Tx, rollout_id: str, changes: dict[str, Any], status: RolloutStatus, now: float) -> Rollout:
    if tx.first(_SELECT_ROLLOUT_FOR_UPDATE, {"r_id": rollout_id}) is None:
        raise NotFoundError(f"update_rollout: no rollout {rollout_id!r}")
    if changes:
        tx.conn.execute(update(rollouts).where(rollouts.c.rollout_id == rollout_id).values(**changes))
    if "config" in changes:
        # Active attempts follow the new deadlines.
        config = RolloutConfig.model_validate_json(changes["config"])
        timeout_at = None if config.timeout_seconds is None else attempts.c.start_time + config.timeout_seconds
        tx.conn.execute(
            update(attempts)
            .where(attempts.c.rollout_id == rollout_id, attempts.c.status.in_(sorted(lifecycle.ACTIVE_ATTEMPT)))
            .values(timeout_at=timeout_at, unresponsive_seconds=config.unresponsive_seconds)
        )
    if status is not UNSET:
        _set_rollout_status(tx, rollout_id, status, now)
    return _rollout(tx.first(_SELECT_ROLLOUT_FOR_UPDATE, {"r_id": rollout_id}))


def _set_rollout_status(tx: _Tx, rollout_id: str, status: RolloutStatus, now: float) -> None:
    """The one place a rollout's status changes after creation: finished statuses stamp end_time;
    queued statuses put the rollout at the back of the queue (queued_at is set only while queued)."""
    tx.run(
        _SET_ROLLOUT_STATUS,
        {
            "r_id": rollout_id,
            "status": status,
            "end_time": now if lifecycle.ends_rollout(status) else None,
            "queued_at": now if status in lifecycle.QUEUED_ROLLOUT else None,
        },
    )


def _op_update_attempt(
    tx: _Tx,
    rollout_id: str,
    attempt_id: str,
    status: AttemptStatus,
    changes: dict[str, Any],
    now: float,
) -> Attempt:
    if attempt_id == "latest":
        latest = tx.first(_SELECT_LATEST_ATTEMPT_ID, {"r_id": rollout_id})
        if latest is None:
            raise NotFoundError(f"update_attempt: no rollout {rollout_id!r}")
        if latest["latest_attempt_id"] is None:
            raise NotFoundError(f"update_attempt: rollout {rollout_id!r} has no attempt yet")
        attempt_id = latest["latest_attempt_id"]
    row = tx.first(_SELECT_ATTEMPT_AND_ROLLOUT, {"a_id": attempt_id})
    if row is None or row["rollout_id"] != rollout_id:
        raise NotFoundError(f"update_attempt: no attempt {attempt_id!r} in rollout {rollout_id!r}")
    if changes:
        tx.conn.execute(update(attempts).where(attempts.c.attempt_id == attempt_id).values(**changes))
        row.update(changes)
    attempt = _attempt(row)
    if status is not UNSET and status != attempt.status:
        _move_attempt(tx, attempt, row, status, now)
    elif changes.get("worker_id"):
        # As in agent-lightning: the worker named takes this attempt as its current one (a worker that dequeued
        # attempt 1 and is handed attempt 2 moves to it).
        _record_worker_status(tx, changes["worker_id"], attempt, now, dequeued=False)
    return attempt


def _move_attempt(
    tx: _Tx, attempt: Attempt, row: dict[str, Any], status: AttemptStatus, now: float, beat: float | None = None
) -> None:
    """Change an attempt's status and apply the lifecycle to its rollout and worker.
    `row` carries the rollout's status, config and latest attempt id; `beat`: a heartbeat time written with it."""
    attempt.status = status
    attempt.end_time = now if lifecycle.ends_attempt(status) else None
    if beat is None:
        tx.run(_SET_ATTEMPT_STATUS, {"a_id": attempt.attempt_id, "status": status, "end_time": attempt.end_time})
    else:
        attempt.last_heartbeat_time = beat
        values = {"a_id": attempt.attempt_id, "status": status, "end_time": attempt.end_time, "now": beat}
        tx.run(_SET_ATTEMPT_STATUS_AND_BEAT, values)
    new_rollout_status = lifecycle.rollout_status_after_attempt(
        status,
        attempt.sequence_id,
        row["latest_attempt_id"] == attempt.attempt_id,
        row["rollout_status"],
        _config(row["config"]),
    )
    if new_rollout_status is not None and new_rollout_status != row["rollout_status"]:
        _set_rollout_status(tx, attempt.rollout_id, new_rollout_status, now)
        row["rollout_status"] = new_rollout_status
    if attempt.worker_id:
        _record_worker_status(tx, attempt.worker_id, attempt, now, dequeued=False)


def _record_worker_status(tx: _Tx, worker_id: str, attempt: Attempt, now: float, dequeued: bool) -> None:
    status = lifecycle.worker_status_after_attempt(attempt.status)
    busy = status == "busy"
    tx.run(
        _UPSERT_WORKER_STATUS[tx],
        {
            "w_id": worker_id,
            "status": status,
            "dequeued": now if dequeued else None,
            "busy": now if busy else None,
            "idle": None if busy else now,
            "r_id": attempt.rollout_id if busy else None,
            "a_id": attempt.attempt_id if busy else None,
        },
    )


def _op_add_spans(
    tx: _Tx,
    new_spans: list[Span],
    payloads: list[str],
    now: float,
    found: dict[str, dict[str, Any]] | None = None,
    beat: bool = True,
) -> list[Span]:
    """Store spans (a duplicate rollout/attempt/span id is skipped), beat the attempts' hearts (unless not `beat`:
    the caller writes the beat itself), revive preparing or unresponsive attempts, and keep each rollout's span
    counter ahead. `found`: the attempts' rows (`_SELECT_ATTEMPT_AND_ROLLOUT`) when the caller read them already."""
    if found is None:
        found = {}
        for attempt_id in sorted({span.attempt_id for span in new_spans}):
            row = tx.first(_SELECT_ATTEMPT_AND_ROLLOUT, {"a_id": attempt_id})
            if row is not None:
                found[attempt_id] = row
    for span in new_spans:
        row = found.get(span.attempt_id)
        if row is None or row["rollout_id"] != span.rollout_id:
            raise NotFoundError(f"add_span: no attempt {span.attempt_id!r} in rollout {span.rollout_id!r}")

    rows = [
        {
            "rollout_id": span.rollout_id,
            "attempt_id": span.attempt_id,
            "sequence_id": span.sequence_id,
            "trace_id": span.trace_id,
            "span_id": span.span_id,
            "parent_id": span.parent_id,
            "name": span.name,
            "start_time": span.start_time,
            "end_time": span.end_time,
            "payload": payload,
        }
        for span, payload in zip(new_spans, payloads, strict=True)
    ]
    inserted = tx.insert_each(_INSERT_SPAN_IF_NEW[tx], rows)
    added = [span for span, ok in zip(new_spans, inserted, strict=True) if ok]

    for attempt_id, row in found.items():
        if beat:
            tx.run(_HEARTBEAT, {"a_id": attempt_id, "now": now})
        revived = lifecycle.attempt_status_on_heartbeat(row["status"])
        if revived != row["status"]:
            _move_attempt(tx, _attempt(row), row, revived, now)
            row["status"] = revived

    highest: dict[str, int] = {}
    for span in added:
        highest[span.rollout_id] = max(highest.get(span.rollout_id, 0), span.sequence_id)
    next_ids = {row["rollout_id"]: row["next_span_sequence_id"] for row in found.values()}
    for rollout_id in sorted(highest):
        if highest[rollout_id] >= next_ids[rollout_id]:
            tx.run(_RAISE_SPAN_COUNTER, {"r_id": rollout_id, "seen": highest[rollout_id]})
    return added


def _op_add_numbered_spans(
    tx: _Tx, new_spans: list[Span], now: float, found: dict[str, dict[str, Any]] | None = None, beat: bool = True
) -> list[Span]:
    """`_op_add_spans` with sequence ids the store allocates, in the list's order. `found`: the attempts' rows, read
    before the allocation (their span counters are moved past it here, as the store's now are)."""
    ids = _op_allocate_sequence_ids(tx, [(span.rollout_id, span.attempt_id) for span in new_spans])
    numbered = [span.model_copy(update={"sequence_id": i}) for span, i in zip(new_spans, ids, strict=True)]
    for row in (found or {}).values():
        allocated = [span.sequence_id for span in numbered if span.rollout_id == row["rollout_id"]]
        if allocated:
            row["next_span_sequence_id"] = max(row["next_span_sequence_id"], max(allocated) + 1)
    return _op_add_spans(tx, numbered, [_span_json(span) for span in numbered], now, found=found, beat=beat)


def _op_finish_attempt(
    tx: _Tx, rollout_id: str, attempt_id: str, status: AttemptStatus, new_spans: list[Span], now: float
) -> Attempt:
    """The last spans first (a late span revives an unresponsive attempt, as add_many_spans does), then the final
    status, only if the attempt is still its rollout's latest and active; the attempt as it stands."""
    for span in new_spans:
        if (span.rollout_id, span.attempt_id) != (rollout_id, attempt_id):
            raise InvalidArgumentError(
                f"finish_attempt: a span of rollout {span.rollout_id!r} attempt {span.attempt_id!r} was sent with "
                f"attempt {attempt_id!r} of rollout {rollout_id!r}; send each attempt's spans with its own finish"
            )
    # The attempt read once, for the spans and the status both; the spans' heartbeat written with the status.
    row = tx.first(_SELECT_ATTEMPT_AND_ROLLOUT, {"a_id": attempt_id})
    if row is None or row["rollout_id"] != rollout_id:
        raise NotFoundError(f"finish_attempt: no attempt {attempt_id!r} in rollout {rollout_id!r}")
    if new_spans:
        _op_add_numbered_spans(tx, new_spans, now, found={attempt_id: row}, beat=False)
    attempt = _attempt(row)
    beat = now if new_spans else None
    if row["latest_attempt_id"] == attempt_id and attempt.status in lifecycle.ACTIVE_ATTEMPT:
        _move_attempt(tx, attempt, row, status, now, beat=beat)
    elif beat is not None:
        tx.run(_HEARTBEAT, {"a_id": attempt_id, "now": beat})
        attempt.last_heartbeat_time = beat
    return attempt


def _op_allocate_sequence_ids(tx: _Tx, pairs: list[tuple[str, str]]) -> list[int]:
    """Reserve span sequence ids, per rollout, in the order asked. As in agent-lightning, the counter is the
    rollout's: the attempt id is not looked at (any id, "latest" too, numbers in its rollout's sequence)."""
    counts: dict[str, int] = {}
    for rollout_id, _ in pairs:
        counts[rollout_id] = counts.get(rollout_id, 0) + 1
    next_free: dict[str, int] = {}
    for rollout_id in sorted(counts):
        after = tx.first(_ALLOCATE_SPAN_IDS, {"r_id": rollout_id, "count": counts[rollout_id]})
        if after is None:
            raise NotFoundError(f"span sequence id: no rollout {rollout_id!r}")
        next_free[rollout_id] = after["next_span_sequence_id"] - counts[rollout_id]
    allocated = []
    for rollout_id, _ in pairs:
        allocated.append(next_free[rollout_id])
        next_free[rollout_id] += 1
    return allocated


def _span_statements(request: contract.QuerySpans) -> tuple[Any | None, Any | None]:
    """(None, None) for all spans of the rollout (or attempt) in sequence order, the common case; else the filtered
    statement and the same sorted and paged."""
    conditions = _filters(request, spans, (
        "trace_id", "trace_id_contains", "span_id", "span_id_contains", "parent_id", "parent_id_contains", "name",
        "name_contains",
    ))  # fmt: skip
    default_shape = (
        request.sort_by == "sequence_id" and request.sort_order == "asc" and request.limit == -1 and not request.offset
    )
    if not conditions and default_shape:
        return None, None
    stmt = select(spans.c.payload).where(spans.c.rollout_id == bindparam("r_id"))
    if request.attempt_id is not None:
        stmt = stmt.where(spans.c.attempt_id == bindparam("a_id"))
    stmt = stmt.where(*_combine(conditions, request.filter_logic))
    return stmt, _order_and_page(stmt, spans, request, spans.c.pk)


def _op_query_spans(
    tx: _Tx, request: contract.QuerySpans, stmt: Any | None, paged: Any | None
) -> PaginatedResult[Span]:
    payloads, total = _op_span_payloads(tx, request, stmt, paged)
    found = _SPAN_LIST.validate_json("[" + ",".join(payloads) + "]") if payloads else []
    return PaginatedResult(items=found, limit=request.limit, offset=request.offset, total=total)


def _op_span_payloads(
    tx: _Tx, request: contract.QuerySpans, stmt: Any | None, paged: Any | None
) -> tuple[list[str], int]:
    """The stored JSON of the spans query_spans answers, and how many match in all. `stmt` None: all spans of the
    rollout (or attempt) in sequence order; else `paged` is `stmt` sorted and paged."""
    rollout_id, attempt_id = request.rollout_id, request.attempt_id
    if attempt_id == "latest":
        latest = tx.first(_SELECT_LATEST_ATTEMPT_ID, {"r_id": rollout_id})
        if latest is None:
            raise NotFoundError(f"query_spans: no rollout {rollout_id!r}")
        if latest["latest_attempt_id"] is None:
            return [], 0
        attempt_id = latest["latest_attempt_id"]
    params = {"r_id": rollout_id, "a_id": attempt_id}
    if paged is not None:
        payloads = list(tx.conn.execute(paged, params).scalars())
    elif attempt_id is None:
        payloads = [row["payload"] for row in tx.rows(_SELECT_SPANS_OF_ROLLOUT, params)]
    else:
        payloads = [row["payload"] for row in tx.rows(_SELECT_SPANS_OF_ATTEMPT, params)]
    if not payloads:
        _check_rollout_exists(tx, rollout_id, "query_spans")
    total = len(payloads) if stmt is None else _total(tx, payloads, stmt, request, params)
    return payloads, total


def _op_latest_spans(tx: _Tx, rollout_ids: list[str], rewards_only: bool = False) -> dict[str, list[Span]]:
    """Spans of each rollout's latest attempt, in sequence order; unknown rollouts left out. The spans are found by
    a join on (rollout_id, attempt_id), one probe of the spans' identity index a rollout: with an IN list of the
    rollouts beside one of their attempts, SQLite probed every pair (768 rollouts: 590,000 probes, 150 ms against 8:
    docs/benchmarks.md, "The rollout summary's read"). `rewards_only`: the spans that may carry a reward
    (`contract.QueryLatestSpans`); a span whose text merely mentions the primary reward's name comes too, and is
    read as a span without a reward."""
    known = tx.conn.execute(select(rollouts.c.rollout_id).where(rollouts.c.rollout_id.in_(rollout_ids))).scalars()
    payloads: dict[str, list[str]] = {rollout_id: [] for rollout_id in known}
    if payloads:
        latest_attempt = and_(
            spans.c.rollout_id == rollouts.c.rollout_id, spans.c.attempt_id == rollouts.c.latest_attempt_id
        )
        stmt = (
            select(spans.c.rollout_id, spans.c.payload)
            .select_from(rollouts.join(spans, latest_attempt))
            .where(rollouts.c.rollout_id.in_(list(payloads)))
            .order_by(spans.c.rollout_id, spans.c.sequence_id, spans.c.pk)
        )
        if rewards_only:
            stmt = stmt.where(
                or_(
                    spans.c.name.contains("reward", autoescape=True),
                    spans.c.name == semconv.PEER_ANNOTATION_SPAN,
                    spans.c.payload.contains(f'"{semconv.PEER_PRIMARY_REWARD}"', autoescape=True),
                )
            )
        for row in tx.conn.execute(stmt):
            payloads[row.rollout_id].append(row.payload)
    return {
        rollout_id: _SPAN_LIST.validate_json("[" + ",".join(payloads[rollout_id]) + "]") if payloads[rollout_id] else []
        for rollout_id in rollout_ids
        if rollout_id in payloads
    }


def _op_watchdog(tx: _Tx, now: float) -> int:
    """Mark attempts that ran past their timeout or fell silent, and move their rollouts.
    Safe with several stores on one database: rows are locked (PostgreSQL) or the whole pass
    holds the write lock (SQLite), and each verdict is re-checked against the locked row."""
    silent_since = func.coalesce(attempts.c.last_heartbeat_time, attempts.c.start_time)
    overdue = (
        _ATTEMPT_AND_ROLLOUT.where(
            attempts.c.status.in_(sorted(lifecycle.ACTIVE_ATTEMPT)),
            or_(
                attempts.c.timeout_at < now,
                and_(
                    attempts.c.unresponsive_seconds.is_not(None),
                    silent_since + attempts.c.unresponsive_seconds < now,
                ),
            ),
        )
        .order_by(attempts.c.attempt_id)
        .with_for_update(of=attempts, skip_locked=True)
    )
    marked = 0
    for result_row in tx.conn.execute(overdue).all():
        row = dict(result_row._mapping)
        config = _config(row["config"])
        verdict = lifecycle.watchdog_verdict(row["status"], row["start_time"], row["last_heartbeat_time"], config, now)
        if verdict is None:
            continue
        _move_attempt(tx, _attempt(row), row, verdict, now)
        marked += 1
    return marked


def _op_rollout_numbers(tx: _Tx, rollout_ids: list[str]) -> dict[str, int]:
    """The row number (`seq`) of each known one of `rollout_ids`."""
    stmt = select(rollouts.c.rollout_id, rollouts.c.seq).where(rollouts.c.rollout_id.in_(rollout_ids))
    return {row.rollout_id: row.seq for row in tx.conn.execute(stmt)}


def _op_finished_ids(tx: _Tx, pending: dict[str, int]) -> dict[str, str]:
    """The finished ones among `pending` (rollout id: row number), by their ids alone: in the range of row numbers
    `pending` spans where it is dense (one batch's rollouts are enqueued together), else by the ids."""
    status = rollouts.c.status.in_(sorted(lifecycle.FINISHED_ROLLOUT))
    first, last = min(pending.values()), max(pending.values())
    if last - first < 4 * len(pending):
        in_range = select(rollouts.c.rollout_id).where(rollouts.c.seq.between(first, last), status)
        return {rid: rid for rid in tx.conn.scalars(in_range) if rid in pending}
    by_ids = select(rollouts.c.rollout_id).where(rollouts.c.rollout_id.in_(pending), status)
    return {rid: rid for rid in tx.conn.scalars(by_ids)}


def _op_finished_rollouts(tx: _Tx, pending: dict[str, int]) -> dict[str, Rollout]:
    """The finished ones among `pending` (rollout id: row number), found by `_op_finished_ids`, then read whole."""
    ended = list(_op_finished_ids(tx, pending))
    if not ended:
        return {}
    whole = select(*_ROLLOUT_COLUMNS).where(rollouts.c.rollout_id.in_(ended))
    return {row.rollout_id: _rollout(row._mapping) for row in tx.conn.execute(whole).all()}


def _op_page(
    tx: _Tx, select_: Callable[[_Tx, Any], list[T]], stmt: Any, paged: Any, page: contract.Page
) -> PaginatedResult[T]:
    """One page of a query: `select_` run on `paged` (`stmt` sorted and paged), with the total count of `stmt`."""
    found = select_(tx, paged)
    return PaginatedResult(items=found, limit=page.limit, offset=page.offset, total=_total(tx, found, stmt, page))


def _total(tx: _Tx, found: list[Any], stmt: Any, page: contract.Page, params: dict[str, Any] | None = None) -> int:
    """How many rows `stmt` matches in all. The page itself tells, unless it is full or lies past the end: then a
    COUNT over the same query."""
    if page.limit < 0 and (found or not page.offset):
        return page.offset + len(found)
    if 0 <= len(found) < page.limit and (found or not page.offset):
        return page.offset + len(found)
    counted = select(func.count()).select_from(stmt.order_by(None).subquery())
    return tx.conn.execute(counted, params or {}).scalar_one()


def _op_select_rollouts(tx: _Tx, stmt: Any) -> list[Rollout]:
    result: list[Rollout] = []
    for row in tx.conn.execute(stmt).all():
        mapping = row._mapping
        rollout = _rollout(mapping)
        if mapping["a_attempt_id"] is not None:
            attempt = _attempt({c.name: mapping[f"a_{c.name}"] for c in _ATTEMPT_COLUMNS})
            rollout = AttemptedRollout(**rollout.__dict__, attempt=attempt)
        result.append(rollout)
    return result


def _op_query_attempts(tx: _Tx, stmt: Any, *, rollout_id: str) -> list[Attempt]:
    found = [_attempt(row._mapping) for row in tx.conn.execute(stmt).all()]
    if not found:
        _check_rollout_exists(tx, rollout_id, "query_attempts")
    return found


def _op_latest_attempt(tx: _Tx, rollout_id: str) -> Attempt | None:
    row = tx.conn.execute(
        select(*_ATTEMPT_COLUMNS)
        .select_from(rollouts.outerjoin(attempts, attempts.c.attempt_id == rollouts.c.latest_attempt_id))
        .where(rollouts.c.rollout_id == rollout_id)
    ).first()
    if row is None:
        raise NotFoundError(f"get_latest_attempt: no rollout {rollout_id!r}")
    return None if row.attempt_id is None else _attempt(row._mapping)


def _op_put_resources(tx: _Tx, resources_id: str, encoded: str, now: float) -> ResourcesUpdate:
    conn = tx.conn
    latest_order = (conn.execute(select(func.max(resources.c.latest_order))).scalar() or 0) + 1
    existing = conn.execute(
        select(resources.c.version, resources.c.create_time)
        .where(resources.c.resources_id == resources_id)
        .with_for_update()
    ).first()
    values = {"update_time": now, "resources": encoded, "latest_order": latest_order}
    if existing is None:
        create_time, version = now, 1
        conn.execute(insert(resources).values(resources_id=resources_id, create_time=now, version=version, **values))
    else:
        create_time, version = existing.create_time, existing.version + 1
        conn.execute(
            update(resources).where(resources.c.resources_id == resources_id).values(version=version, **values)
        )
    return ResourcesUpdate(
        resources_id=resources_id,
        create_time=create_time,
        update_time=now,
        version=version,
        resources=_NAMED_RESOURCES.validate_json(encoded),
    )


def _op_select_resources(tx: _Tx, stmt: Any) -> list[ResourcesUpdate]:
    return [_resources_update(row) for row in tx.conn.execute(stmt).all()]


def _resources_update(row: Any) -> ResourcesUpdate:
    return ResourcesUpdate(
        resources_id=row.resources_id,
        create_time=row.create_time,
        update_time=row.update_time,
        version=row.version,
        resources=_NAMED_RESOURCES.validate_json(row.resources),
    )


def _op_heartbeat_worker(tx: _Tx, worker_id: str, values: dict[str, Any]) -> Worker:
    stmt = _dialect_insert(tx.conn)(workers).values(worker_id=worker_id, **values)
    tx.conn.execute(stmt.on_conflict_do_update(index_elements=[workers.c.worker_id], set_=values))
    return _worker(tx.conn.execute(select(workers).where(workers.c.worker_id == worker_id)).one()._mapping)


def _op_select_workers(tx: _Tx, stmt: Any) -> list[Worker]:
    return [_worker(row._mapping) for row in tx.conn.execute(stmt).all()]


def _op_statistics(tx: _Tx) -> dict[str, Any]:
    conn = tx.conn

    def by_status(table: Any) -> dict[str, int]:
        return dict(conn.execute(select(table.c.status, func.count()).group_by(table.c.status)).all())

    counts = {"rollouts": by_status(rollouts), "attempts": by_status(attempts), "workers": by_status(workers)}
    span_count = conn.execute(select(func.count()).select_from(spans)).scalar_one()
    resource_count = conn.execute(select(func.count()).select_from(resources)).scalar_one()
    return {
        # agent-lightning's names first, then ours (counts by status; spans and resources, kept for old readers)
        "total_rollouts": sum(counts["rollouts"].values()),
        "total_attempts": sum(counts["attempts"].values()),
        "total_spans": span_count,
        "total_resources": resource_count,
        "total_workers": sum(counts["workers"].values()),
        **counts,
        "spans": span_count,
        "resources": resource_count,
    }


# --- rows <-> models --------------------------------------------------------------------------


_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
# Types orjson would write but the json module refuses: they go to `default`, which has none, so they fail.
_ORJSON_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS


def _json(value: Any, argument: str) -> str:
    # orjson first: ~25x faster than the json module, on every enqueue. It writes NaN and infinity as null and
    # refuses what the json module may take (integer keys, integers past 64 bits), so output with a null, and any
    # value orjson refuses, goes to the json module, whose result (or error) stands.
    try:
        encoded = orjson.dumps(value, option=_ORJSON_OPTIONS)
        if b"null" not in encoded:
            return encoded.decode()
    except TypeError:
        pass
    try:
        return _JSON.encode(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{argument} must be JSON-serialisable: {exc}") from None


def _json_or_none(value: Any, argument: str) -> str | None:
    return None if value is None else _json(value, argument)


def _rollout_row(
    rollout: Rollout, encoded_input: str, key: str | None, queue: str | None, queued_at: float | None
) -> dict[str, Any]:
    return {
        "rollout_id": rollout.rollout_id,
        "input": encoded_input,
        "start_time": rollout.start_time,
        "end_time": None,
        "mode": rollout.mode,
        "resources_id": rollout.resources_id,
        "status": rollout.status,
        "config": _config_json(rollout.config),
        "metadata": _json_or_none(rollout.metadata, "metadata"),
        "idempotency_key": key,
        "queue": queue or DEFAULT_QUEUE,
        "queued_at": queued_at,
        "attempt_count": 0,
        "latest_attempt_id": None,
        "next_span_sequence_id": 1,
    }


def _span_json(span: Span) -> str:
    # All fields, defaults too: leaving them out (exclude_defaults) compares the nested models with their defaults
    # in Python, 3.5 us a span, more than the extra ~100 bytes cost to store and parse.
    return span.__pydantic_serializer__.to_json(span).decode()


_DEFAULT_CONFIG = RolloutConfig()
_DEFAULT_CONFIG_JSON = _DEFAULT_CONFIG.model_dump_json()


def _config_json(config: RolloutConfig) -> str:
    return _DEFAULT_CONFIG_JSON if config is _DEFAULT_CONFIG else config.model_dump_json()


@functools.lru_cache(maxsize=64)
def _config(encoded: str) -> RolloutConfig:
    # A run's rollouts share a few configs, and RolloutConfig is frozen: one parsed object serves all that have it.
    return _DEFAULT_CONFIG if encoded == _DEFAULT_CONFIG_JSON else RolloutConfig.model_validate_json(encoded)


def _rollout(mapping: Any) -> Rollout:
    metadata = mapping["metadata"]
    return Rollout(
        rollout_id=mapping["rollout_id"],
        input=json.loads(mapping["input"]),
        start_time=mapping["start_time"],
        end_time=mapping["end_time"],
        mode=mapping["mode"],
        resources_id=mapping["resources_id"],
        status=mapping["status"],
        config=_config(mapping["config"]),
        metadata=None if metadata is None else json.loads(metadata),
    )


def _attempt(mapping: Any) -> Attempt:
    metadata = mapping["metadata"]
    return Attempt(
        rollout_id=mapping["rollout_id"],
        attempt_id=mapping["attempt_id"],
        sequence_id=mapping["sequence_id"],
        start_time=mapping["start_time"],
        end_time=mapping["end_time"],
        status=mapping["status"],
        worker_id=mapping["worker_id"],
        last_heartbeat_time=mapping["last_heartbeat_time"],
        metadata=None if metadata is None else json.loads(metadata),
    )


def _worker(mapping: Any) -> Worker:
    fields = dict(mapping)
    if fields["heartbeat_stats"] is not None:
        fields["heartbeat_stats"] = json.loads(fields["heartbeat_stats"])
    return Worker.model_validate(fields)


# --- checks and helpers -----------------------------------------------------------------------


def _dialect_insert(conn: Connection) -> Any:
    """INSERT with ON CONFLICT clauses, which SQLite and PostgreSQL each spell in their dialect."""
    return sqlite_dialect.insert if conn.dialect.name == "sqlite" else pg_dialect.insert


def _check_rollout_exists(tx: _Tx, rollout_id: str, where: str) -> None:
    if tx.first(_SELECT_ROLLOUT_EXISTS, {"r_id": rollout_id}) is None:
        raise NotFoundError(f"{where}: no rollout {rollout_id!r}")


def _not_null(request: Request, name: str, expected: str) -> Any:
    """The request's field `name`, which may be left out but not given as null."""
    value = getattr(request, name)
    if value is None:
        raise InvalidArgumentError(f"{request.method}: {name} cannot be null; give {expected}")
    return value


def _filters(request: Request, table: Any, names: Sequence[str]) -> list[ColumnElement[bool]]:
    """The conditions of the request's filters `names` that are given (not None): `X_in`, column X is one of the
    values; `X_contains`, X contains the text (LIKE's wildcards taken literally); `X`, X equals the value."""
    conditions: list[ColumnElement[bool]] = []
    for name in names:
        value = getattr(request, name)
        if value is None:
            continue
        if name.endswith("_in"):
            conditions.append(table.c[name.removesuffix("_in")].in_(value))
        elif name.endswith("_contains"):
            conditions.append(table.c[name.removesuffix("_contains")].contains(value, autoescape=True))
        else:
            conditions.append(table.c[name] == value)
    return conditions


def _combine(conditions: list[ColumnElement[bool]], filter_logic: str) -> list[ColumnElement[bool]]:
    if not conditions:
        return []
    return [and_(*conditions)] if filter_logic == "and" else [or_(*conditions)]


def _order_and_page(stmt: Any, table: Any, page: contract.Page, default_order: Any) -> Any:
    """ORDER BY the request's `sort_by` (then `default_order`, which keeps ties in a stable order), LIMIT, OFFSET."""
    sort_by = getattr(page, "sort_by", None)
    if sort_by is not None:
        column = table.c[sort_by]
        order = column.desc() if page.sort_order == "desc" else column.asc()
        if column.nullable:
            # NULL counts as the smallest value, as in agent-lightning and SQLite; PostgreSQL's default is the
            # largest. (Only for columns that can hold NULL: an explicit NULLS order keeps PostgreSQL from reading
            # a plain index in order.)
            order = order.nulls_last() if page.sort_order == "desc" else order.nulls_first()
        stmt = stmt.order_by(order)
    if default_order is not None:
        stmt = stmt.order_by(default_order.desc() if page.sort_order == "desc" and sort_by is None else default_order)
    if page.limit >= 0:
        stmt = stmt.limit(page.limit)
    if page.offset:
        stmt = stmt.offset(page.offset)
    return stmt


def _translate(exc: StatementError) -> Exception:
    """Errors that come from the caller's data, said plainly; the rest pass through."""
    if isinstance(exc.orig, TypeError):
        return InvalidArgumentError(f"a value is not JSON-serialisable: {exc.orig}")
    return exc


def _normalise_url(url: str | URL) -> URL:
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres", "postgresql+psycopg2"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise InvalidArgumentError(
            f"store url must start with sqlite:// or postgresql://, got {parsed.render_as_string(hide_password=True)!r}"
        )
    return parsed


def _sqlite_engine(url: URL) -> Any:
    in_memory = url.database in (None, "", ":memory:")
    if not in_memory:
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        # Created readable by its owner only (SQLite gives its -wal and -shm files the same mode): it holds the
        # run's spans, prompts and resources (no token: the run's LLM resource holds none). An existing file keeps
        # its mode.
        os.close(os.open(url.database, os.O_CREAT | os.O_RDWR, 0o600))
    engine = create_engine(
        url,
        poolclass=StaticPool,
        # Named parameters (:name), so _Sql statements take the same dicts on both drivers.
        paramstyle="named",
        connect_args={"check_same_thread": False, "timeout": 30},
    )

    @event.listens_for(engine, "connect")
    def _configure(dbapi_connection: Any, _record: Any) -> None:
        # Transactions are begun by the store (BEGIN IMMEDIATE for writes), not by the sqlite3 module.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        if not in_memory:
            cursor.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a committed transaction survives a crash of the process; only a
        # power cut can lose the last few.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA cache_size=-65536")  # 64 MB of page cache instead of 2 MB
        # The background thread checkpoints the WAL; this is only the backstop when it is off (64 MB).
        cursor.execute("PRAGMA wal_autocheckpoint=16384")
        cursor.close()

    return engine
