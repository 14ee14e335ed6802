"""An agent that blocks its runner's event loop (a blocking call inside `async def`: `time.sleep`, a synchronous HTTP
client, a lock) is found from outside the loop, its rollout failed with where it blocked, and the loop given up if it
stays blocked.

Every runner of a fleet shares one event loop, so a blocked loop stops them all, and with them anything on that loop
that could notice: hence a thread. `LoopWatchdog` makes its loop beat (a `call_later` tick every BEAT_SECONDS) and
its thread look at the beat as often. Once the loop has not beaten for `blocked_after` seconds (`timeouts.blocked_loop`)
it reads where the loop's thread is (`sys._current_frames()`; the innermost frame of the agent's own code: not the
standard library's, an installed package's nor this library's) and which rollout's task holds the loop (each runner
marks the task its agent runs in, and the tasks the agent starts from it, with its attempt: `holding`), logs one line,
and, from its own thread, ends that attempt in the store as `failed` with an exception span that says so (`the agent
blocked its runner's event loop for 30.2 s at my_agent.py:12 in run (...)`; the rollout phase's error shows it, and the
rollout is retried per its config without waiting for its timeout). The agent's task is cancelled as soon as the loop
is free again, before anything else runs there, and its runner moves on to the next rollout.

Why no more than that: a coroutine that blocks cannot be cancelled, and a thread cannot be killed. So a loop that stays
blocked is given up rather than rescued: `lost` says why once it has been blocked past every running rollout's
`timeout_seconds` (the store has timed them all out by then: nothing on that loop can still count). For that the fleet
of a runner task runs on an event loop of its own, on a thread of its own (`WatchedLoop`), while the task's loop waits
for the rollouts: it still sees a stop (the run stops within its poll and STOP_GRACE_SECONDS, whatever the agent does)
and the loop given up, and then the runner task fails with the line (`EventLoopBlocked`); Prefect's retry of the task
starts a fresh fleet, in a fresh runner process with `task_runner: processes` (the blocked one is killed). Writing
the failure from the watchdog's thread, rather than waiting for the loop, is what makes the line and the retry come at
`blocked_after` however long the block lasts.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import contextvars
import gc
import logging
import math
import secrets
import sys
import sysconfig
import threading
import time
import traceback
import weakref
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from lightning import semconv
from lightning.store.base import LightningStore
from lightning.types import AttemptedRollout, Event, Span, TraceStatus

logger = logging.getLogger(__name__)

BEAT_SECONDS = 0.5
"""How often a watched loop beats, and how often its watchdog looks at the beat."""
STOP_GRACE_SECONDS = 2.0
"""In a stop, how long a fleet whose loop does not beat (an agent blocking it) is waited for before it is left
behind: its rollouts are cancelled in the store by the stop anyway."""

_LIBRARY = str(Path(__file__).resolve().parents[1])
_STANDARD_LIBRARY = tuple({str(Path(sysconfig.get_paths()[key]).resolve()) for key in ("stdlib", "platstdlib")})


class EventLoopBlocked(RuntimeError):
    """An agent blocked its runner's event loop: the rollout's failure (its exception span) and, when the loop stayed
    blocked past its rollouts' timeouts, the runner task's."""


@dataclass(frozen=True)
class Held:
    """A rollout's attempt and the task its agent runs in: what a blocked loop is blamed on."""

    rollout_id: str
    attempt_id: str
    task: weakref.ref[asyncio.Task[Any]]
    """The task that runs the agent (a weak reference: `_tasks` keeps what a task holds only while it lives)."""
    timeout: float | None
    """The rollout's `timeout_seconds`: past it the store has timed the attempt out."""


_held: contextvars.ContextVar[Held | None] = contextvars.ContextVar("lightning_held", default=None)
_tasks: weakref.WeakKeyDictionary[asyncio.Task[Any], Held] = weakref.WeakKeyDictionary()
"""The attempt each agent's task (and each task it started) holds, for the watchdog's thread to look up."""
_watchdogs: dict[asyncio.AbstractEventLoop, LoopWatchdog] = {}


@contextlib.contextmanager
def holding(claimed: AttemptedRollout) -> Iterator[None]:
    """In the task that runs the agent: it, and every task the agent starts from it on a watched loop, hold
    `claimed`'s attempt (so a block in any of them is blamed on it)."""
    task = asyncio.current_task()
    assert task is not None, "holding() runs in the agent's task"
    held = Held(claimed.rollout_id, claimed.attempt.attempt_id, weakref.ref(task), claimed.config.timeout_seconds)
    token = _held.set(held)
    _tasks[task] = held
    watchdog = _watchdogs.get(task.get_loop())
    if watchdog is not None:
        watchdog.running[held.attempt_id] = held
    try:
        yield
    finally:
        if watchdog is not None:
            watchdog.running.pop(held.attempt_id, None)
        _tasks.pop(task, None)
        _held.reset(token)


