"""The stages of a training run, each a plain function of the open `Run` (lightning/run.py): what the Prefect
tasks in `tasks/` wrap, one call each, and what scripts and benchmarks call directly. Around them, in rooms of their
own: the runners' fleet (`lightning.runner.fleet`), the asynchronous pipeline of iterations in flight
(`lightning.pipeline`) and what a run reports (`lightning.reporting`).

    one iteration    update_resources -> enqueue_rollouts -> run_runners (x n_runners) -> wait_for_rollouts
                     -> adapt_spans -> ppo_step -> checkpoint
    an evaluation    update_resources -> enqueue_rollouts -> run_runners -> wait_for_rollouts -> log_evaluation

The first four are the rollout phase, the same for training, evaluation and `dev` (`collect_rollouts` runs them in
a row). Stages pass ids, paths and small JSON between them; everything else lives in the store and in the run
directory. Each is idempotent: enqueuing an iteration again returns the rollouts enqueued the first time (the
store's idempotency keys), a checkpoint is saved atomically, metrics already in MLflow are not logged twice.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning import stopping
from lightning.config import load_agent, load_entry_point
from lightning.pipeline import drop_stale
from lightning.reporting import busy_seconds, no_rows_reason, rollouts_failed_reason, warm_start_line
from lightning.run import STOPPED, Run
from lightning.runner.fleet import run_fleet_until, wait_unless_stopped
from lightning.seeding import rollout_seed
from lightning.store.base import LightningStore
from lightning.types import AttemptedRollout, EnqueueRolloutRequest, PromptTemplate, ProxyLLM, Triplet

logger = logging.getLogger(__name__)

Mode = Literal["train", "val"]


class RolloutsFailed(RuntimeError):
    """Too few of an iteration's rollouts succeeded, even after running the others again."""


class NoTrainingRows(RuntimeError):
    """An iteration's rollouts left nothing to train on (no reward, no LLM call through the run, prompts too long)."""


# --- the rollout phase ------------------------------------------------------------------------------------


async def update_resources(run: Run, mode: Mode = "train") -> str:
    """Point the run's LLM resource for `mode` at this process's proxy, with the mode's sampling parameters, beside
    the config's `resources` (and, with `apo` set, the seed prompt); its id (the same for every iteration of the
    run: rollouts of an earlier process of the run reach this proxy too)."""
    stopping.check(f"update_resources ({mode})")
    run.check_serving()
    config = run.config
    prompt = {config.apo.resource_name: config.apo.seed()} if config.apo is not None else {}
    resources = await run.store.update_resources(run.resources_id(mode), run_resources(run, mode, prompt))
    run.made_progress(f"update_resources ({mode})")
    return resources.resources_id


def run_resources(run: Run, mode: Mode, prompt: dict[str, PromptTemplate]) -> dict[str, Any]:
    """The rollouts' resources: the run's LLM first (agents that take "the first LLM" get it), the config's
    `resources`, then `prompt` (the seed or candidate prompt of prompt optimisation)."""
    config = run.config
    return {config.llm_resource_name: run_llm(run, mode), **config.resources, **prompt}


def run_llm(run: Run, mode: Mode) -> ProxyLLM:
    """The run's LLM resource for `mode`: this process's proxy, with the mode's sampling parameters."""
    return run.llm(mode)


def select_tasks(run: Run, iteration: int, refill: int = 0, count: int | None = None) -> list[Any]:
    """The iteration's `batch_size` training tasks: epochs over the shuffled dataset, reproducible by seed, so a
    resumed or retried iteration asks for the same tasks (and the store returns the same rollouts). A refill of
    dynamic sampling (`refill` >= 1) draws `count` more, at random but reproducibly, from the whole dataset."""
    config = run.config
    tasks = run.dataset("train_data")
    if refill:
        rng = random.Random(f"{config.seed}/{iteration}/refill/{refill}")
        wanted, indices = count or config.batch_size, range(len(tasks))
        picks = rng.sample(indices, wanted) if wanted <= len(tasks) else rng.choices(indices, k=wanted)
        return [tasks[index] for index in picks]
    chosen, orders = [], {}
    for position in range(iteration * config.batch_size, (iteration + 1) * config.batch_size):
        epoch, index = divmod(position, len(tasks))
        if epoch not in orders:  # each epoch's order, shuffled once
            orders[epoch] = list(range(len(tasks)))
            random.Random(f"{config.seed}/{epoch}").shuffle(orders[epoch])
        chosen.append(tasks[orders[epoch][index]])
    return chosen


