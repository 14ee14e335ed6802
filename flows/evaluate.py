"""`evaluate`: the held-out reward of a run's checkpoint (the latest by default), greedy, every val task; and
`evaluation`, the subflow that `train` and `evaluate` both run.

    python -m flows.evaluate examples/copy_task/demo.yaml [--set run_name=...]
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.cli import run_flow_cli
from flows.params import flow_prologue, flow_run_name
from flows.rollouts import collect_rollouts, ids_argument, task_runner
from lightning.config import TrainConfig
from lightning.run import Run, serving_step
from tasks import log_evaluation, open_run, timed


def _evaluation_name() -> str:
    """`demo-evaluation-3`; the evaluation before a warm start (step -1) is `demo-evaluation-initial`."""

    run, step = flow_run.parameters["run"], flow_run.parameters["step"]
    return f"{run.name}-evaluation-{'initial' if step == -1 else step}"


@flow(name="evaluation", flow_run_name=_evaluation_name)
async def evaluation(run: Run, step: int) -> dict[str, Any]:
    """Greedy rollouts of every held-out task on the weights served now (checkpoint `step`; -1: the model before
    the warm start), then the result logged."""
    if run.config.val_data is None:
        return {"step": step, "rollouts": 0, "reward_mean": float("nan")}
    rollout_ids, summary = await collect_rollouts(run, step, "val")
    result = await timed(log_evaluation, run)(run, step, summary, ids_argument(run, rollout_ids))
    get_run_logger().info(
        "held-out reward %s: %.3f (%d tasks)", evaluation_label(step), result["reward_mean"], result["rollouts"]
    )
    return result


def evaluation_label(step: int) -> str:
    """What checkpoint `step` is, in the numbering of the iterations (from 0, as Prefect, the table and MLflow
    count them): checkpoint 10 is the weights after iteration 9, whose row of the table holds its reward."""
    if step < 0:
        return "of the initial model (before the warm start)"
    return f"of checkpoint {step} (after iteration {step - 1})" if step else "of checkpoint 0 (before training)"


async def evaluate_at(run: Run, step: int) -> dict[str, Any]:
    """The `evaluation` subflow, its runner tasks where the config puts them (threads or Ray)."""
    return await evaluation.with_options(task_runner=task_runner(run.config))(run, step)


@flow(name="evaluate", flow_run_name=flow_run_name("-evaluate"))
async def evaluate(
    config: TrainConfig = TrainConfig(),  # noqa: B008
    checkpoint: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Serve a checkpoint and evaluate it on the held-out tasks, in a queue of its own beside any training of the
    same run.

    Args:
        config: The run whose held-out tasks and checkpoints are used.
        checkpoint: A checkpoint's step directory; default: the run's latest, or the initial model.
        overrides: Dotted fields of `config` changed for this run only, e.g. {"eval_sampling.max_tokens": 32}.
    """
    config = await flow_prologue(config, overrides)
    step = serving_step(config, checkpoint)
    run = await timed(open_run, config)(config, train=False, weights=checkpoint, queue=f"{config.run_name}.evaluate")
    try:
        return await evaluate_at(run, step)
    finally:
        await run.close()


def main(argv: list[str] | None = None) -> None:
    run_flow_cli(evaluate, argv, description=__doc__)


if __name__ == "__main__":
    main()
