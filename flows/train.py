"""The training flows: `train` (the main job) runs `training_iteration` subflows, each the seven stages in order.

    python -m flows.train examples/copy_task/demo.yaml [--set iterations=5 --set algorithm.lr=1e-4]

Without PREFECT_API_URL the flow runs on Prefect's temporary local server; with one, the run shows in that
server's UI (deployments of these flows are in prefect.yaml).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from typing import Any

from prefect import flow, get_run_logger, unmapped
from prefect.artifacts import acreate_markdown_artifact, acreate_table_artifact
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from lightning import pipeline, raycluster
from lightning.config import TrainConfig
from lightning.pipeline import Endpoints
from tasks import (
    adapt_spans,
    checkpoint,
    enqueue_rollouts,
    evaluate,
    ppo_step,
    run_runner,
    start_run,
    update_resources,
    wait_for_rollouts,
    warm_start,
)
from tasks.caching import TRAIN_FLOW_RUN_ID


@flow(
    name="training_iteration",
    flow_run_name="{config.run_name}-iteration-{iteration}",
    task_runner=ThreadPoolTaskRunner(),
)
async def training_iteration(config: TrainConfig, iteration: int, endpoints: Endpoints) -> dict[str, Any]:
    """update resources -> enqueue rollouts -> runners (fanned out) -> wait -> adapt spans -> PPO step -> checkpoint."""
    started = time.perf_counter()
    resources_id = await update_resources(config, iteration, endpoints.proxy_url)
    rollout_ids = await enqueue_rollouts(config, iteration, resources_id)
    runners = run_runner.map(unmapped(config), unmapped(iteration), unmapped(rollout_ids), range(config.n_runners))
    await asyncio.to_thread(runners.result)
    rollouts = await wait_for_rollouts(config, iteration, rollout_ids)
    rollout_seconds = time.perf_counter() - started
    batch = await adapt_spans(config, iteration, rollout_ids)
    if batch["rows"] == 0:
        raise RuntimeError(
            f"iteration {iteration}: no training rows from {rollouts['rollouts']} rollouts "
            f"({rollouts['failed']} failed); adapter report: {batch['adapter']}, batch report: {batch['batch']}"
        )
    metrics = await ppo_step(config, iteration, batch["batch_path"])
    row = pipeline.iteration_row(iteration, rollouts, batch, metrics, rollout_seconds)
    saved = await checkpoint(config, iteration, row)
    return {**row, "checkpoint": saved["checkpoint"], "seconds": time.perf_counter() - started}


@flow(name="train", flow_run_name="{config.run_name}")
async def train(config: TrainConfig = TrainConfig()) -> dict[str, Any]:  # noqa: B008 (the UI's form default)
    """Train `config.agent` on `config.train_data`; resumes a run whose name has checkpoints."""
    logger = get_run_logger()
    TRAIN_FLOW_RUN_ID.set(str(flow_run.get_id()))
    first = pipeline.completed_iterations(config)
    if first >= config.iterations:
        logger.info("run %s already finished its %d iterations", config.run_name, config.iterations)
    elif first:
        logger.info("resuming run %s at iteration %d of %d", config.run_name, first + 1, config.iterations)
    # One Ray connection for the whole run: prefect-ray reuses it instead of a new job (new workers) per iteration.
    connected = config.task_runner == "ray" and raycluster.connect(config.ray_address)
    endpoints = start_run(config)
    status = "FAILED"
    try:
        initial = None
        if config.warm_start is not None:
            initial = await _evaluation(config, -1)
            if pipeline.completed_iterations(config) == 0 and not pipeline.read_state(config).get("warm_start"):
                done = await warm_start(config)
                pipeline.record_state(config, warm_start=done)
                logger.info(
                    "warm start: %d supervised steps on %d demonstrations", done["steps"], done["demonstrations"]
                )
        before = await _evaluation(config, 0)
        history = pipeline.read_state(config).get("history", [])
        started = time.perf_counter()
        iteration_flow = training_iteration.with_options(task_runner=task_runner(config))
        for iteration in range(first, config.iterations):
            row = await iteration_flow(config, iteration, endpoints)
            history = [h for h in history if h["iteration"] < iteration] + [row]
            step = iteration + 1
            if config.eval_every and step % config.eval_every == 0 and step < config.iterations:
                row["val_reward"] = (await _evaluation(config, step))["reward_mean"]
            pipeline.record_iteration(config, history)
            done = iteration + 1 - first
            logger.info(pipeline.progress_line(config, row, done, time.perf_counter() - started))
            await _publish(config, history)
        after = await _evaluation(config, config.iterations)
        status = "FINISHED"
        return pipeline.finish_run(config, before, after, initial)
    finally:
        await pipeline.stop_run(config, status)
        if connected:
            raycluster.disconnect()


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


async def _evaluation(config: TrainConfig, step: int) -> dict[str, Any]:
    """The held-out evaluation at checkpoint `step` (-1: the model before the warm start), once per run: a resumed
    run reads it from run.json."""
    done = pipeline.read_state(config).get("evaluations", {})
    if str(step) in done:
        return done[str(step)]
    result = await evaluate(config, step)
    pipeline.record_evaluation(config, step, result)
    label = "of the initial model (before the warm start)" if step < 0 else f"at step {step}"
    get_run_logger().info("held-out reward %s: %.3f (%d tasks)", label, result["reward_mean"], result["rollouts"])
    return result


async def _publish(config: TrainConfig, history: list[dict[str, Any]]) -> None:
    """The run's table of iterations as a Prefect artifact (a new version each iteration), linking to MLflow."""
    key = re.sub(r"[^a-z0-9-]", "-", f"{config.run_name}-training".lower())
    columns = ["iteration", "reward", "val_reward", "pg_loss", "kl", "rollouts_ok", "rollouts_failed",
               "rollout_tokens_per_s", "train_tokens_per_s", "seconds"]  # fmt: skip
    table = [{name: _cell(row.get(name)) for name in columns} for row in history]
    mlflow = pipeline.mlflow_link(config)
    await acreate_table_artifact(table, key=key, description=f"Training iterations of {config.run_name}. {mlflow}")
    if len(history) == 1 or history[-1]["iteration"] + 1 == config.iterations:
        await acreate_markdown_artifact(
            f"## {config.run_name}\n\n{mlflow}\n\nCheckpoints: `{pipeline.checkpoints_dir(config)}`\n",
            key=f"{key}-links",
        )


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 4)
    return value


def main(argv: list[str] | None = None) -> None:
    from flows.cli import run_flow_cli

    run_flow_cli(train, argv, description=__doc__)


if __name__ == "__main__":
    main()
