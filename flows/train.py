"""The training flows: `train` (the main job) opens the run and runs `training_iteration` subflows, each the seven
stages in order, with held-out `evaluation` subflows before, during and after.

    python -m flows.train examples/copy_task/demo.yaml [--set iterations=5 --set algorithm.lr=1e-4]

Without PREFECT_API_URL the flow runs on Prefect's temporary local server; with one, the run shows in that
server's UI (deployments of these flows are in prefect.yaml).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # the run's lock, taken before Prefect is imported: a twin is refused in seconds under load
    from flows.arguments import take_the_run

    _lock = take_the_run(sys.argv[1:])

import time
from typing import Any
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from flows.artifacts import artifact_key, publish_progress, publish_table
from flows.evaluate import evaluate_at
from flows.params import flow_prologue, flow_run_name
from flows.rollouts import collect_rollouts, ids_argument, task_runner
from lightning import pipeline, raycluster, reporting, stages, stopping
from lightning.algorithm.worker import UpdateLost
from lightning.config import TrainConfig
from lightning.pipeline import Pipeline
from lightning.run import Run
from tasks import adapt_spans, checkpoint, gpu_limited, open_run, ppo_step, timed, warm_start


@flow(name="training_iteration", flow_run_name="{run.name}-iteration-{iteration}", task_runner=ThreadPoolTaskRunner())
async def training_iteration(run: Run, iteration: int) -> dict[str, Any]:
    """rollouts (update resources -> enqueue -> runners fanned out -> wait) -> adapt spans -> PPO step -> checkpoint."""
    await pipeline.begin_iteration(run, iteration)
    started = time.perf_counter()
    rollout_ids, rollouts = await collect_rollouts(run, iteration, "train")
    # The store's timing of the rollouts: a retried run's cached rollout stages took no time here.
    rollout_seconds = rollouts.get("seconds") or time.perf_counter() - started
    batch = await timed(adapt_spans, run)(run, iteration, ids_argument(run, rollout_ids))
    if batch["rows"] == 0:
        raise RuntimeError(
            f"iteration {iteration}: no training rows from {rollouts['rollouts']} rollouts "
            f"({rollouts['failed']} failed); adapter report: {batch['adapter']}, batch report: {batch['batch']}"
        )
    update = timed(await gpu_limited(ppo_step), run)
    # With max_staleness >= 1 the iteration before may still be updating: updates go in order, each from the last.
    await pipeline.wait_for_checkpoint(run, iteration)
    for attempt in range(2):
        metrics = await update(run, iteration, batch["batch_path"])
        row = reporting.iteration_row(iteration, rollouts, batch, metrics, rollout_seconds)
        try:
            saved = await timed(checkpoint, run)(run, iteration, row)
            break
        except UpdateLost:  # the trainer process died between the two: take the (same) step again, once
            if attempt:
                raise
            get_run_logger().warning(
                "iteration %d: the trainer lost its update before saving it; taking it again", iteration
            )
    return {**row, "checkpoint": saved["checkpoint"], "seconds": time.perf_counter() - started}


@flow(name="train", flow_run_name=flow_run_name())
async def train(
    config: TrainConfig = TrainConfig(),  # noqa: B008 (the UI's form default)
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train `config.agent` on `config.train_data`; resumes a run whose name has checkpoints.

    Args:
        config: The run: agent, datasets, model, algorithm, sizes, where results go (a deployment's is its default).
        overrides: Dotted fields of `config` changed for this run only, e.g. {"iterations": 3, "algorithm.lr": 1e-4}.
    """
    config = await flow_prologue(config, overrides)
    logger = get_run_logger()
    run = await timed(open_run, config)(config)
    status, connected = "FAILED", False
    try:
        # One Ray connection for the whole run: prefect-ray reuses it instead of a new job (new workers) per
        # iteration. Made once the run is open, so that its workers get the run's proxy token (`raycluster`).
        connected = config.task_runner == "ray" and raycluster.connect(config.ray_address)
        first = run.completed_iterations()
        if first >= config.iterations:
            logger.info("run %s already finished its %d iterations", config.run_name, config.iterations)
        elif first:
            logger.info(reporting.resume_line(config.run_name, first, config.iterations))
        initial = None
        if config.warm_start is not None:
            initial = await evaluate_at(run, -1)
            if run.latest_step() is None:
                done = await timed(warm_start, run)(run)
                logger.info(
                    "warm start: %d supervised steps on %d demonstrations", done["steps"], done["demonstrations"]
                )
                if unfit := reporting.warm_start_unfit(done, config.warm_start.stop_at_loss):
                    logger.warning(unfit)
        before = await evaluate_at(run, 0)
        progress_key, progress_text = artifact_key(run, "progress"), f"Iterations of {run.name} done"
        progress = await publish_progress(progress_key, 100.0 * first / config.iterations, progress_text, None)
        pace, table_id = reporting.Pace(), None

        async def report(iteration: int, done: dict[str, Any]) -> None:
            nonlocal table_id
            [row] = [row for row in run.history if row["iteration"] == iteration]  # a later one may be there too
            logger.info(reporting.progress_line(run, row, *pace.lap(iteration + 1, done["seconds"])))
            await publish_progress(progress_key, 100.0 * (iteration + 1) / config.iterations, progress_text, progress)
            table_id = await _publish(run, table_id)

        iteration_flow = training_iteration.with_options(task_runner=task_runner(config))
        # The iterations in flight and when the next may start (`lightning.pipeline`), evaluations in the middle.
        async with Pipeline(
            run, lambda i: iteration_flow(run, i), lambda step: evaluate_at(run, step), report
        ) as in_flight:
            for iteration in range(first, config.iterations):
                await in_flight.start(iteration)
            await in_flight.finish()
        after = await evaluate_at(run, config.iterations)
        await _publish(run, table_id)  # the last row's val_reward: the final held-out evaluation's
        status = "FINISHED"
        summary = stages.finish(run, before, after, initial)
        await acreate_markdown_artifact(
            reporting.summary_markdown(run, summary),
            key=artifact_key(run, "summary"),
            description=f"How {run.name} went",
        )
        return summary
    except stopping.RunStopped:
        # Asked to stop (SIGINT, SIGTERM): the stage in flight ended early; what is unfinished is cancelled in the
        # store for the next process to requeue, and the error says what was kept.
        status = "KILLED"
        cancelled = await stages.cancel_for_stop(run)
        raise stopping.RunStopped(reporting.stopped_summary(run, cancelled)) from None
    finally:
        await run.close(status)
        if connected:
            raycluster.disconnect()


async def _publish(run: Run, table_id: UUID | None) -> UUID:
    """The run's table of iterations as a Prefect artifact, updated in place each iteration, linking to MLflow."""
    description = (
        f"Training iterations of {run.name} (val_reward: the held-out reward after the iteration). "
        f"{reporting.mlflow_link(run)}"
    )
    return await publish_table(
        artifact_key(run, "training"), reporting.iteration_table(run.history), description, table_id
    )


def main(argv: list[str] | None = None) -> None:
    from flows.cli import run_flow_cli

    run_flow_cli(train, argv, description=__doc__)


if __name__ == "__main__":
    try:
        main()
    finally:
        if _lock is not None:
            _lock.release()