def group_id(queue: str, mode: str, iteration: int, task_index: int) -> str:
    """The samples of one task in one iteration form a group (group-relative advantages)."""
    return f"{queue}/{mode}/{iteration}/{task_index}"


async def enqueue_rollouts(
    run: Run, iteration: int, resources_id: str, mode: Mode = "train", refill: int = 0, count: int | None = None
) -> list[str]:
    """Enqueue the iteration's rollouts in the run's queue (train: `samples_per_task` of each selected task; val:
    one of each held-out task); their ids. Each carries its sampling seed (`lightning.seeding`) in its metadata.
    `refill` >= 1: `count` more tasks for dynamic sampling (at most `batch_size * max_sampling_rounds`), their task
    indices apart from the batch's and other refills'. Enqueued before (a retry, a resume): the same rollouts."""
    stopping.check(f"enqueue_rollouts ({mode} {iteration})")
    config = run.config
    tasks = select_tasks(run, iteration, refill, count) if mode == "train" else run.dataset("val_data")
    samples = config.samples_per_task if mode == "train" else 1
    first = refill * config.batch_size * (config.max_sampling_rounds + 1)  # past every earlier refill's indices
    requests = []
    for task_index, task in enumerate(tasks, start=first):
        group = group_id(run.queue, mode, iteration, task_index)
        metadata = {"run_name": run.name, "iteration": iteration, "task_index": task_index, "group_id": group}
        for sample in range(samples):
            seed = rollout_seed(config.seed, mode, iteration, task_index, sample)
            requests.append(
                EnqueueRolloutRequest(
                    input=task,
                    mode=mode,
                    resources_id=resources_id,
                    config=config.rollout,
                    metadata={**metadata, "sample": sample, "seed": seed},
                    idempotency_key=f"{group}/{sample}",
                    queue=run.queue,
                )  # fmt: skip
            )
    enqueued = [rollout.rollout_id for rollout in await run.store.enqueue_many_rollouts(requests)]
    run.made_progress(f"enqueue_rollouts ({mode} {iteration})")
    return enqueued


def rollout_deadline(run: Run, mode: Mode) -> float:
    """Seconds the rollout phase may take: `timeouts.rollouts` in training, `timeouts.evaluate` in evaluation."""
    return run.config.timeouts.evaluate if mode == "val" else run.config.timeouts.rollouts


async def run_runners(run: Run, rollout_ids: Sequence[str], index: int = 0, mode: Mode = "train") -> dict[str, Any]:
    """One runner task: `runner_concurrency` runners claim rollouts of the run's queue until every one of
    `rollout_ids` has finished, or the phase's deadline passes (`lightning.runner.fleet.run_fleet_until`). They run on
    an event loop of their own (a thread of this process, watched for an agent that blocks it), or, with task_runner
    `processes`, in a runner process of the open run
    (`lightning.runner.processes`); in a process the run was sent to (a Ray worker), here with a store connection of
    its own."""
    started = time.perf_counter()
    config = run.config
    if await _all_finished(run, rollout_ids):
        # Nothing of its own left to run (a phase summarised again on resume): a fleet would only claim the queue's
        # other rollouts, another phase's (the requeued training rollouts, under a resumed run's first evaluation).
        return {"runner": index, "ran": 0, "finished": len(set(rollout_ids)), "seconds": time.perf_counter() - started}
    # Where the run is not open (a Ray worker) this does nothing: the flow's process sees the stages finish.
    progress = lambda: run.made_progress("a rollout")  # noqa: E731
    if config.task_runner == "processes" and run.is_open:
        done = await run.runner_processes().run_fleet(
            rollout_ids, index, timeout=rollout_deadline(run, mode), blocked_after=config.timeouts.blocked_loop,
            on_progress=progress,
        )  # fmt: skip
    else:
        async with run.connect_store() as store:
            done = await run_fleet_until(
                load_agent(config.agent), store, rollout_ids, queue=run.queue, concurrency=config.runner_concurrency,
                index=index, timeout=rollout_deadline(run, mode), blocked_after=config.timeouts.blocked_loop,
                on_rollout_end=progress,
            )  # fmt: skip
    return {**done, "seconds": time.perf_counter() - started}


