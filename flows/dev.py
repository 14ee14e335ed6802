"""`dev`: a dry run of one batch of rollouts and the adapter, without updates (agent-lightning's Trainer.dev).
Checks that the agent, the dataset, the proxy and the adapter fit together before a long run, on the run's current
weights, in a queue of its own: a `dev` beside a training of the same run never touches its rollouts. Rollouts that
leave nothing to train on (no reward, calls made with the agent's own client and so without token ids) are what a
dry run is for finding: the report's batch says why (the `NoTrainingRows` message training would stop with) and the
flow finishes. For a prompt optimisation config (`apo` set) the rollouts run on the seed prompt, and instead of the
adapter's batch it reports the lowest-reward transcript, as the optimiser would be shown it.

    python -m flows.dev examples/copy_task/demo.yaml [--set batch_size=4]
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger

from flows.cli import run_flow_cli
from flows.params import flow_prologue, flow_run_name
from flows.rollouts import collect_rollouts, ids_argument
from lightning import apo
from lightning.config import TrainConfig
from lightning.diagnose import agent_errors
from lightning.stages import NoTrainingRows
from tasks import adapt_spans, open_run, timed


@flow(name="dev", flow_run_name=flow_run_name("-dev"))
async def dev(config: TrainConfig = TrainConfig(), overrides: dict[str, Any] | None = None) -> dict[str, Any]:  # noqa: B008
    """One batch of rollouts on the run's current weights, adapted to a training batch; nothing is trained.

    Args:
        config: The run to dry-run (its agent, dataset, model and sizes).
        overrides: Dotted fields of `config` changed for this run only, e.g. {"batch_size": 4}.
    """
    config = await flow_prologue(config, overrides)
    iteration = int(time.time())  # each dry run enqueues fresh rollouts
    run = await timed(open_run, config)(config, train=False, queue=f"{config.run_name}.dev")
    try:
        rollout_ids, rollouts = await collect_rollouts(run, iteration, "train")
        errors = await agent_errors(run.store, rollout_ids) if rollouts["failed"] else []
        if config.apo is not None:  # prompt optimisation trains no weights: it reads rewards and transcripts
            worst = await apo.lowest_reward_transcripts(run, rollout_ids, 1)
        else:
            try:
                batch = await timed(adapt_spans, run)(run, iteration, ids_argument(run, rollout_ids))
            except NoTrainingRows as exc:  # the dry run's finding, not its failure: `train` raises it
                batch = {"rows": 0, "batch_path": None, "no_training_rows": str(exc)}
    finally:
        await run.close()
    logger = get_run_logger()
    if errors:
        logger.warning("dev: %d rollouts failed; the agent raised:\n  %s", rollouts["failed"], "\n  ".join(errors))
    if config.apo is not None:
        logger.info(
            "dev: %d rollouts (%d failed) on the seed prompt, reward %.3f; the lowest-reward transcript, as the "
            "optimiser would see it: %s", rollouts["rollouts"], rollouts["failed"], rollouts["reward_mean"], worst,
        )  # fmt: skip
        return {"rollouts": rollouts, "lowest_reward": worst, "agent_errors": errors}
    if not batch["rows"]:
        logger.warning(
            "dev: %d rollouts (%d failed), reward %.3f, and no training batch: %s",
            rollouts["rollouts"], rollouts["failed"], rollouts["reward_mean"], batch["no_training_rows"],
        )  # fmt: skip
        return {"rollouts": rollouts, "batch": batch, "agent_errors": errors}
    logger.info(
        "dev: %d rollouts (%d failed), reward %.3f, %d training rows; adapter: %s",
        rollouts["rollouts"], rollouts["failed"], rollouts["reward_mean"], batch["rows"], batch["adapter"],
    )  # fmt: skip
    return {"rollouts": rollouts, "batch": batch, "agent_errors": errors}


def main(argv: list[str] | None = None) -> None:
    run_flow_cli(dev, argv, description=__doc__)


if __name__ == "__main__":
    main()
