"""Many runners at once: a runner task's fleet on one event loop until its rollouts finish (`run_fleet_until`, over
the claim loop `lightning.runner.run_fleet`), or runners in threads of this process, each with its own event loop
(`start_runner_threads`); either way sharing one store. What a fleet needs comes as plain values (the agent, the
store, the queue, the deadline): this room knows nothing of a training run."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from lightning import stopping
from lightning.agent import Hook, LitAgent
from lightning.runner import Runner, run_fleet
from lightning.runner.blocking import STOP_GRACE_SECONDS, EventLoopBlocked, WatchedLoop
from lightning.store.base import LightningStore

logger = logging.getLogger(__name__)


async def run_fleet_until(
    agent: LitAgent[Any],
    store: LightningStore,
    rollout_ids: Sequence[str],
    *,
    queue: str,
    concurrency: int,
    index: int,
    timeout: float,
    blocked_after: float,
    on_rollout_end: Callable[[], None],
) -> dict[str, Any]:
    """Runner task `index`'s fleet: `concurrency` runners of `agent` taking rollouts of `queue` in `store` until every
    one of `rollout_ids` finished or `timeout` seconds passed; `on_rollout_end` is called as each rollout ends. A stop
    asked for (`lightning.stopping`) cancels the rollouts in flight and raises RunStopped.

    The fleet runs on an event loop of a thread of its own, watched (`lightning.runner.blocking.WatchedLoop`), and
    this loop waits: an agent that blocks the fleet's loop for `blocked_after` seconds has its rollout failed, and one
    that keeps it blocked past every rollout's timeout there raises EventLoopBlocked here (the loop is left behind)."""
    from lightning.tracing import Tracer

    stop = threading.Event()
    tracer = Tracer(store)  # one exporter for the fleet, not a thread per runner
    progress = [_Progress(on_rollout_end, set(rollout_ids))]
    names = [f"{queue}-runner{index}-{i}" for i in range(concurrency)]
    fleet = [Runner(agent, store, tracer=tracer, worker_id=name, queue=queue, hooks=progress) for name in names]
    # One claim loop for the fleet, not a poll per idle runner; its claims bring the resources once.
    claims = run_fleet(fleet, store, stop_event=stop, queue=queue, idle_wait=0.05)
    working = WatchedLoop(claims, store, blocked_after=blocked_after, name=f"{queue}-fleet{index}")
    try:
        finished = await wait_unless_stopped(
            store, rollout_ids, timeout, give_up=lambda: working.lost is not None, busy=lambda: progress[0].running > 0
        )
    finally:
        stop.set()
        if stopping.stop_requested() or working.lost:  # the rollouts in flight are cancelled, not waited for
            working.cancel()
        ran = await _fleet_end(working)
        await asyncio.to_thread(tracer.shutdown)
    if stopping.stop_requested() and len(finished) < len(set(rollout_ids)):
        raise stopping.RunStopped(f"runner task {index} stopped with {len(finished)} of its rollouts finished")
    if working.lost:
        raise EventLoopBlocked(
            f"runner task {index}: {working.lost}; {len(finished)} of its {len(set(rollout_ids))} rollouts had "
            "finished, the others run again on a fresh fleet"
        )
    if isinstance(ran, BaseException):
        logger.error("runner task %d stopped early: %r", index, ran)
    return {"runner": index, "ran": ran if isinstance(ran, int) else 0, "finished": len(finished)}


async def _fleet_end(working: WatchedLoop) -> Any:
    """What the fleet's claim loop returned or raised, once it ended; None for a fleet left behind: its loop given
    up, or, in a stop, not beating for STOP_GRACE_SECONDS (an agent blocks it)."""
    ended = asyncio.wrap_future(working.done)
    while not ended.done():
        if working.lost or (stopping.stop_requested() and working.silent_for() > STOP_GRACE_SECONDS):
            ended.add_done_callback(lambda future: future.cancelled() or future.exception())  # retrieved: not logged
            return None
        await asyncio.wait({ended}, timeout=stopping.POLL_SECONDS)
    if ended.cancelled():
        return asyncio.CancelledError()
    return ended.exception() or ended.result()