async def _all_finished(run: Run, rollout_ids: Sequence[str]) -> bool:
    """Every one of the rollouts has finished already (succeeded, failed or cancelled)."""
    async with run.connect_store() as store:
        finished = await store.wait_for_rollouts(rollout_ids=list(rollout_ids), timeout=0.0)
    return len({rollout.rollout_id for rollout in finished}) >= len(set(rollout_ids))


async def cancel_for_stop(run: Run) -> int:
    """A run that stops: every unfinished rollout of its queue is cancelled in the store (marked `stopped`, so the
    run's next process requeues it: `lightning.run.requeue_orphans`) and its attempt in flight ended, so nothing
    runs them meanwhile and their time stops counting. How many."""
    unfinished = await run.store.query_rollouts(
        queue=run.queue, status_in=["queuing", "requeuing", "preparing", "running"]
    )
    for rollout in unfinished:
        await run.store.update_rollout(
            rollout.rollout_id, status="cancelled", metadata={**(rollout.metadata or {}), STOPPED: True}
        )
        if isinstance(rollout, AttemptedRollout) and rollout.attempt.status in ("preparing", "running"):
            await run.store.update_attempt(rollout.rollout_id, "latest", status="failed")
    return len(unfinished)


async def wait_for_rollouts(run: Run, rollout_ids: Sequence[str], mode: Mode = "train") -> dict[str, Any]:
    """Wait until the rollouts finish (at most the phase's deadline); those still unfinished then are cancelled, so
    no later stage's runners pick them up. Their counts and mean reward."""
    deadline = rollout_deadline(run, mode)
    finished = await wait_unless_stopped(run.store, rollout_ids, deadline)
    if stopping.stop_requested() and len(finished) < len(set(rollout_ids)):
        raise stopping.RunStopped(f"stopped waiting for the rollouts ({mode}) with {len(finished)} finished")
    done = set(finished)
    leftovers = [rollout_id for rollout_id in rollout_ids if rollout_id not in done]
    for rollout_id in leftovers:
        await run.store.update_rollout(rollout_id, status="cancelled")
    if leftovers:
        logger.warning(
            "%d of %d rollouts unfinished after %.0f s; cancelled", len(leftovers), len(rollout_ids), deadline
        )
    run.made_progress(f"wait_for_rollouts ({mode})")
    return {**await summarize_rollouts(run.store, rollout_ids), "cancelled": len(leftovers)}


async def summarize_rollouts(store: LightningStore, rollout_ids: Sequence[str]) -> dict[str, Any]:
    """Counts by status, the mean final reward of the rollouts that have one, and the groups (rollouts of one task,
    `metadata.group_id`) whose rewards differ: only those carry a group-relative advantage."""
    from lightning.tracing import find_final_reward

    rollouts = await store.query_rollouts(rollout_id_in=list(rollout_ids))
    statuses = [rollout.status for rollout in rollouts]
    by_rollout: dict[str, float] = {}
    for start in range(0, len(rollout_ids), 256):  # the latest attempts' spans, one request per 256 rollouts
        chunk = list(rollout_ids[start : start + 256])
        for rollout_id, spans in (await store.query_latest_spans(chunk, rewards_only=True)).items():
            reward = find_final_reward(spans)
            if reward is not None:
                by_rollout[rollout_id] = reward
    rewards = list(by_rollout.values())
    groups: dict[str, list[float]] = {}
    for rollout in rollouts:
        group = (rollout.metadata or {}).get("group_id")
        if group is not None and rollout.rollout_id in by_rollout:
            groups.setdefault(group, []).append(by_rollout[rollout.rollout_id])
    several = {group: values for group, values in groups.items() if len(values) > 1}  # evaluations have none
    flat = flat_groups(several)
    # The time some attempt of these rollouts was running, by the store's clock: the same when a retried flow run
    # gets this summary back from Prefect's cache (the rollout stages then take no time at all), and without the
    # break when a run stopped in the middle of them resumes.
    intervals = [
        (rollout.attempt.start_time, rollout.attempt.end_time)
        for rollout in rollouts
        if isinstance(rollout, AttemptedRollout) and rollout.attempt.end_time is not None
    ]
    return {
        "rollouts": len(rollout_ids),
        "succeeded": statuses.count("succeeded"),
        "failed": len(rollout_ids) - statuses.count("succeeded"),
        "with_reward": len(rewards),
        "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        **({"groups": len(several), "informative_groups": len(several) - len(flat)} if several else {}),
        **({"flat_group_reward": sum(flat.values()) / len(flat)} if flat else {}),
        "seconds": busy_seconds(intervals) if intervals else None,
    }


