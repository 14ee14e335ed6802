"""The rollout phase as Prefect tasks, the same in `train`, `evaluate` and `dev`: update_resources ->
enqueue_rollouts -> run_runner x n_runners (fanned out with `map`) -> wait_for_rollouts. The loop over them (retry
rounds, dynamic sampling's refills) is the library's (`lightning.stages.collect_rollouts`); this module hands it the
tasks."""

from __future__ import annotations

import asyncio
from typing import Any

from prefect import unmapped
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote

from lightning import stages
from lightning.config import TrainConfig
from lightning.run import Run
from lightning.stages import Mode
from tasks import enqueue_rollouts, requeue_unsuccessful, run_runner, timed, update_resources, wait_for_rollouts


def ids_argument(run: Run, rollout_ids: list[str]) -> Any:
    """A stage's rollout ids as its task's argument: `quote`d, so that Prefect does not visit each id looking for
    futures, twice a task (13% of the flow process's CPU in a demo iteration); plain for Ray workers, which were handed
    the quote as the one-element tuple it is made of (prefect-ray 0.6) instead of the list."""
    return rollout_ids if run.config.task_runner == "ray" else quote(rollout_ids)


async def _run_runners(run: Run, iteration: int, rollout_ids: list[str], mode: Mode, round_: int) -> None:
    """`n_runners` runner tasks fanned out (threads of this process, or Ray workers), waited for."""
    runners = timed(run_runner, run).map(
        unmapped(run), unmapped(iteration), unmapped(ids_argument(run, rollout_ids)), range(run.config.n_runners),
        unmapped(mode), unmapped(round_),
    )  # fmt: skip
    await asyncio.to_thread(runners.result)


TASKS = stages.RolloutSteps(
    update_resources=lambda run, iteration, mode: timed(update_resources, run)(run, iteration, mode),
    enqueue_rollouts=lambda run, iteration, resources_id, mode, refill, count: timed(enqueue_rollouts, run)(
        run, iteration, resources_id, mode, refill, count
    ),
    run_runners=_run_runners,
    wait_for_rollouts=lambda run, iteration, rollout_ids, mode, round_: timed(wait_for_rollouts, run)(
        run, iteration, ids_argument(run, rollout_ids), mode, round_
    ),
    requeue_unsuccessful=lambda run, iteration, rollout_ids, mode, round_: timed(requeue_unsuccessful, run)(
        run, iteration, ids_argument(run, rollout_ids), mode, round_
    ),
)
"""The rollout phase's steps as this package's Prefect tasks, each with its timeout from the run's config."""


async def collect_rollouts(run: Run, iteration: int, mode: Mode) -> tuple[list[str], dict[str, Any]]:
    """The iteration's rollouts run as tasks (`lightning.stages.collect_rollouts`): their ids and summary."""
    return await stages.collect_rollouts(run, iteration, mode, TASKS)


async def run_rollouts(run: Run, iteration: int, rollout_ids: list[str], mode: Mode) -> dict[str, Any]:
    """Enqueued rollouts run as tasks, with `rollout_retries` rounds for failed ones (`lightning.stages`)."""
    return await stages.run_rollouts(run, iteration, rollout_ids, mode, TASKS)


def task_runner(config: TrainConfig) -> Any:
    """Where the runner tasks run: threads of this process (their fleets there, or in the run's runner processes),
    or Ray workers (prefect-ray) on the cluster `train`
    connected to (`lightning.raycluster`). Ray workers are other processes, on other machines of a cluster: they
    need a store and a proxy they can reach (TrainConfig checks the store), get the tokens through the job's
    runtime_env, and import the agent from their own Python environment (install the project on every node)."""
    if config.task_runner in ("default", "processes"):  # processes: the tasks wait here, their fleets run there
        return ThreadPoolTaskRunner(max_workers=max(config.n_runners, 4))
    try:
        from prefect_ray import RayTaskRunner
    except ImportError as exc:
        raise RuntimeError("task_runner: 'ray' needs prefect-ray (pip install -e '.[ray]')") from exc
    return RayTaskRunner(address=config.ray_address)
