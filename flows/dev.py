"""`dev`: a dry run of one iteration's rollouts and the adapter, without updates (agent-lightning's Trainer.dev).
Checks that the agent, the dataset, the proxy and the adapter fit together before a long run.

    python -m flows.dev examples/copy_task/demo.yaml [--set batch_size=4]
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prefect import flow, get_run_logger, unmapped
from prefect.runtime import flow_run

from lightning import pipeline
from lightning.config import TrainConfig
from tasks import adapt_spans, enqueue_rollouts, run_runner, start_run, update_resources, wait_for_rollouts
from tasks.caching import TRAIN_FLOW_RUN_ID


@flow(name="dev", flow_run_name="{config.run_name}-dev")
async def dev(config: TrainConfig = TrainConfig()) -> dict[str, Any]:  # noqa: B008
    """One batch of rollouts on the current weights, adapted to a training batch; nothing is trained."""
    TRAIN_FLOW_RUN_ID.set(str(flow_run.get_id()))
    config = config.model_copy(update={"run_name": f"{config.run_name}-dev"})
    iteration = int(time.time())  # each dry run enqueues fresh rollouts
    endpoints = start_run(config, train=False)
    try:
        resources_id = await update_resources(config, iteration, endpoints.proxy_url)
        rollout_ids = await enqueue_rollouts(config, iteration, resources_id)
        runners = run_runner.map(unmapped(config), unmapped(iteration), unmapped(rollout_ids), range(config.n_runners))
        await asyncio.to_thread(runners.result)
        rollouts = await wait_for_rollouts(config, iteration, rollout_ids)
        batch = await adapt_spans(config, iteration, rollout_ids)
    finally:
        await pipeline.stop_run(config)
    get_run_logger().info(
        "dev: %d rollouts (%d failed), reward %.3f, %d training rows; adapter: %s",
        rollouts["rollouts"], rollouts["failed"], rollouts["reward_mean"], batch["rows"], batch["adapter"],
    )  # fmt: skip
    return {"rollouts": rollouts, "batch": batch}


def main(argv: list[str] | None = None) -> None:
    from flows.cli import run_flow_cli

    run_flow_cli(dev, argv, description=__doc__)


if __name__ == "__main__":
    main()