def flat_groups(rewards: dict[str, list[float]]) -> dict[str, float]:
    """The groups of two or more rollouts whose rewards are all equal, with that reward: their group-relative
    advantages are all 0, so they teach nothing (a rising share of them shows a plateau coming)."""
    return {group: values[0] for group, values in rewards.items() if len(values) > 1 and len(set(values)) == 1}


def enough_succeeded(run: Run, summary: dict[str, Any]) -> bool:
    """At least `min_success_fraction` of the rollouts succeeded."""
    return summary["succeeded"] >= run.config.min_success_fraction * summary["rollouts"]


async def requeue_unsuccessful(run: Run, rollout_ids: Sequence[str]) -> int:
    """Put the rollouts that failed or were cancelled back in the run's queue for another round of runners; how
    many. First the run's serving processes must answer again (a dead one is being restarted): a run whose
    inference server or proxy is past its restarts fails here, naming it."""
    stopping.check("running failed rollouts again")
    await run.serving_answers(timeout=run.config.timeouts.startup)
    again = await run.store.query_rollouts(rollout_id_in=list(rollout_ids), status_in=["failed", "cancelled"])
    for rollout in again:
        await run.store.update_rollout(rollout.rollout_id, status="requeuing")
    logger.warning("running %d of %d rollouts again", len(again), len(rollout_ids))
    return len(again)


@dataclass(frozen=True)
class RolloutSteps:
    """The rollout phase's steps, each (run, iteration, ..., mode[, round]): the plain calls of this module
    (`PLAIN`), or the same calls as Prefect tasks (flows/rollouts.py). The loop over them is written once
    (`collect_rollouts`, `run_rollouts`); `round_` counts the rounds of running failed rollouts again and `refill`
    the batches dynamic sampling adds, so that a task's cache key tells them apart."""

    update_resources: Callable[[Run, int, Mode], Awaitable[str]]
    enqueue_rollouts: Callable[[Run, int, str, Mode, int, int | None], Awaitable[list[str]]]
    run_runners: Callable[[Run, int, list[str], Mode, int], Awaitable[Any]]
    """Every runner of the run (`n_runners`) on the rollouts, until they finish or the phase's deadline."""
    wait_for_rollouts: Callable[[Run, int, list[str], Mode, int], Awaitable[dict[str, Any]]]
    requeue_unsuccessful: Callable[[Run, int, list[str], Mode, int], Awaitable[int]]


async def _all_runners(run: Run, iteration: int, rollout_ids: list[str], mode: Mode, round_: int) -> None:
    await asyncio.gather(*(run_runners(run, rollout_ids, index, mode) for index in range(run.config.n_runners)))


PLAIN = RolloutSteps(
    update_resources=lambda run, iteration, mode: update_resources(run, mode),
    enqueue_rollouts=enqueue_rollouts,
    run_runners=_all_runners,
    wait_for_rollouts=lambda run, iteration, rollout_ids, mode, round_: wait_for_rollouts(run, rollout_ids, mode),
    requeue_unsuccessful=lambda run, iteration, rollout_ids, mode, round_: requeue_unsuccessful(run, rollout_ids),
)


