"""Many runners at once: on one event loop, sharing one claim loop (`run_fleet`), or in threads of this process,
each with its own event loop (`start_runner_threads`); either way sharing one store."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence

from lightning.runner import Runner
from lightning.store.base import LightningStore
from lightning.store.errors import AuthError, StoreError
from lightning.types import AttemptedRollout

logger = logging.getLogger(__name__)


async def run_fleet(
    runners: Sequence[Runner],
    store: LightningStore,
    *,
    stop_event: asyncio.Event,
    queue: str | None = None,
    idle_wait: float = 0.05,
) -> int:
    """Run rollouts of `queue` on `runners`, all on this event loop, until `stop_event` is set; how many ran.

    One loop claims work for the whole fleet: as many rollouts as there are idle runners, in one
    `dequeue_many_rollouts`, each handed to an idle runner's `run_attempt`. (Each runner polling on its own, as
    `Runner.iter` does, costs a store transaction per idle runner each time anything in the store changes.)
    An empty queue is waited on for up to `idle_wait` seconds at a time (an enqueue through the same store wakes
    the wait at once), so the fleet stops within about `idle_wait` of `stop_event`; running rollouts finish first.

    The claim names no worker; each runner puts its own `worker_id` on the attempt as it starts running it."""
    idle = list(runners)
    freed = asyncio.Event()  # a runner became idle
    working: set[asyncio.Task[None]] = set()
    errors: list[BaseException] = []  # what a runner raised besides a store error (a refused token, a bug)
    ran = 0
    backoff = 0.1

    async def work(runner: Runner, claimed: AttemptedRollout) -> None:
        nonlocal ran
        try:
            await runner.run_attempt(claimed)
            ran += 1
        except AuthError as exc:
            errors.append(exc)
        except StoreError as exc:
            # The store failed mid-attempt: its watchdog requeues what the runner held.
            logger.warning("runner %s: store error %s; the attempt is left to the watchdog", runner.worker_id, exc)
        except Exception as exc:
            errors.append(exc)
        finally:
            idle.append(runner)
            freed.set()

    try:
        while not stop_event.is_set() and not errors:
            if not idle:
                freed.clear()
                await freed.wait()
                continue
            try:
                claimed = await store.dequeue_many_rollouts(limit=len(idle), wait=idle_wait, queue=queue)
            except AuthError:
                raise  # a refused token stays refused
            except StoreError as exc:
                logger.warning("runner fleet: store error %s; retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            backoff = 0.1
            for rollout in claimed:
                task = asyncio.create_task(work(idle.pop(), rollout))
                working.add(task)
                task.add_done_callback(working.discard)
    finally:
        await asyncio.gather(*working)
    if errors:
        raise errors[0]
    return ran


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
