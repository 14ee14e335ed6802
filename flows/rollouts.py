"""The rollout phase as Prefect tasks, the same in `train`, `evaluate` and `dev`: update_resources ->
enqueue_rollouts -> run_runner x n_runners (fanned out with `map`) -> wait_for_rollouts."""

from __future__ import annotations

import asyncio
from typing import Any

from prefect import unmapped
from prefect.task_runners import ThreadPoolTaskRunner

from lightning import stages
from lightning.config import TrainConfig
from lightning.run import Run
from lightning.stages import Mode
from tasks import enqueue_rollouts, requeue_unsuccessful, run_runner, timed, update_resources, wait_for_rollouts


async def collect_rollouts(run: Run, iteration: int, mode: Mode) -> tuple[list[str], dict[str, Any]]:
    """The iteration's rollouts (for evaluation, `iteration` is the checkpoint step evaluated), run by the run's
    runners; their ids and summary (counts, mean reward). When fewer than `min_success_fraction` succeeded, the
    others run again (`rollout_retries` rounds) before the phase fails."""
    resources_id = await timed(update_resources, run)(run, iteration, mode)
    rollout_ids = await timed(enqueue_rollouts, run)(run, iteration, resources_id, mode)
    return rollout_ids, await run_rollouts(run, iteration, rollout_ids, mode)


async def run_rollouts(run: Run, iteration: int, rollout_ids: list[str], mode: Mode) -> dict[str, Any]:
    """Enqueued rollouts run by `run_runner` tasks fanned out, then waited for; their summary. When fewer than
    `min_success_fraction` succeeded, the others run again (`rollout_retries` rounds) before the phase fails."""
    for round_ in range(run.config.rollout_retries + 1):
        runners = timed(run_runner, run).map(
            unmapped(run), unmapped(iteration), unmapped(rollout_ids), range(run.config.n_runners), unmapped(mode),
            unmapped(round_),
        )  # fmt: skip
        await asyncio.to_thread(runners.result)
        summary = await timed(wait_for_rollouts, run)(run, iteration, rollout_ids, mode, round_)
        if stages.enough_succeeded(run, summary):
            return summary
        if round_ < run.config.rollout_retries:
            await timed(requeue_unsuccessful, run)(run, iteration, rollout_ids, mode, round_)
    raise await stages.rollouts_failed(run, iteration, rollout_ids, summary)


def task_runner(config: TrainConfig) -> Any:
    """Where the runner tasks run: threads of this process, or Ray workers (prefect-ray) on the cluster `train`
    connected to (`lightning.raycluster`). Ray workers are other processes, on other machines of a cluster: they
    need a store and a proxy they can reach (TrainConfig checks the store), get the tokens through the job's
    runtime_env, and import the agent from their own Python environment (install the project on every node)."""
    if config.task_runner == "default":
        return ThreadPoolTaskRunner(max_workers=max(config.n_runners, 4))
    try:
        from prefect_ray import RayTaskRunner
    except ImportError as exc:
        raise RuntimeError("task_runner: 'ray' needs prefect-ray (pip install -e '.[ray]')") from exc
    return RayTaskRunner(address=config.ray_address)
