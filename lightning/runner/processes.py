"""Runner fleets in processes of their own (`task_runner: processes`). Each runner task hands its rollouts to a child
process of the run, which runs the fleet there (`lightning.runner.fleet.run_fleet_until`: the agents, the runners,
the tracer, a store connection of its own) and answers with the task's result. The agents' Python then runs on another
interpreter, and another core, than the flow's, which keeps Prefect, the store's watchdog and the adapter.

Children are started when first needed and kept for the run (spawned: a second or two, the agent's imports
included); two rollout phases at once (max_staleness >= 1) use two. Parent and child speak JSON over a pipe: one
request (the rollout ids, the deadline), progress notes while it runs (the run's stall warning hears of finished
rollouts), one reply. A child that dies fails its runner task, whose retry gets a fresh child; one that is silent
past the phase's deadline and a margin is killed; one whose fleet's event loop an agent blocked for good answers
with that error (`lightning.runner.blocking`) and is ended, as is every child that failed. A stop asked for in the
flow's process reaches the child as SIGTERM, and its fleet stops as one in the flow does (the rollouts in flight
cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from lightning import pipes, stopping

MARGIN_SECONDS = 60.0
"""How long past the phase's deadline a silent child is given before it is killed (its fleet stops at the deadline
and answers)."""
REAP_SECONDS = 2.0
"""How long a child whose pipe closed is waited for, for its exit code."""
PROGRESS_EVERY = 1.0
"""Seconds between a child's progress notes (at most one a second, however many rollouts finish)."""


class RunnerProcessDied(RuntimeError):
    """A runner process ended (crashed, killed) before answering; its runner task fails and a retry starts another."""


class RunnerProcessError(RuntimeError):
    """The fleet raised inside the runner process; the message carries its traceback."""


@dataclass(frozen=True)
class FleetSpec:
    """What a runner process's fleets are: `concurrency` runners of `agent` (module:name) taking rollouts of `queue`
    from the store at `store_url` (a connection of the process's own)."""

    store_url: str
    agent: str
    queue: str
    concurrency: int


class RunnerProcesses:
    """The run's runner processes, each running `fleet`s: idle ones are reused, a busy set grows by one when a runner
    task finds none idle. Thread-safe: Prefect runs the runner tasks on threads of the flow, each with its own event
    loop."""

    def __init__(self, fleet: FleetSpec, *, start_timeout: float, stacks_dir: str | Path | None = None) -> None:
        self.fleet = fleet
        self.start_timeout = start_timeout
        self.stacks_dir = None if stacks_dir is None else str(stacks_dir)
        self._lock = threading.Lock()
        self._idle: list[_Child] = []
        self._busy: set[_Child] = set()
        self._closed = False

    @property
    def pids(self) -> list[int]:
        """The live children's process ids."""
        with self._lock:
            children = [*self._idle, *self._busy]
        return [child.pid for child in children if child.alive]

    async def run_fleet(
        self,
        rollout_ids: Sequence[str],
        index: int,
        *,
        timeout: float,
        blocked_after: float,
        on_progress: Callable[[], None],
    ) -> dict[str, Any]:
        """Runner task `index`'s fleet in a child until `rollout_ids` finish or `timeout` passes (the child enforces
        it; MARGIN_SECONDS later it is killed); the fleet's result. `on_progress` is called for each progress
        note; `blocked_after`: `run_fleet_until`'s (an agent that blocks the fleet's loop for good fails the task,
        and the child is ended)."""
        child = self._take()
        healthy = False
        try:
            if not child.alive:
                await asyncio.to_thread(child.start, self.fleet, self.start_timeout, self.stacks_dir)
            request = {
                "op": "run", "rollout_ids": list(rollout_ids), "index": index, "timeout": timeout,
                "blocked_after": blocked_after,
            }  # fmt: skip
            result = await child.call(request, timeout + MARGIN_SECONDS, on_progress)
            healthy = True
            return result
        finally:
            self._give_back(child, healthy)

    def close(self) -> None:
        """End every child (politely, then by force); safe to call twice."""
        with self._lock:
            self._closed = True
            children = [*self._idle, *self._busy]
            self._idle, self._busy = [], set()
        for child in children:
            child.stop(kill=False)

    def _take(self) -> _Child:
        with self._lock:
            if self._closed:
                raise RuntimeError("the run's runner processes are closed (the run was closed)")
            child = self._idle.pop() if self._idle else _Child()
            self._busy.add(child)
            return child

    def _give_back(self, child: _Child, healthy: bool) -> None:
        """A child that answered goes back to the idle list; any other (failed, timed out, interrupted: a reply may
        still be on its way) is ended."""
        with self._lock:
            self._busy.discard(child)
            keep = healthy and child.alive and not self._closed
            if keep:
                self._idle.append(child)
        if not keep:
            child.stop(kill=True)