def _task_factory(loop: asyncio.AbstractEventLoop, coro: Any, **options: Any) -> asyncio.Task[Any]:
    """A watched loop's tasks: a task an agent starts holds its attempt too (`asyncio.gather`, a TaskGroup)."""
    task = asyncio.Task(coro, loop=loop, **options)
    context = options.get("context")
    held = context.get(_held) if context is not None else _held.get()
    if held is not None:
        _tasks[task] = held
    return task


class LoopWatchdog:
    """Watches the running event loop from a thread of its own (see the module's docstring); enter it on the loop's
    thread, in a coroutine: `with LoopWatchdog(store, blocked_after=30, name=...):`. `lost`: why the loop was given up
    (None while it has not been)."""

    def __init__(self, store: LightningStore, *, blocked_after: float, name: str) -> None:
        if blocked_after <= 0:
            raise ValueError(f"blocked_after must be > 0 seconds, got {blocked_after}")
        self.store = store
        self.blocked_after = blocked_after
        self.name = name
        self.running: dict[str, Held] = {}
        """The attempts whose agents run on this loop, by attempt id (`holding` fills it)."""
        self.lost: str | None = None
        self._beat = time.monotonic()
        self._blamed = ""
        """The reason of the latest block blamed on an agent."""
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._timer: asyncio.TimerHandle | None = None
        self._factory_installed = False
        self._thread = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)

    def __enter__(self) -> LoopWatchdog:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        if self._loop.get_task_factory() is None:
            self._loop.set_task_factory(_task_factory)
            self._factory_installed = True
        _watchdogs[self._loop] = self
        self._tick()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        _watchdogs.pop(self._loop, None)
        if self._factory_installed:
            self._loop.set_task_factory(None)

    def silent_for(self) -> float:
        """Seconds since the loop last beat (up to BEAT_SECONDS while it runs freely)."""
        return time.monotonic() - self._beat

    def _tick(self) -> None:
        self._beat = time.monotonic()
        assert self._loop is not None
        self._timer = self._loop.call_later(BEAT_SECONDS, self._tick)

    def _watch(self) -> None:
        """Each look: which task holds the loop, and since when (the loop's last beat, or the previous look if another
        task held it then: one batch of the loop's ready callbacks can run several agents' blocking steps in a row,
        and each is blamed for its own time)."""
        assert self._loop is not None
        beat, task, since, blamed = self._beat, None, self._beat, False
        looked = time.monotonic()
        while not self._stop.wait(BEAT_SECONDS):
            now, holder = time.monotonic(), asyncio.current_task(self._loop)
            if self._beat != beat:  # the loop ran its beat: nothing held it since
                if blamed:
                    logger.info("%s: its event loop is free again after %.1f s", self.name, self._beat - since)
                beat, task, since, blamed = self._beat, holder, self._beat, False
            elif holder is not task:
                task, since, blamed = holder, looked, False
            looked = now
            if not blamed and now - since >= self.blocked_after:
                self._blamed, blamed = self._blame(now - since, holder), True
            silent = now - beat
            if self.lost is None and silent > self._limit():
                why = self._blamed or "its agents blocked the runner's event loop"
                self.lost = f"{why}; the loop was given up after {silent:.0f} s blocked"
                logger.error("%s: %s, past every rollout's timeout_seconds on it", self.name, self.lost)

    def _limit(self) -> float:
        """How long the loop may stay blocked before it is given up: until every rollout on it has timed out."""
        timeouts = [held.timeout if held.timeout is not None else math.inf for held in list(self.running.values())]
        return max([self.blocked_after, *timeouts])

    def _blame(self, silent: float, task: asyncio.Task[Any] | None) -> str:
        """Log where the loop is stuck and fail the attempt that `task` (the one holding the loop) runs; the reason."""
        assert self._loop is not None
        frame = sys._current_frames().get(self._loop_thread)
        agent = _agent_frame(frame) if frame is not None else None
        # The stack up to the agent's frame: what the phase's error names (`lightning.diagnose.agent_errors`).
        stack = traceback.format_stack(agent) if agent is not None else []
        where = _where(agent) if agent is not None else "an unknown place"
        held = _tasks.get(task) if task is not None else None
        reason = (
            f"the agent blocked its runner's event loop for {silent:.1f} s at {where} (a blocking call inside async "
            "def stops every rollout of the runner: await an async version of it, or run it in asyncio.to_thread)"
        )
        if held is None:
            logger.error("%s: %s; no rollout's task held the loop", self.name, reason)
            return reason
        logger.error("rollout %s attempt %s failed: %s", held.rollout_id, held.attempt_id, reason)
        span = _exception_span(held, reason, "".join(stack))
        try:
            attempt = asyncio.run(self.store.finish_attempt(held.rollout_id, held.attempt_id, "failed", [span]))
        except Exception as exc:  # the store's watchdog times the attempt out in the end
            logger.warning("rollout %s: the blocked attempt could not be failed in the store: %r", held.rollout_id, exc)
        else:
            if attempt.status != "failed":
                logger.info("rollout %s attempt %s had ended as %s", held.rollout_id, held.attempt_id, attempt.status)
        agent_task = held.task()
        if agent_task is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(agent_task.cancel)  # the first thing the loop does once free
        return reason


