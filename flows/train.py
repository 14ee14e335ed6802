"""The training flows: `train` (the main job) opens the run and runs `training_iteration` subflows, each the seven
stages in order, with held-out `evaluation` subflows before, during and after.

    python -m flows.train examples/copy_task/demo.yaml [--set iterations=5 --set algorithm.lr=1e-4]

Without PREFECT_API_URL the flow runs on Prefect's temporary local server; with one, the run shows in that
server's UI (deployments of these flows are in prefect.yaml).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # a twin of a live run is refused before Prefect is imported (seconds under load)
    from flows.arguments import refuse_a_twin

    refuse_a_twin(sys.argv[1:])

import asyncio
import math
import time
from typing import Any
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact, acreate_progress_artifact, aupdate_progress_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from flows.artifacts import artifact_key, publish_table
from flows.evaluate import evaluate_at
from flows.params import flow_prologue, flow_run_name
from flows.rollouts import collect_rollouts, task_runner
from lightning import raycluster, stages, stopping
from lightning.algorithm.worker import UpdateLost
from lightning.config import TrainConfig
from lightning.run import Run
from tasks import adapt_spans, checkpoint, gpu_limited, open_run, ppo_step, timed, warm_start


@flow(name="training_iteration", flow_run_name="{run.name}-iteration-{iteration}", task_runner=ThreadPoolTaskRunner())
async def training_iteration(run: Run, iteration: int) -> dict[str, Any]:
    """rollouts (update resources -> enqueue -> runners fanned out -> wait) -> adapt spans -> PPO step -> checkpoint."""
    run.note_iteration(iteration, "begun")
    if run.config.algorithm.max_staleness:
        await stages.wait_for_turn(run, iteration)
    started = time.perf_counter()
    rollout_ids, rollouts = await collect_rollouts(run, iteration, "train")
    # The store's timing of the rollouts: a retried run's cached rollout stages took no time here.
    rollout_seconds = rollouts.get("seconds") or time.perf_counter() - started
    batch = await timed(adapt_spans, run)(run, iteration, rollout_ids)
    if batch["rows"] == 0:
        raise RuntimeError(
            f"iteration {iteration}: no training rows from {rollouts['rollouts']} rollouts "
            f"({rollouts['failed']} failed); adapter report: {batch['adapter']}, batch report: {batch['batch']}"
        )
    update = timed(await gpu_limited(ppo_step), run)
    # With max_staleness >= 1 the iteration before may still be updating: updates go in order, each from the last.
    await stages.wait_for_checkpoint(run, iteration)
    for attempt in range(2):
        metrics = await update(run, iteration, batch["batch_path"])
        row = stages.iteration_row(iteration, rollouts, batch, metrics, rollout_seconds)
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
    # One Ray connection for the whole run: prefect-ray reuses it instead of a new job (new workers) per iteration.
    connected = config.task_runner == "ray" and raycluster.connect(config.ray_address)
    run = await timed(open_run, config)(config)
    status = "FAILED"
    try:
        first = run.completed_iterations()
        if first >= config.iterations:
            logger.info("run %s already finished its %d iterations", config.run_name, config.iterations)
        elif first:
            logger.info("resuming run %s at iteration %d of %d", config.run_name, first + 1, config.iterations)
        initial = None
        if config.warm_start is not None:
            initial = await evaluate_at(run, -1)
            if run.latest_step() is None:
                done = await timed(warm_start, run)(run)
                logger.info(
                    "warm start: %d supervised steps on %d demonstrations", done["steps"], done["demonstrations"]
                )
        before = await evaluate_at(run, 0)
        # The rate is measured from the end of this process's first iteration, which carries the start-up (the
        # first subflow, the trainer's first step): counted in, it made the ETA read about 10 times too long.
        clock: tuple[float, int] | None = None
        table_id = None
        progress = await acreate_progress_artifact(
            100.0 * first / config.iterations, key=artifact_key(run, "progress"),
            description=f"Iterations of {run.name} done",
        )  # fmt: skip
        iteration_flow = training_iteration.with_options(task_runner=task_runner(config))
        staleness = config.algorithm.max_staleness
        # Iterations in flight, oldest first: one at a time with max_staleness 0; with k >= 1, up to k + 2, each
        # subflow started an iteration or more ahead of its turn (Prefect takes seconds to start one while others
        # run): iteration i's rollouts start once iteration i-1-k is done and the rollouts before it are in
        # (`stages.wait_for_turn`), while the ones before it update.
        in_flight: dict[int, asyncio.Task[dict[str, Any]]] = {}

        def evaluated(step: int) -> bool:
            return bool(config.eval_every) and step % config.eval_every == 0 and step < config.iterations

        async def finish_oldest() -> None:
            nonlocal clock, table_id
            iteration = min(in_flight)
            done = await in_flight.pop(iteration)
            step = iteration + 1
            if evaluated(step):  # nothing after it is in flight (below): the evaluation has the weights to itself
                await evaluate_at(run, step)
            if clock is None:  # the first iteration's own time, the only rate there is yet
                clock = (time.perf_counter(), step)
                rate = (1, done["seconds"])
            else:
                rate = (step - clock[1], time.perf_counter() - clock[0])
            [row] = [row for row in run.history if row["iteration"] == iteration]  # a later one may be there too
            logger.info(stages.progress_line(run, row, *rate))
            await aupdate_progress_artifact(progress, 100.0 * step / config.iterations)
            table_id = await _publish(run, table_id)

        async def make_room(iteration: int) -> None:
            """Until iteration `iteration`'s subflow may be started; meanwhile the iterations that end are reported,
            in order."""
            while in_flight:
                oldest, newest = min(in_flight), max(in_flight)
                # After an evaluation's step, none starts until the iterations before it (and the evaluation) are
                # done.
                if evaluated(iteration) or len(in_flight) > (staleness and staleness + 1) or in_flight[oldest].done():
                    await finish_oldest()
                elif run.iteration_reached(newest, "begun"):  # one subflow starting at a time: they slow each other
                    return
                else:
                    await asyncio.sleep(0.02)

        try:
            for iteration in range(first, config.iterations):
                stopping.check(f"iteration {iteration}")
                await make_room(iteration)
                in_flight[iteration] = asyncio.create_task(iteration_flow(run, iteration))
            while in_flight:
                await finish_oldest()
        finally:  # an iteration failed or the run stops: the ones in flight beside it end with it
            for task in in_flight.values():
                task.cancel()
            await asyncio.gather(*in_flight.values(), return_exceptions=True)
        after = await evaluate_at(run, config.iterations)
        status = "FINISHED"
        summary = stages.finish(run, before, after, initial)
        await acreate_markdown_artifact(
            stages.summary_markdown(run, summary), key=artifact_key(run, "summary"), description=f"How {run.name} went"
        )
        return summary
    except stopping.RunStopped:
        # Asked to stop (SIGINT, SIGTERM): the stage in flight ended early; what is unfinished is cancelled in the
        # store for the next process to requeue, and the error says what was kept.
        status = "KILLED"
        cancelled = await stages.cancel_for_stop(run)
        raise stopping.RunStopped(stages.stopped_summary(run, cancelled)) from None
    finally:
        await run.close(status)
        if connected:
            raycluster.disconnect()


async def _publish(run: Run, table_id: UUID | None) -> UUID:
    """The run's table of iterations as a Prefect artifact, updated in place each iteration, linking to MLflow."""
    columns = ["iteration", "reward", "val_reward", "zero_adv_groups", "entropy", "clip_frac", "grad_norm",
               "response_length", "pg_loss", "kl", "rollouts_ok", "rollouts_failed", "refills", "mismatch_mean",
               "mismatch_max", "stale_used", "stale_corrected", "stale_dropped", "staleness_mean", "staleness_max",
               "is_ratio_mean", "is_ratio_max", "is_ratio_clipped_frac", "rollout_tokens_per_s", "train_tokens_per_s",
               "rollout_seconds"]  # fmt: skip
    columns = [name for name in columns if any(name in row for row in run.history)]  # kl: only with a KL term
    table = [{name: _cell(row.get(name)) for name in columns} for row in run.history]
    description = (
        f"Training iterations of {run.name} (val_reward: the held-out reward after the iteration). "
        f"{stages.mlflow_link(run)}"
    )
    return await publish_table(artifact_key(run, "training"), table, description, table_id)


def _cell(value: Any) -> Any:
    """Four decimals; three significant digits below 0.001 (a mismatch of 3e-6 is not 0)."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return float(f"{value:.3g}") if 0 < abs(value) < 1e-3 else round(value, 4)
    return value


def main(argv: list[str] | None = None) -> None:
    from flows.cli import run_flow_cli

    run_flow_cli(train, argv, description=__doc__)


if __name__ == "__main__":
    main()
