"""`optimize_prompt`: automatic prompt optimisation (APO, `lightning.apo`) of the run's prompt template, as
`apo.beam_rounds` subflows `apo_round`, each the five steps as tasks:

    evaluate the beam on a training batch (publish_candidates -> enqueue_candidates -> run_runner x n_runners ->
    wait_for_rollouts -> score_candidates) -> critique (one per prompt of the beam) -> propose_edit (branch_factor
    per prompt) -> evaluate the new candidates on the validation batch -> select_beam -> log_round

then the best prompt is registered in MLflow's prompt registry. No GPU and no training: the agent's model is the
run's inference backend behind its proxy (embedded, vLLM or an external endpoint), the optimiser any LiteLLM model.

    python -m flows.optimize_prompt examples/room_booking/apo.yaml [--set apo.beam_rounds=2]
"""

from __future__ import annotations

import asyncio
import textwrap
import time
from typing import Any
from uuid import UUID

from prefect import flow, get_run_logger, unmapped
from prefect.artifacts import acreate_markdown_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from flows.artifacts import artifact_key, publish_table
from flows.cli import run_flow_cli
from flows.params import flow_prologue, flow_run_name
from flows.rollouts import run_rollouts, task_runner
from lightning import apo, reporting
from lightning.apo import Candidate
from lightning.config import TrainConfig
from lightning.run import Run
from lightning.stages import Mode
from tasks import open_run, timed
from tasks.apo import (
    critique,
    enqueue_candidates,
    log_round,
    propose_edit,
    publish_candidates,
    register_prompt,
    score_candidates,
    select_beam,
)


async def evaluate_candidates(run: Run, iteration: int, candidates: list[Candidate], mode: Mode) -> dict[str, Any]:
    """Steps 1 and 4: each candidate's rollouts on the mode's batch through the store, the runners and the proxy;
    the candidates scored and their rollout ids."""
    if not candidates:
        return {"candidates": [], "rollouts": {}}
    resources = await publish_candidates(run, iteration, candidates, mode)
    rollouts = await enqueue_candidates(run, iteration, resources, mode)
    await run_rollouts(run, iteration, [rollout_id for ids in rollouts.values() for rollout_id in ids], mode)
    return {"candidates": await score_candidates(run, iteration, candidates, rollouts, mode), "rollouts": rollouts}


@flow(name="apo_round", flow_run_name="{run.name}-apo-round-{iteration}", task_runner=ThreadPoolTaskRunner())
async def apo_round(run: Run, iteration: int, beam: list[Candidate]) -> dict[str, Any]:
    """One round: the beam on a training batch -> a critique of each prompt's low-reward transcripts -> edited
    prompts -> the new ones scored on the validation batch -> the best `beam_width` kept."""
    settings = apo.apo_config(run.config)
    trained = await evaluate_candidates(run, iteration, beam, "train")  # 1
    beam = trained["candidates"]
    critiques = critique.map(unmapped(run), unmapped(iteration), beam, [trained["rollouts"][c.id] for c in beam])  # 2
    gradients = await asyncio.to_thread(lambda: [future.result() for future in critiques])
    variants = range(1, settings.branch_factor + 1)
    branches = [(parent, gradient, v) for parent, gradient in zip(beam, gradients, strict=True) for v in variants]
    parents, texts, numbers = (list(column) for column in zip(*branches, strict=True))
    edits = propose_edit.map(unmapped(run), unmapped(iteration), parents, texts, numbers)  # 3
    proposed = await asyncio.to_thread(lambda: [future.result() for future in edits])
    everyone = [*beam, *apo.new_candidates(beam, proposed)]
    unscored = [each for each in everyone if each.val_reward is None]
    validated = await evaluate_candidates(run, iteration, unscored, "val")  # 4
    everyone = apo.with_scores(everyone, validated["candidates"])
    new_beam = await select_beam(run, iteration, everyone)  # 5
    metrics = await log_round(run, iteration, everyone, new_beam)
    get_run_logger().info(
        "round %d: %d candidates, validation reward best %.3f, mean %.3f; best prompt %s",
        iteration, len(everyone), metrics["val_reward_best"], metrics["val_reward_mean"], new_beam[0].id,
    )  # fmt: skip
    return {"beam": new_beam, "scored": everyone, "critiques": dict(zip([c.id for c in beam], gradients, strict=True))}