def _own_code(filename: str) -> bool:
    """Not the standard library's, an installed package's, this library's, nor generated (`<frozen ...>`)."""
    if filename.startswith("<"):
        return False
    path = str(Path(filename).resolve())
    return not (path.startswith((_LIBRARY, *_STANDARD_LIBRARY)) or "-packages" in path)


def _agent_frame(frame: FrameType) -> FrameType:
    """The innermost frame of the agent's own code in the stack `frame` ends; `frame` itself if none is."""
    found: FrameType | None = frame
    while found is not None:
        if _own_code(found.f_code.co_filename):
            return found
        found = found.f_back
    return frame


def _where(frame: FrameType) -> str:
    path = frame.f_code.co_filename
    with contextlib.suppress(ValueError):
        path = str(Path(path).resolve().relative_to(Path.cwd()))
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"


def _exception_span(held: Held, reason: str, stack: str) -> Span:
    """The span `emit_exception` would have recorded, had the agent raised EventLoopBlocked where it blocked."""
    now = time.time()
    kind = EventLoopBlocked.__name__
    attributes = {"exception.type": kind, "exception.message": reason, "exception.stacktrace": stack}
    return Span(
        rollout_id=held.rollout_id, attempt_id=held.attempt_id, sequence_id=0, trace_id=secrets.token_hex(16),
        span_id=secrets.token_hex(8), name=semconv.EXCEPTION_SPAN,
        status=TraceStatus(status_code="ERROR", description=f"{kind}: {reason}"),
        events=[Event(name="exception", attributes=attributes, timestamp=now)], start_time=now, end_time=now,
    )  # fmt: skip


async def _finalize_garbage(timeout: float = 5.0) -> None:
    """Free the garbage that only the cyclic collector frees while this loop still runs, and wait (at most `timeout`
    seconds) for what its finalizers start. An agent's dropped `AsyncOpenAI()` client (agl's apo examples make one per
    rollout) schedules its closing on the running loop when freed: freed later on another loop (the flow's), closing
    its connections of this closed loop fails, and asyncio logs "Task exception was never retrieved" as an error."""
    before = asyncio.all_tasks()
    gc.collect()
    started = asyncio.all_tasks() - before
    if started:
        _, pending = await asyncio.wait(started, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


KEEP_IDLE_LOOPS = 8
"""How many idle fleet loops a process keeps for its next phases (more are ended as their phase ends)."""
IDLE_THREAD_NAME = "lightning-idle-loop"


class _LoopThread:
    """An event loop running on a daemon thread of its own until stopped. A fleet's loop is kept between rollout
    phases (`take` and `give_back`), and with it what agents keep on it: the LLM's kept-alive session
    (`LLM.http_session()`) and a store client's connections, which a new loop per phase opened again every phase
    (128 a runner process on the demo; measured, the CPU that saves is within the noise there: docs/benchmarks.md)."""

    _idle: list[_LoopThread] = []
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=IDLE_THREAD_NAME, daemon=True)
        self.used_by: str | None = None
        """The name it last ran under: a fleet's next phase takes its own loop back, with its agents' connections."""
        self.thread.start()

    @classmethod
    def take(cls, name: str) -> _LoopThread:
        """The idle loop last used under `name`, else the last one kept, else a new one; its thread named `name`
        while in use."""
        with cls._lock:
            home = next((kept for kept in reversed(cls._idle) if kept.used_by == name), None)
            if home is not None:
                cls._idle.remove(home)
            elif cls._idle:
                home = cls._idle.pop()
        home = home or cls()
        home.thread.name = name
        return home

    def give_back(self) -> None:
        """Kept for a next phase (or ended, when KEEP_IDLE_LOOPS are kept already). On the loop's thread."""
        self.used_by = self.thread.name
        self.thread.name = IDLE_THREAD_NAME
        with self._lock:
            if len(self._idle) < KEEP_IDLE_LOOPS:
                self._idle.append(self)
                return
        self.loop.stop()

    @classmethod
    def end_idle(cls, timeout: float = 2.0) -> None:
        """End the kept loops (at the process's exit): their sessions close with their async generators."""
        with cls._lock:
            idle, cls._idle = cls._idle, []
        for home in idle:
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                home.loop.call_soon_threadsafe(home.loop.stop)
        for home in idle:
            home.thread.join(timeout)

    def _run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            try:
                loop.run_until_complete(_cancel_leftovers())
                loop.run_until_complete(loop.shutdown_asyncgens())  # the sessions kept on this loop
                loop.run_until_complete(_finalize_garbage())  # what the cancelled leftovers dropped
            finally:
                asyncio.set_event_loop(None)
                loop.close()


