"""Many runners at once: on one event loop, sharing one claim loop (`run_fleet`), or in threads of this process,
each with its own event loop (`start_runner_threads`); either way sharing one store."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence

from lightning.runner import Runner, known_versions
from lightning.store.base import LightningStore
from lightning.store.errors import AuthError, StoreError
from lightning.types import AttemptedRollout, ResourcesUpdate

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

    One loop claims work for the whole fleet: a rollout for each idle runner, in one `claim_rollouts` naming
    their worker ids (each attempt starts running under its runner's id), each handed to that runner's
    `run_attempt` with its resources, which the claim brings only when the fleet lacks them. (Each runner polling on
    its own, as `Runner.iter` does, costs a store transaction per idle runner each time anything in the store
    changes.) An empty queue is waited on for up to `idle_wait` seconds at a time (an enqueue through the same
    store wakes the wait at once), so the fleet stops within about `idle_wait` of `stop_event`; running rollouts
    finish first."""
    if len({runner.worker_id for runner in runners}) != len(runners):
        raise ValueError("run_fleet: the runners' worker_ids repeat; give each runner its own worker_id")
    idle = list(runners)
    known: dict[str, ResourcesUpdate] = {}  # what the fleet's claims brought, by resources id
    freed = asyncio.Event()  # a runner became idle
    working: set[asyncio.Task[None]] = set()
    errors: list[BaseException] = []  # what a runner raised besides a store error (a refused token, a bug)
    ran = 0
    backoff = 0.1

    async def work(runner: Runner, claimed: AttemptedRollout) -> None:
        nonlocal ran
        try:
            await runner.run_attempt(claimed, resources=known.get(claimed.resources_id or ""))
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
                claim = await store.claim_rollouts(
                    [runner.worker_id for runner in idle],
                    wait=idle_wait,
                    queue=queue,
                    known_resources=known_versions(known),
                )
            except AuthError:
                raise  # a refused token stays refused
            except StoreError as exc:
                logger.warning("runner fleet: store error %s; retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            backoff = 0.1
            known.update((update.resources_id, update) for update in claim.resources)
            by_worker = {runner.worker_id: runner for runner in idle}
            for rollout in claim.rollouts:
                runner = by_worker[rollout.attempt.worker_id or ""]
                idle.remove(runner)
                task = asyncio.create_task(work(runner, rollout))
                working.add(task)
                task.add_done_callback(working.discard)
    except asyncio.CancelledError:
        # Cancelled (a run that stops): the rollouts in flight are cancelled too, not waited for.
        for task in working:
            task.cancel()
        raise
    finally:
        await asyncio.gather(*working, return_exceptions=True)
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