@flow(name="optimize_prompt", flow_run_name=flow_run_name("-apo"))
async def optimize_prompt(
    config: TrainConfig = TrainConfig(),  # noqa: B008 (the UI's form default)
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Optimise the prompt template `config.apo` seeds against the agent's rewards; register the best in MLflow.

    Args:
        config: The run: agent, datasets, the agent's model (`inference`), the `apo` section (seed prompt,
            optimiser models, beam sizes), where results go (a deployment's is its default).
        overrides: Dotted fields of `config` changed for this run only, e.g. {"apo.beam_rounds": 2}.
    """
    config = await flow_prologue(config, overrides)
    settings = apo.apo_config(config)  # a bad apo section fails here, before anything starts
    logger = get_run_logger()
    run = await timed(open_run, config)(config, train=False, queue=f"{config.run_name}.apo", track=True)
    status = "FAILED"
    try:
        started = time.perf_counter()
        seed = apo.seed_candidate(config)
        beam, rows = [seed], []
        table_id = None
        round_flow = apo_round.with_options(task_runner=task_runner(config))
        for iteration in range(settings.beam_rounds):
            result = await round_flow(run, iteration, beam)
            beam = result["beam"]
            if iteration == 0:
                seed = next(each for each in result["scored"] if each.id == seed.id)
            rows += _rows(iteration, result["scored"], beam)
            table_id = await _publish(run, rows, table_id)
        best = beam[0]
        registered = await register_prompt(run, best)
        status = "FINISHED"
        summary = {
            "run_name": run.name,
            "rounds": settings.beam_rounds,
            "reward_seed": seed.val_reward,
            "reward_best": best.val_reward,
            "best_prompt": best.template,
            "prompt_uri": registered["uri"],
            "candidates": len({row["candidate"] for row in rows}),
            "seconds": round(time.perf_counter() - started, 1),
            "mlflow_run_id": run.tracker.run_id,
            "tracking_uri": config.tracking_uri,
        }
        logger.info(
            "validation reward %.3f (seed) -> %.3f (best, %s); registered as %s",
            seed.val_reward, best.val_reward, best.id, registered["uri"],
        )  # fmt: skip
        await acreate_markdown_artifact(
            _summary_markdown(run, summary), key=artifact_key(run, "apo-summary"),
            description=f"How {run.name}'s APO went",
        )  # fmt: skip
        return summary
    finally:
        await run.close(status)


def _rows(iteration: int, scored: list[Candidate], beam: list[Candidate]) -> list[dict[str, Any]]:
    kept = {each.id for each in beam}
    return [
        {
            "round": iteration,
            "candidate": each.id,
            "parent": each.parent or "",
            "train_reward": _cell(each.train_reward),
            "val_reward": _cell(each.val_reward),
            "kept": each.id in kept,
            "prompt": _prompt_cell(each.template),
        }
        for each in scored
    ]


async def _publish(run: Run, rows: list[dict[str, Any]], table_id: UUID | None) -> UUID:
    """The table of every round's candidates and scores, updated in place each round."""
    description = f"APO candidates of {run.name} by round. {reporting.mlflow_link(run)}"
    return await publish_table(artifact_key(run, "apo"), rows, description, table_id)


PROMPT_CELL_CHARS = 100
"""A prompt's beginning in the candidates table; the whole text is in MLflow (`apo/round-NN/`)."""
CODE_WIDTH = 100
"""Characters a line of the summary's code block holds (a longer one would widen the page)."""


def _prompt_cell(template: str) -> str:
    """The beginning of a prompt as one table cell: one line, no backticks (Prefect renders cells as Markdown, and a
    cut left one unbalanced), cut on a word boundary."""
    text = " ".join(template.replace("`", "'").split())
    if len(text) <= PROMPT_CELL_CHARS:
        return text
    return text[: PROMPT_CELL_CHARS - 1].rsplit(" ", 1)[0] + " …"


def _summary_markdown(run: Run, summary: dict[str, Any]) -> str:
    best = "\n".join(
        textwrap.fill(line, CODE_WIDTH, break_on_hyphens=False) if line else line
        for line in summary["best_prompt"].replace("```", "'''").splitlines()
    )
    return (
        f"## {run.name}: prompt optimisation, {summary['rounds']} rounds\n\n| validation reward | |\n|---|---|\n"
        f"| seed prompt | {_cell(summary['reward_seed'])} |\n| best prompt | {_cell(summary['reward_best'])} |\n\n"
        f"Best prompt, registered as `{summary['prompt_uri']}`:\n\n```\n{best}\n```\n\n{reporting.mlflow_link(run)}\n"
    )


def _cell(value: float | None) -> float | None:
    return None if value is None or value != value else round(value, 4)


def main(argv: list[str] | None = None) -> None:
    run_flow_cli(optimize_prompt, argv, description=__doc__)


if __name__ == "__main__":
    main()