atexit.register(_LoopThread.end_idle)


async def _cancel_leftovers(timeout: float | None = None) -> tuple[int, int]:
    """Cancel the loop's other tasks (what agents started and left running) and wait for them to end, at most
    `timeout` seconds: how many there were, and how many still run (a task may catch its cancellation and go on)."""
    leftovers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task() and not task.done()]
    for task in leftovers:
        task.cancel()
    if not leftovers:
        return 0, 0
    ended, running = await asyncio.wait(leftovers, timeout=timeout)
    for task in ended:
        if not task.cancelled():
            task.exception()  # retrieved: an agent's leftover that failed is not "never retrieved" noise
    return len(leftovers), len(running)


class WatchedLoop:
    """`coroutine` run on an event loop of a thread of its own, watched by a LoopWatchdog, so that the caller's loop
    stays free: to see a stop, a deadline, or the loop given up (`lost`). `done` holds the coroutine's outcome.

    The loop is kept for the process's next WatchedLoop once the coroutine has ended and the tasks it left are
    cancelled (`_LoopThread`); a loop given up is ended instead, if it ever frees."""

    def __init__(
        self, coroutine: Coroutine[Any, Any, Any], store: LightningStore, *, blocked_after: float, name: str
    ) -> None:
        self.done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.watchdog = LoopWatchdog(store, blocked_after=blocked_after, name=name)
        self._name = name
        self._home = _LoopThread.take(name)
        self._loop = self._home.loop
        self._task: asyncio.Task[Any] | None = None
        # The caller's context goes along (a Prefect task's logger), as asyncio.to_thread passes it.
        self._loop.call_soon_threadsafe(self._start, coroutine, context=contextvars.copy_context())

    @property
    def lost(self) -> str | None:
        return self.watchdog.lost

    def silent_for(self) -> float:
        return self.watchdog.silent_for()

    def cancel(self) -> None:
        """Cancel the coroutine (once the loop runs: at once unless an agent blocks it)."""
        if not self.done.done():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        if self._task is not None:  # `_start` was called before: the loop runs its callbacks in order
            self._task.cancel()

    def _start(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        # Not the loop's default executor of the last phase: a sync agent's thread that never returns (its attempt
        # timed out and abandoned) stays with the phase that started it.
        executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix=self._name)
        self._loop.set_default_executor(executor)

        async def main() -> Any:
            try:
                with self.watchdog:
                    return await coroutine
            finally:  # unwatched (a full collection may take a second), and before `done` is set
                await _finalize_garbage()

        self._task = self._loop.create_task(main())
        self._task.add_done_callback(lambda task: self._ended(task, executor))

    def _ended(self, task: asyncio.Task[Any], executor: concurrent.futures.ThreadPoolExecutor) -> None:
        """The loop tidied and kept (or ended), then the coroutine's outcome in `done`: in that order, so that the
        caller's next phase finds the loop kept (it found none while a loaded machine had not tidied it yet). The
        tidying waits at most `blocked_after` for the tasks the agents left; a loop still running one is ended."""

        async def tidy() -> None:
            tidied = False
            try:
                left, running = await _cancel_leftovers(timeout=self.watchdog.blocked_after)
                if left:
                    await _finalize_garbage()  # what the cancelled leftovers dropped
                tidied = not running
            finally:
                executor.shutdown(wait=False, cancel_futures=True)
                if self.lost is None and tidied:
                    self._home.give_back()
                else:
                    self._loop.stop()
                if task.cancelled():
                    self.done.set_exception(asyncio.CancelledError())
                elif task.exception() is not None:
                    self.done.set_exception(task.exception())  # type: ignore[arg-type]
                else:
                    self.done.set_result(task.result())

        self._loop.create_task(tidy())
