"""`evaluate`: the held-out reward of a run's checkpoint (the latest by default), greedy, every val task.

python -m flows.evaluate examples/copy_task/demo.yaml [--set run_name=...]
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from lightning import pipeline
from lightning.config import TrainConfig
from tasks import evaluate as evaluate_task
from tasks import start_run
from tasks.caching import TRAIN_FLOW_RUN_ID


@flow(name="evaluate", flow_run_name="{config.run_name}-evaluate")
async def evaluate(config: TrainConfig = TrainConfig(), checkpoint: str | None = None) -> dict[str, Any]:  # noqa: B008
    """Serve `checkpoint` (a step directory; default the run's latest, or the initial model) and evaluate it."""
    TRAIN_FLOW_RUN_ID.set(str(flow_run.get_id()))
    step = pipeline.serve_checkpoint_step(config, checkpoint)
    start_run(config, train=False, weights=checkpoint)
    try:
        result = await evaluate_task(config, step)
    finally:
        await pipeline.stop_run(config)
    get_run_logger().info("held-out reward of %s at step %d: %.3f", config.run_name, step, result["reward_mean"])
    return result


def main(argv: list[str] | None = None) -> None:
    from flows.cli import run_flow_cli

    run_flow_cli(evaluate, argv, description=__doc__)


if __name__ == "__main__":
    main()