class _Child:
    """One runner process and the parent's end of its pipe."""

    def __init__(self) -> None:
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._signalled = False

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    @property
    def pid(self) -> int:
        return self._process.pid if self._process is not None and self._process.pid is not None else 0

    def start(self, fleet: FleetSpec, timeout: float, stacks_dir: str | None) -> None:
        """Spawn the child and wait until it has imported the agent and opened the store."""
        context = multiprocessing.get_context("spawn")
        parent_conn, child_conn = context.Pipe()
        args = (child_conn, fleet, os.getpid(), stacks_dir)
        self._process = context.Process(target=_serve, args=args, name="runner-process", daemon=True)
        self._process.start()
        child_conn.close()  # the child's death is then an EOF here
        self._conn = parent_conn
        deadline = time.monotonic() + timeout
        while not parent_conn.poll(stopping.POLL_SECONDS):
            if stopping.stop_requested():
                raise stopping.RunStopped("a runner process was starting when the run was asked to stop")
            if time.monotonic() > deadline:
                raise RunnerProcessDied(f"a runner process did not start within {timeout:g}s (timeouts.startup)")
            if not self.alive:
                break
        self._reply("start")

    async def call(self, request: dict[str, Any], timeout: float, on_progress: Callable[[], None]) -> Any:
        """Send `request`, pass progress notes to `on_progress`, and return the reply's result."""
        assert self._conn is not None
        conn = self._conn
        with contextlib.suppress(OSError):  # a broken pipe: the wait below reports the death and exit code
            pipes.send(conn, request)
        deadline = time.monotonic() + timeout
        while True:
            if stopping.stop_requested() and not self._signalled:
                self._signalled = True  # the child stops its fleet as the flow's process would
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGTERM)
            if not await asyncio.to_thread(conn.poll, stopping.POLL_SECONDS):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"runner process {self.pid} gave no answer within {timeout:g}s (the rollout phase's deadline "
                        f"and {MARGIN_SECONDS:g}s); it is killed, and a retry of the runner task starts another"
                    )
                continue
            reply = self._reply(request["op"])
            if reply is None:
                on_progress()
                continue
            return reply

    def _reply(self, op: str) -> Any:
        """The next message: None for a progress note, else the result (an error raised here)."""
        assert self._conn is not None
        try:
            message = json.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            code = None
            if self._process is not None:
                # The pipe closes as the child dies, a moment before it can be reaped: its exit code comes after.
                self._process.join(REAP_SECONDS)
                code = self._process.exitcode
            raise RunnerProcessDied(
                f"runner process {self.pid} died during {op} (exit code {code}); its claimed rollouts are requeued "
                "by the store's watchdog when their attempts time out"
            ) from None
        if "progress" in message or "ready" in message:
            return None
        if "stopped" in message:
            raise stopping.RunStopped(message["stopped"])
        if "error" in message:
            raise RunnerProcessError(f"runner process {op} failed: {message['error']}\n{message['traceback']}")
        return message["result"]

    def stop(self, *, kill: bool) -> None:
        process, conn = self._process, self._conn
        self._process, self._conn = None, None
        pipes.end(process, conn, kill=kill)


# --- the child --------------------------------------------------------------------------------


def _serve(conn: Connection, fleet: FleetSpec, parent: int, stacks_dir: str | None) -> None:
    """The child's loop: open the store, say ready, run one fleet per request until told to close. It dies with
    its parent, and stops its fleet on SIGTERM (the parent's stop)."""
    from lightning.diagnose import dump_stacks_on_signal
    from lightning.lifeline import exit_with_parent
    from lightning.serving import freeze_startup_objects

    os.setpgid(0, 0)  # Ctrl-C in a terminal reaches the flow's process, which stops the children itself
    exit_with_parent(parent)
    dump_stacks_on_signal(stacks_dir, "runner")
    signal.signal(signal.SIGTERM, lambda *_: stopping.request_stop("the flow's process asked its runners to stop"))
    loop = asyncio.new_event_loop()
    try:
        store = loop.run_until_complete(_open_store(fleet))
    except Exception as exc:
        pipes.send(conn, pipes.error_reply(exc))
        return
    freeze_startup_objects()  # each fleet ends with a full collection: over what it made, not the imports
    pipes.send(conn, {"ready": True})
    for request in pipes.requests(conn):
        try:
            result = loop.run_until_complete(_run_request(fleet, store, request, conn))
            _send(conn, {"result": result})
        except stopping.RunStopped as exc:
            _send(conn, {"stopped": str(exc)})
        except Exception as exc:
            _send(conn, pipes.error_reply(exc))
    with contextlib.suppress(Exception):
        loop.run_until_complete(store.close())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def _open_store(fleet: FleetSpec) -> Any:
    from lightning.config import load_agent
    from lightning.store import open_store

    load_agent(fleet.agent)  # an agent that does not import fails the start, not every request
    return open_store(fleet.store_url, watchdog_interval=None)


async def _run_request(fleet: FleetSpec, store: Any, request: dict[str, Any], conn: Connection) -> dict[str, Any]:
    from lightning.config import load_agent
    from lightning.runner.fleet import run_fleet_until

    last = [0.0]

    def progress() -> None:  # on the fleet's thread
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY:
            last[0] = now
            _send(conn, {"progress": 1})

    done = await run_fleet_until(
        load_agent(fleet.agent), store, request["rollout_ids"], queue=fleet.queue, concurrency=fleet.concurrency,
        index=request["index"], timeout=request["timeout"], blocked_after=request["blocked_after"],
        on_rollout_end=progress,
    )  # fmt: skip
    return {**done, "pid": os.getpid()}  # where the runner task's rollouts ran


_sending = threading.Lock()


def _send(conn: Connection, message: dict[str, Any]) -> None:
    """One message to the parent: the fleet's thread sends progress notes, this one the replies (and a fleet left
    behind, its loop blocked, may still send one when it wakes)."""
    with _sending:
        pipes.send(conn, message)