async def collect_rollouts(
    run: Run, iteration: int, mode: Mode = "train", steps: RolloutSteps = PLAIN
) -> tuple[list[str], dict[str, Any]]:
    """The iteration's rollouts (for evaluation, `iteration` is the checkpoint step evaluated), run by the run's
    runners; their ids and summary (counts, mean reward, groups).

    With `dynamic_sampling` (training only), groups whose rewards are all equal teach nothing: while fewer than
    `batch_size` groups differ, more tasks run (`max_sampling_rounds` refills at most, each as many tasks as the
    share of informative groups so far says are needed, `batch_size * max_sampling_rounds` tasks in all; the first
    runs with the batch, sized by an earlier iteration's share: `refill_ahead`); `adapt_spans` keeps the
    informative groups (DAPO's dynamic sampling, https://arxiv.org/abs/2503.14476)."""
    config = run.config
    resources_id = await steps.update_resources(run, iteration, mode)
    rollout_ids = await steps.enqueue_rollouts(run, iteration, resources_id, mode, 0, None)
    refills, budget = 0, config.batch_size * config.max_sampling_rounds  # tasks the refills may add, all together
    dynamic = mode == "train" and config.dynamic_sampling
    ahead = refill_ahead(run, iteration, budget) if dynamic else 0
    if ahead:  # the first refill runs with the batch, in the same round
        refills, budget = 1, budget - ahead
        rollout_ids = rollout_ids + await steps.enqueue_rollouts(run, iteration, resources_id, mode, 1, ahead)
    summary = await run_rollouts(run, iteration, rollout_ids, mode, steps)
    if dynamic:
        informative, groups = summary.get("informative_groups", 0), summary.get("groups", 0)
        while informative < config.batch_size and refills < config.max_sampling_rounds and budget > 0:
            refills += 1
            count = min(budget, math.ceil((config.batch_size - informative) * groups / max(informative, 1)))
            more = await steps.enqueue_rollouts(run, iteration, resources_id, mode, refills, count)
            added = await run_rollouts(run, iteration, more, mode, steps)
            informative, groups = informative + added.get("informative_groups", 0), groups + added.get("groups", 0)
            rollout_ids, budget = rollout_ids + more, budget - count
    if refills:
        summary = {**await summarize_rollouts(run.store, rollout_ids), "refills": refills}
    if mode == "train":
        run.note_iteration(iteration, "collected")
    return rollout_ids, summary


def refill_ahead(run: Run, iteration: int, budget: int) -> int:
    """Dynamic sampling's first refill, sized before the batch runs, so that the two run as one round: the tasks
    that the share of informative groups in iteration `iteration - 1 - max_staleness` says the batch will lack (the
    latest iteration sure to be recorded when this one's rollouts start, so a retried or resumed iteration sizes it
    the same); none before that iteration. A round costs a fan-out of runner tasks and a wait: one round instead of
    two (measured with the engine's batched draw) took 0.45 s off a 3.4 s demo iteration. Where the share has
    fallen since, the refills after it make up the rest."""
    config = run.config
    source = iteration - 1 - config.algorithm.max_staleness
    flat = next((row.get("zero_adv_groups") for row in run.history if row["iteration"] == source), None)
    if flat is None:
        return 0
    share = 1.0 - flat
    wanted = budget if share <= 0 else math.ceil(config.batch_size * (1 - share) / share - 1e-9)
    return max(0, min(budget, wanted))


async def run_rollouts(
    run: Run, iteration: int, rollout_ids: list[str], mode: Mode, steps: RolloutSteps = PLAIN
) -> dict[str, Any]:
    """Enqueued rollouts run by the runners, then waited for; their summary. When fewer than
    `min_success_fraction` succeeded, the others run again (`rollout_retries` rounds) before the phase fails."""
    for round_ in range(run.config.rollout_retries + 1):
        await steps.run_runners(run, iteration, rollout_ids, mode, round_)
        summary = await steps.wait_for_rollouts(run, iteration, rollout_ids, mode, round_)
        if enough_succeeded(run, summary):
            return summary
        if round_ < run.config.rollout_retries:
            await steps.requeue_unsuccessful(run, iteration, rollout_ids, mode, round_)
    raise RolloutsFailed(await rollouts_failed_reason(run, iteration, rollout_ids, summary, mode))