async def wait_unless_stopped(
    store: LightningStore,
    rollout_ids: Sequence[str],
    timeout: float,
    give_up: Callable[[], bool] | None = None,
    busy: Callable[[], bool] | None = None,
) -> list[str]:
    """`store.wait_for_finished_ids`, in slices of `stopping.POLL_SECONDS`, so that a stop asked for (or `give_up()`
    turning true) ends the wait within one slice; the ids of the rollouts that finished. Each slice waits only on the
    rollouts not seen finished yet (a finished rollout stays finished while its phase waits). Ids alone: a runner
    process read every rollout of its phase whole to count them (44 us a rollout, in each runner process).

    `busy()` true: the caller runs some of `rollout_ids` itself (a fleet, its rollouts in flight), so they cannot all
    have finished: the store is asked once a slice, not at every rollout the fleet finishes (each finish woke a read
    of the phase's rows, 50 a second, 13% of a runner process's store thread; issue 39). Once a slice still: an
    attempt the store moved on may run on here."""
    deadline = time.monotonic() + timeout
    wanted = list(dict.fromkeys(rollout_ids))
    finished: set[str] = set()
    while True:
        left = deadline - time.monotonic()
        pending = [rollout_id for rollout_id in wanted if rollout_id not in finished]
        slice_ = max(min(left, stopping.POLL_SECONDS), 0.0)
        if busy is not None and busy():
            await _while_busy(busy, slice_, give_up)
            slice_ = 0.0  # a look, then the loop's checks: busy again, or idle and waiting
        finished.update(await store.wait_for_finished_ids(rollout_ids=pending, timeout=slice_))
        if len(finished) >= len(wanted) or left <= 0 or stopping.stop_requested() or (give_up and give_up()):
            return [rollout_id for rollout_id in wanted if rollout_id in finished]


BUSY_CHECK_SECONDS = 0.01
"""How often a fleet's wait looks whether the fleet still runs rollouts of its phase (a look at a counter)."""


async def _while_busy(busy: Callable[[], bool], seconds: float, give_up: Callable[[], bool] | None) -> None:
    """Up to `seconds`, until `busy()` turns false, a stop is asked for or `give_up()` turns true."""
    until = time.monotonic() + seconds
    while busy() and time.monotonic() < until and not stopping.stop_requested() and not (give_up and give_up()):
        await asyncio.sleep(BUSY_CHECK_SECONDS)


class _Progress(Hook):
    """Each rollout a runner finishes is progress (a run's stall warning waits for none): `note` is called. Counts the
    fleet's rollouts of `phase` (ids) in flight, for its wait; on the fleet's event loop alone."""

    def __init__(self, note: Callable[[], None], phase: set[str]) -> None:
        self.note = note
        self.phase = phase
        self.running = 0

    async def on_rollout_start(self, *, rollout: Any, **_: Any) -> None:
        if rollout.rollout_id in self.phase:
            self.running += 1

    async def on_rollout_end(self, *, rollout: Any, **_: Any) -> None:
        if rollout.rollout_id in self.phase:
            self.running -= 1
        self.note()


def start_runner_threads(
    make_runner: Callable[[int], Runner], count: int, stop_event: threading.Event
) -> list[threading.Thread]:
    """Start `count` threads, thread i running `make_runner(i).iter()` until `stop_event` is set."""

    def run(index: int) -> None:
        async def main() -> None:
            runner = make_runner(index)
            try:
                await runner.iter(stop_event=stop_event)
            finally:
                await runner.close()

        asyncio.run(main())

    threads = [threading.Thread(target=run, args=(i,), name=f"runner-{i}", daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads
