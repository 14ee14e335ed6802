"""The steps of prompt optimisation (`lightning.apo`) as Prefect tasks, declared like the training stages
(tasks/stages.py): results persisted as JSON under the (flow run, queue, round, step) cache key, so a retried
`optimize_prompt` run gets every finished step back Cached (the optimiser's critiques and edits included: a retry
never asks the model again for what it already answered), and retries with backoff on what can fail transiently:
the store, and the optimiser's calls (rate limits, timeouts, a provider's 5xx). Not cached: `publish_candidates`,
which points the candidates' resources at this process's proxy. The rollouts themselves are the training stages'
tasks (`run_runner`, `wait_for_rollouts`)."""

from __future__ import annotations

import asyncio
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from lightning import apo
from lightning.apo import Candidate
from lightning.run import Run
from lightning.stages import Mode
from tasks.stages import MARGIN_SECONDS, STAGE, TRANSIENT, drill

OPTIMIZER_CALL = {
    "retries": 3,
    "retry_delay_seconds": [5, 30, 120],
    "retry_jitter_factor": 0.5,
    "timeout_seconds": 3 * apo.OPTIMIZER_TIMEOUT + MARGIN_SECONDS,
}
"""The optimiser's calls: LiteLLM retries twice within a call, Prefect three more times with a longer backoff."""
QUICK = {"timeout_seconds": 600 + MARGIN_SECONDS}


@task(
    name="publish_candidates", task_run_name="publish_candidates-{mode}-{iteration}", cache_policy=NO_CACHE,
    **TRANSIENT, **QUICK,
)  # fmt: skip
async def publish_candidates(run: Run, iteration: int, candidates: list[Candidate], mode: Mode) -> dict[str, str]:
    drill(run, "publish_candidates", iteration)
    return await apo.publish_candidates(run, candidates, mode)


@task(name="enqueue_candidates", task_run_name="enqueue_candidates-{mode}-{iteration}", **STAGE, **TRANSIENT, **QUICK)
async def enqueue_candidates(run: Run, iteration: int, resources: dict[str, str], mode: Mode) -> dict[str, list[str]]:
    drill(run, "enqueue_candidates", iteration)
    return await apo.enqueue_candidates(run, iteration, resources, mode)


@task(name="score_candidates", task_run_name="score_candidates-{mode}-{iteration}", **STAGE, **TRANSIENT, **QUICK)
async def score_candidates(
    run: Run, iteration: int, candidates: list[Candidate], rollouts: dict[str, list[str]], mode: Mode
) -> list[Candidate]:
    drill(run, "score_candidates", iteration)
    return await apo.score_candidates(run, candidates, rollouts, mode)


@task(name="critique", task_run_name="critique-{iteration}-{candidate.id}", **STAGE, **OPTIMIZER_CALL)
async def critique(run: Run, iteration: int, candidate: Candidate, rollout_ids: list[str]) -> str:
    drill(run, "critique", iteration)
    return await apo.critique(run, candidate, rollout_ids)


@task(name="propose_edit", task_run_name="propose_edit-{iteration}-{parent.id}-{variant}", **STAGE, **OPTIMIZER_CALL)
async def propose_edit(run: Run, iteration: int, parent: Candidate, critique: str, variant: int) -> Candidate | None:
    drill(run, "propose_edit", iteration)
    return await apo.propose_edit(run, iteration, parent, critique, variant)


@task(name="select_beam", task_run_name="select_beam-{iteration}", **STAGE, **QUICK)
async def select_beam(run: Run, iteration: int, candidates: list[Candidate]) -> list[Candidate]:
    drill(run, "select_beam", iteration)
    return apo.select_beam(candidates, apo.apo_config(run.config).beam_width)


@task(name="log_round", task_run_name="log_round-{iteration}", **STAGE, **TRANSIENT, **QUICK)
async def log_round(run: Run, iteration: int, scored: list[Candidate], beam: list[Candidate]) -> dict[str, Any]:
    drill(run, "log_round", iteration)
    return await asyncio.to_thread(apo.log_round, run, iteration, scored, beam)


@task(name="register_prompt", task_run_name="register_prompt", **STAGE, **TRANSIENT, **QUICK)
async def register_prompt(run: Run, best: Candidate) -> dict[str, Any]:
    drill(run, "register_prompt", 0)
    return await asyncio.to_thread(apo.register_prompt, run, best)