# --- training ---------------------------------------------------------------------------------------------


async def adapt_spans(run: Run, iteration: int, rollout_ids: Sequence[str]) -> dict[str, Any]:
    """The rollouts' spans -> triplets -> a TrainingBatch file; its path, rows and what the adapter dropped (and by
    which rule)."""
    from lightning.adapter import adapt_rollouts
    from lightning.algorithm.batch import TrainingBatch

    stopping.check(f"adapt_spans ({iteration})")
    config = run.config
    adapted = await adapt_rollouts(run.store, list(rollout_ids), shape=config.adapter_shape)
    triplets, dropped_groups, staleness = adapted.triplets, 0, {}
    if config.algorithm.max_staleness:
        corrected = config.algorithm.off_policy_correction != "none"
        triplets, staleness = drop_stale(triplets, iteration, config.algorithm.max_staleness, corrected)
    if config.dynamic_sampling:
        triplets, dropped_groups = informative_groups(triplets, config.batch_size, config.failed_groups_kept)
    try:
        batch = TrainingBatch.from_triplets(
            triplets, pad_token_id=run.tokenizer().pad_token_id, max_prompt_length=config.max_prompt_length,
            max_response_length=config.max_response_length,
        )  # fmt: skip
    except ValueError as exc:  # not one row: say why, from what the adapter and the batch dropped
        reason = no_rows_reason(run, iteration, len(rollout_ids), adapted.report, str(exc), staleness)
        raise NoTrainingRows(reason) from None
    path = run.run_dir / "batches" / f"iteration-{iteration:06d}"
    path.parent.mkdir(parents=True, exist_ok=True)
    batch.save(path)
    await export_traces_later(run, rollout_ids, config.mlflow_traces.train_per_iteration)
    run.made_progress(f"adapt_spans ({iteration})")
    return {
        "batch_path": str(path),
        "rows": len(batch),
        "adapter": adapted.report.model_dump(),
        "batch": batch.report(),
        "dropped_flat_groups": dropped_groups,
        **staleness,
    }


def informative_groups(triplets: Sequence[Triplet], limit: int, failed: int = 0) -> tuple[list[Triplet], int]:
    """Dynamic sampling's filter: the triplets of the first `limit` groups whose rollouts' rewards differ, and of the
    first `failed` groups whose rollouts all failed alike (equal rewards, at most 0: `keep_failed_groups`), and how
    many groups were left out (flat, or past the limits). With no informative group at all, every triplet stays:
    the update then learns nothing either way, and the iteration's metrics say why."""
    rewards: dict[str, dict[str, float]] = {}
    for triplet in triplets:
        group, rollout = triplet.metadata["group_id"], triplet.metadata["rollout_id"]
        rewards.setdefault(group, {})[rollout] = triplet.reward if triplet.reward is not None else 0.0
    flat = flat_groups({group: list(by_rollout.values()) for group, by_rollout in rewards.items()})
    kept = [group for group in rewards if group not in flat][:limit]
    if not kept:
        return list(triplets), 0
    kept += [group for group, reward in flat.items() if reward <= 0.0][:failed]
    chosen = set(kept)
    return [triplet for triplet in triplets if triplet.metadata["group_id"] in chosen], len(rewards) - len(kept)


async def ppo_step(run: Run, iteration: int, batch_path: str) -> dict[str, float]:
    """One policy update in the trainer process (or verl's workers), stopped if it passes `timeouts.ppo_step`.
    Colocated vLLM (weight_sync: sleep) releases its GPU memory first; `checkpoint` wakes it on the new weights
    (`Run.release_weights`, `Run.load_weights`)."""
    stopping.check(f"ppo_step ({iteration})")
    config = run.config
    await run.release_weights()
    metrics = await asyncio.to_thread(run.trainer.step, batch_path, timeout=config.timeouts.ppo_step)
    run.made_progress(f"ppo_step ({iteration})")
    return metrics


async def checkpoint(run: Run, iteration: int, row: dict[str, Any]) -> dict[str, Any]:
    """Save checkpoint `iteration + 1` with the run's history up to this iteration (`row` last), have the inference
    servers load it, log the iteration to MLflow."""
    config = run.config
    step = iteration + 1
    row = {**row, "restarts": run.restarts()}  # of the serving parts, so far
    history = [earlier for earlier in run.history if earlier["iteration"] < iteration] + [row]
    path = await _publish(run, step, {"run_name": run.name, "iteration": iteration, "history": history})
    run.history[:] = history
    await asyncio.to_thread(run.flush_traces)  # the iteration's traces, written meanwhile, are in MLflow now
    if run.tracker is not None:  # a run opened with track=False keeps its history in its checkpoints alone
        if config.checkpoint.log_to_mlflow and (step % config.checkpoint.log_every == 0 or step == config.iterations):
            await asyncio.to_thread(run.tracker.log_checkpoint, path, step)
        await asyncio.to_thread(run.tracker.log_metrics, row, iteration)
    run.made_progress(f"checkpoint {step}")
    return {"checkpoint": str(path), "step": step}


async def warm_start(run: Run, report: Callable[[str], None] | None = None) -> dict[str, Any]:
    """SFT on demonstrations of the first `warm_start.fraction` of the training tasks, then checkpoint step 0 (what
    iteration 0 samples from) and have the inference servers load it. `report` gets a progress line ten times over
    the steps (`warm_start.progress_line`)."""
    from lightning.algorithm.batch import TrainingBatch

    config = run.config
    assert config.warm_start is not None
    tasks = run.dataset("train_data")
    shown = tasks[: max(1, int(len(tasks) * config.warm_start.fraction))]
    demonstrate = load_entry_point(config.warm_start.demonstrations, "warm_start.demonstrations")
    batch = TrainingBatch.from_triplets(
        demonstrate(run.tokenizer(), shown), pad_token_id=run.tokenizer().pad_token_id,
        max_prompt_length=config.max_prompt_length, max_response_length=config.max_response_length,
    )  # fmt: skip
    path = run.run_dir / "batches" / "warm-start"
    batch.save(path)
    metrics: dict[str, Any] = {}
    lr = config.warm_start.lr if config.warm_start.lr is not None else config.algorithm.lr
    steps, started, step = config.warm_start.steps, time.monotonic(), 0
    size = config.warm_start.batch_size
    draw = random.Random(f"warm/{config.seed}")  # the same draws as benchmarks/lookup_lab.py's --warm-batch
    for step in range(1, steps + 1):
        step_lr = config.warm_start.step_lr(step - 1, lr)
        rows = draw.sample(range(len(batch)), size) if size is not None and size < len(batch) else None
        metrics = await asyncio.to_thread(
            run.trainer.sft_step, path, timeout=config.timeouts.ppo_step, lr=step_lr, rows=rows
        )
        run.made_progress(f"warm-start step {step}")
        fit = config.warm_start.stop_at_loss is not None and metrics["sft_loss"] <= config.warm_start.stop_at_loss
        if report is not None and (step % max(1, steps // 10) == 0 or step == steps or fit):
            line = warm_start_line(step, steps, metrics, time.monotonic() - started)
            report(f"{line} | the demonstrations are fit (stop_at_loss), stopping" if fit else line)
        if fit:
            break
    await asyncio.to_thread(run.trainer.start_rl, timeout=config.timeouts.ppo_step)
    done = {"demonstrations": len(batch), "rows_a_step": min(size or len(batch), len(batch)), "steps": step, **metrics}
    saved = await _publish(run, 0, {"run_name": run.name, "warm_start": done, "history": []})
    if run.tracker is not None:
        await asyncio.to_thread(run.tracker.log_metrics, {"warm_start": metrics}, 0)
    return {**done, "checkpoint": saved}


async def _publish(run: Run, step: int, meta: dict[str, Any]) -> str:
    """Save checkpoint `step` in the trainer, after checking its disk has room for it (`lightning.diskspace`), and
    have the run's inference servers serve it (`Run.load_weights`)."""
    from lightning.checkpoint import latest_checkpoint
    from lightning.diskspace import check_free_space, checkpoint_bytes

    config = run.config
    latest = latest_checkpoint(run.checkpoints_dir)
    needed = await asyncio.to_thread(checkpoint_bytes, latest, run.model_dir)
    await asyncio.to_thread(check_free_space, run.checkpoints_dir, needed, config.checkpoint.reserve_mb)
    path = await asyncio.to_thread(
        run.trainer.save_checkpoint, step, meta=meta, keep_last=config.checkpoint.keep_last,
        timeout=config.timeouts.checkpoint,
    )  # fmt: skip
    await run.load_weights(path, step)
    return path


async def export_traces(run: Run, rollout_ids: Sequence[str], count: int | Literal["all"]) -> list[str]:
    """`count` of the rollouts as traces of the run's MLflow run (`lightning.mlflow_traces`); the trace ids written.
    MLflow is a view: a failure is logged, and the stage goes on (the store keeps the spans)."""
    from lightning.mlflow_traces import export_rollouts

    if run.tracker is None or count == 0:
        return []
    try:
        return await export_rollouts(run.store, run.tracker, rollout_ids, count)
    except Exception:
        logger.warning("exporting %d rollouts to MLflow as traces failed", len(rollout_ids), exc_info=True)
        return []


async def export_traces_later(run: Run, rollout_ids: Sequence[str], count: int | Literal["all"]) -> int:
    """`export_traces` off the critical path: the rollouts are read from the store now, and written as MLflow traces
    by the run's background writer (`Run.trace_writer`) while the run goes on; the checkpoint stage and `Run.close`
    wait for them. How many were handed over."""
    from lightning.mlflow_traces import read_rollouts

    if run.tracker is None or count == 0:
        return 0
    try:
        records = await read_rollouts(run.store, rollout_ids, count)
        run.trace_writer.submit(records)
    except Exception:
        logger.warning("exporting %d rollouts to MLflow as traces failed", len(rollout_ids), exc_info=True)
        return 0
    return len(records)


# --- evaluation and the run's end --------------------------------------------------------------------------


async def log_evaluation(
    run: Run, step: int, summary: dict[str, Any], rollout_ids: Sequence[str] = ()
) -> dict[str, Any]:
    """Record the held-out evaluation of checkpoint `step` (-1: the model before the warm start): in MLflow as val.*
    (val_initial.* for -1) unless already there, with `mlflow_traces.evaluation` of its rollouts as traces, and as
    `val_reward` on the history row of the iteration that produced the checkpoint."""
    result = {"step": step, **summary}
    if run.tracker is not None:
        prefix = "val" if step >= 0 else "val_initial"
        if max(step, 0) not in await asyncio.to_thread(run.tracker.logged_steps, f"{prefix}.reward_mean"):
            await asyncio.to_thread(run.tracker.log_metrics, {prefix: summary}, max(step, 0))
        await export_traces(run, rollout_ids, run.config.mlflow_traces.evaluation)
    for row in run.history:
        if row["iteration"] == step - 1:
            row["val_reward"] = summary["reward_mean"]
    return result


def finish(
    run: Run, before: dict[str, Any], after: dict[str, Any], initial: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Register the final model if asked, its held-out reward as a tag and in its description; the run's summary."""
    from lightning.checkpoint import latest_checkpoint

    final = latest_checkpoint(run.checkpoints_dir)
    version = None
    if run.config.checkpoint.register_model and final is not None and run.tracker is not None:
        reward = after["reward_mean"]
        version = run.tracker.register_model(
            final, run.config.checkpoint.register_model,
            tags={"val_reward": f"{reward:.4f}", "run_name": run.name, "iterations": str(run.config.iterations)},
            description=f"{run.name} after {run.config.iterations} iterations: held-out reward {reward:.4f} "
            f"(before training {before['reward_mean']:.4f}, {after.get('rollouts', '?')} tasks)",
        )  # fmt: skip
    return {
        "run_name": run.name,
        "iterations": run.config.iterations,
        "reward_initial": (initial or before)["reward_mean"],
        "reward_before": before["reward_mean"],
        "reward_after": after["reward_mean"],
        "checkpoint": str(final) if final else None,
        "mlflow_run_id": None if run.tracker is None else run.tracker.run_id,
        "tracking_uri": run.config.tracking_uri,
        "registered_model": (
            None if version is None else {"name": run.config.checkpoint.register_model, "version": version}
        ),
    }
