"""The stages of a training run, each a plain function of the open `Run` (lightning/run.py): what the Prefect
tasks in `tasks/` wrap, one call each, and what scripts and benchmarks call directly.

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
import random
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from lightning.agent import Hook
from lightning.config import load_agent, load_entry_point
from lightning.run import Run, proxy_token
from lightning.store.base import LightningStore
from lightning.types import AttemptedRollout, EnqueueRolloutRequest, ProxyLLM

logger = logging.getLogger(__name__)

Mode = Literal["train", "val"]


class RolloutsFailed(RuntimeError):
    """Too few of an iteration's rollouts succeeded, even after running the others again."""


# --- the rollout phase ------------------------------------------------------------------------------------


async def update_resources(run: Run, mode: Mode = "train") -> str:
    """Point the run's LLM resource for `mode` at this process's proxy, with the mode's sampling parameters (and,
    with `apo` set, the seed prompt beside it); its id (the same for every iteration of the run: rollouts of an
    earlier process of the run reach this proxy too)."""
    run.check_serving()
    config = run.config
    llm = run_llm(run, mode)
    prompt = {config.apo.resource_name: config.apo.seed()} if config.apo is not None else {}
    resources = await run.store.update_resources(run.resources_id(mode), {"main_llm": llm, **prompt})
    run.made_progress(f"update_resources ({mode})")
    return resources.resources_id


def run_llm(run: Run, mode: Mode) -> ProxyLLM:
    """The run's LLM resource for `mode`: this process's proxy, with the mode's sampling parameters."""
    config = run.config
    sampling = config.eval_sampling if mode == "val" else config.sampling
    token = proxy_token() if config.proxy_endpoint else run.proxy_token
    return ProxyLLM(
        endpoint=f"{run.endpoints.proxy_url}/v1", model=run.endpoints.model_name, sampling_parameters=sampling,
        api_key=token,
    )  # fmt: skip


def select_tasks(run: Run, iteration: int) -> list[Any]:
    """The iteration's `batch_size` training tasks: epochs over the shuffled dataset, reproducible by seed, so a
    resumed or retried iteration asks for the same tasks (and the store returns the same rollouts)."""
    config = run.config
    tasks = run.dataset("train_data")
    chosen = []
    for position in range(iteration * config.batch_size, (iteration + 1) * config.batch_size):
        epoch, index = divmod(position, len(tasks))
        order = list(range(len(tasks)))
        random.Random(f"{config.seed}/{epoch}").shuffle(order)
        chosen.append(tasks[order[index]])
    return chosen


def group_id(queue: str, mode: str, iteration: int, task_index: int) -> str:
    """The samples of one task in one iteration form a group (group-relative advantages)."""
    return f"{queue}/{mode}/{iteration}/{task_index}"


async def enqueue_rollouts(run: Run, iteration: int, resources_id: str, mode: Mode = "train") -> list[str]:
    """Enqueue the iteration's rollouts in the run's queue (train: `samples_per_task` of each selected task; val:
    one of each held-out task); their ids. Enqueued before (a retry, a resume): the same rollouts."""
    config = run.config
    tasks = select_tasks(run, iteration) if mode == "train" else run.dataset("val_data")
    samples = config.samples_per_task if mode == "train" else 1
    requests = []
    for task_index, task in enumerate(tasks):
        group = group_id(run.queue, mode, iteration, task_index)
        metadata = {"run_name": run.name, "iteration": iteration, "task_index": task_index, "group_id": group}
        for sample in range(samples):
            requests.append(
                EnqueueRolloutRequest(
                    input=task,
                    mode=mode,
                    resources_id=resources_id,
                    config=config.rollout,
                    metadata=metadata,
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
    """One runner task: `runner_concurrency` runners on this event loop claim rollouts of the run's queue until
    every one of `rollout_ids` has finished, or the phase's deadline passes. Runs where the run is open, or in a
    process the run was sent to (a Ray worker), with a store connection of its own there."""
    from lightning.runner import Runner
    from lightning.runner.fleet import run_fleet
    from lightning.tracing import Tracer

    config = run.config
    started = time.perf_counter()
    agent = load_agent(config.agent)
    async with run.connect_store() as store:
        stop = asyncio.Event()
        tracer = Tracer(store)  # one exporter for the fleet, not a thread per runner
        progress = [_Progress(run)]  # each finished rollout counts against the run's stall warning
        names = [f"{run.queue}-runner{index}-{i}" for i in range(config.runner_concurrency)]
        fleet = [Runner(agent, store, tracer=tracer, worker_id=name, queue=run.queue, hooks=progress) for name in names]
        # One claim loop for the fleet (lightning.runner.fleet.run_fleet), not a poll per idle runner; its claims
        # bring the resources once.
        working = asyncio.create_task(run_fleet(fleet, store, stop_event=stop, queue=run.queue, idle_wait=0.05))
        try:
            finished = await store.wait_for_rollouts(rollout_ids=list(rollout_ids), timeout=rollout_deadline(run, mode))
        finally:
            stop.set()
            (ran,) = await asyncio.gather(working, return_exceptions=True)
            await asyncio.to_thread(tracer.shutdown)
    if isinstance(ran, BaseException):
        logger.error("runner task %d stopped early: %r", index, ran)
    return {
        "runner": index,
        "ran": ran if isinstance(ran, int) else 0,
        "finished": len(finished),
        "seconds": time.perf_counter() - started,
    }


class _Progress(Hook):
    """Each rollout a runner finishes is progress (the run's stall warning waits for none). Where the run is not
    open (a runner task on a Ray worker) it does nothing: the flow's process sees the stages finish."""

    def __init__(self, run: Run) -> None:
        self.run = run

    async def on_rollout_end(self, **_: Any) -> None:
        self.run.made_progress("a rollout")


async def wait_for_rollouts(run: Run, rollout_ids: Sequence[str], mode: Mode = "train") -> dict[str, Any]:
    """Wait until the rollouts finish (at most the phase's deadline); those still unfinished then are cancelled, so
    no later stage's runners pick them up. Their counts and mean reward."""
    deadline = rollout_deadline(run, mode)
    finished = await run.store.wait_for_rollouts(rollout_ids=list(rollout_ids), timeout=deadline)
    done = {rollout.rollout_id for rollout in finished}
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
    """Counts by status and the mean final reward of the rollouts that have one."""
    from lightning.tracing import find_final_reward

    rollouts = await store.query_rollouts(rollout_id_in=list(rollout_ids))
    statuses = [rollout.status for rollout in rollouts]
    rewards = []
    for start in range(0, len(rollout_ids), 256):  # the latest attempts' spans, one request per 256 rollouts
        chunk = list(rollout_ids[start : start + 256])
        for spans in (await store.query_latest_spans(chunk)).values():
            reward = find_final_reward(spans)
            if reward is not None:
                rewards.append(reward)
    # From the first enqueue to the last finish, by the store's clock: the same when a retried flow run gets this
    # summary back from Prefect's cache (the rollout stages then take no time at all).
    starts = [rollout.start_time for rollout in rollouts]
    ends = [rollout.end_time for rollout in rollouts if rollout.end_time is not None]
    return {
        "rollouts": len(rollout_ids),
        "succeeded": statuses.count("succeeded"),
        "failed": len(rollout_ids) - statuses.count("succeeded"),
        "with_reward": len(rewards),
        "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "seconds": max(ends) - min(starts) if starts and ends else None,
    }


def enough_succeeded(run: Run, summary: dict[str, Any]) -> bool:
    """At least `min_success_fraction` of the rollouts succeeded."""
    return summary["succeeded"] >= run.config.min_success_fraction * summary["rollouts"]


async def requeue_unsuccessful(run: Run, rollout_ids: Sequence[str]) -> int:
    """Put the rollouts that failed or were cancelled back in the run's queue for another round of runners; how
    many. First the run's serving processes must answer again (a dead one is being restarted): a run whose
    inference server or proxy is past its restarts fails here, naming it."""
    await run.serving_answers(timeout=run.config.timeouts.startup)
    again = await run.store.query_rollouts(rollout_id_in=list(rollout_ids), status_in=["failed", "cancelled"])
    for rollout in again:
        await run.store.update_rollout(rollout.rollout_id, status="requeuing")
    logger.warning("running %d of %d rollouts again", len(again), len(rollout_ids))
    return len(again)


async def rollouts_failed(run: Run, iteration: int, rollout_ids: Sequence[str], summary: dict[str, Any]) -> Exception:
    """The error of a rollout phase that stayed short of `min_success_fraction`: counts, how the attempts ended,
    and what the serving parts went through."""
    from lightning.diagnose import agent_errors

    rollouts = await run.store.query_rollouts(rollout_id_in=list(rollout_ids))
    endings = Counter(r.attempt.status if isinstance(r, AttemptedRollout) else "no attempt" for r in rollouts)
    errors = "".join(f"\n  {line}" for line in await agent_errors(run.store, rollout_ids))
    return RolloutsFailed(
        f"iteration {iteration}: {summary['succeeded']} of {summary['rollouts']} rollouts succeeded after "
        f"{run.config.rollout_retries} more round(s) for the others, short of min_success_fraction "
        f"{run.config.min_success_fraction:g}; latest attempts: {dict(endings)}; serving restarts so far: "
        f"{run.restarts()}; "
        + (f"the agent raised (the first failed rollouts; the rest in their spans):{errors}" if errors else
           "no agent error recorded (the attempts timed out or their runners went silent)")
    )  # fmt: skip


async def collect_rollouts(run: Run, iteration: int, mode: Mode = "train") -> tuple[list[str], dict[str, Any]]:
    """The rollout phase in one call (the flows run it as tasks): the rollout ids and their summary."""
    resources_id = await update_resources(run, mode)
    rollout_ids = await enqueue_rollouts(run, iteration, resources_id, mode)
    for round_ in range(run.config.rollout_retries + 1):
        await asyncio.gather(*(run_runners(run, rollout_ids, index, mode) for index in range(run.config.n_runners)))
        summary = await wait_for_rollouts(run, rollout_ids, mode)
        if enough_succeeded(run, summary):
            return rollout_ids, summary
        if round_ < run.config.rollout_retries:
            await requeue_unsuccessful(run, rollout_ids)
    raise await rollouts_failed(run, iteration, rollout_ids, summary)


# --- training ---------------------------------------------------------------------------------------------


async def adapt_spans(run: Run, iteration: int, rollout_ids: Sequence[str]) -> dict[str, Any]:
    """The rollouts' spans -> triplets -> a TrainingBatch file; its path, rows and what the adapter dropped (and by
    which rule)."""
    from lightning.adapter import adapt_rollouts
    from lightning.algorithm.batch import TrainingBatch

    config = run.config
    adapted = await adapt_rollouts(run.store, list(rollout_ids), shape=config.adapter_shape)
    batch = TrainingBatch.from_triplets(
        adapted.triplets, pad_token_id=run.tokenizer().pad_token_id, max_prompt_length=config.max_prompt_length,
        max_response_length=config.max_response_length,
    )  # fmt: skip
    path = run.run_dir / "batches" / f"iteration-{iteration:06d}"
    path.parent.mkdir(parents=True, exist_ok=True)
    batch.save(path)
    await export_traces(run, rollout_ids, config.mlflow_traces.train_per_iteration)
    run.made_progress(f"adapt_spans ({iteration})")
    return {
        "batch_path": str(path),
        "rows": len(batch),
        "adapter": adapted.report.model_dump(),
        "batch": batch.report(),
    }


async def ppo_step(run: Run, iteration: int, batch_path: str) -> dict[str, float]:
    """One policy update in the trainer process (or verl's workers), stopped if it passes `timeouts.ppo_step`.
    Colocated vLLM (weight_sync: sleep) releases its GPU memory first; `checkpoint` wakes it on the new weights
    (`Run.release_weights`, `Run.load_weights`)."""
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
    if config.checkpoint.log_to_mlflow and (step % config.checkpoint.log_every == 0 or step == config.iterations):
        await asyncio.to_thread(run.tracker.log_checkpoint, path, step)
    await asyncio.to_thread(run.tracker.log_metrics, row, iteration)
    run.made_progress(f"checkpoint {step}")
    return {"checkpoint": str(path), "step": step}


async def warm_start(run: Run) -> dict[str, Any]:
    """SFT on demonstrations of the first `warm_start.fraction` of the training tasks, then checkpoint step 0 (what
    iteration 0 samples from) and have the inference servers load it."""
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
    for step in range(config.warm_start.steps):
        metrics = await asyncio.to_thread(run.trainer.sft_step, path, timeout=config.timeouts.ppo_step)
        run.made_progress(f"warm-start step {step + 1}")
    done = {"demonstrations": len(batch), "steps": config.warm_start.steps, **metrics}
    saved = await _publish(run, 0, {"run_name": run.name, "warm_start": done, "history": []})
    await asyncio.to_thread(run.tracker.log_metrics, {"warm_start": metrics}, 0)
    return {**done, "checkpoint": saved}


async def _publish(run: Run, step: int, meta: dict[str, Any]) -> str:
    """Save checkpoint `step` in the trainer and have the run's inference servers serve it (`Run.load_weights`)."""
    config = run.config
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


# --- evaluation and reporting -----------------------------------------------------------------------------


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


def iteration_row(
    iteration: int, rollouts: dict[str, Any], batch: dict[str, Any], metrics: dict[str, Any], rollout_seconds: float
) -> dict[str, Any]:
    """One line of the run's history (and of MLflow's metrics): reward, loss, KL, rollouts, throughput. Metrics the
    algorithm does not compute (KL without a KL term) are left out."""
    response_tokens = metrics.get("response_length_mean", 0.0) * batch["rows"]
    row = {
        "iteration": iteration,
        "reward": rollouts["reward_mean"],
        "rollouts_ok": rollouts["succeeded"],
        "rollouts_failed": rollouts["failed"],
        "rows": batch["rows"],
        "rollout_seconds": rollout_seconds,
        "rollout_tokens_per_s": response_tokens / rollout_seconds if rollout_seconds > 0 else 0.0,
        "train_tokens_per_s": metrics.get("tokens_per_s", 0.0),
        "pg_loss": metrics.get("pg_loss"),
        "kl": metrics.get("kl", metrics.get("kl_loss")),
        "entropy": metrics.get("entropy"),
        "grad_norm": metrics.get("grad_norm"),
        "step_time_s": metrics.get("step_time_s"),
        # The train/inference mismatch: engine's vs trainer's log-probs of the sampled tokens (when the engine sent
        # them), before the update.
        "mismatch_mean": metrics.get("mismatch_mean"),
        "mismatch_max": metrics.get("mismatch_max"),
        "mismatch_frac": metrics.get("mismatch_frac"),
    }
    return {name: value for name, value in row.items() if value is not None}


def progress_line(run: Run, row: dict[str, Any], done: int, elapsed: float) -> str:
    """`iteration 3 (4/40) | reward 0.412 | loss ... | 9.8 s/it | ETA 6m02s`: the iteration numbered as Prefect,
    the table and MLflow number it (from 0), how many are done, this process's rate, the rest's ETA."""
    iterations = run.config.iterations
    rate = elapsed / max(done, 1)
    left = iterations - row["iteration"] - 1
    val = f" | val {row['val_reward']:.3f}" if "val_reward" in row else ""
    kl = f" | kl {row['kl']:.4f}" if "kl" in row else ""
    mismatch = f" | mismatch {row['mismatch_mean']:.1e}" if "mismatch_mean" in row else ""
    return (
        f"iteration {row['iteration']} ({row['iteration'] + 1}/{iterations}) | reward {row['reward']:.3f}{val} | "
        f"pg_loss {row.get('pg_loss', float('nan')):.4f}{kl}{mismatch} | rollouts {row['rollouts_ok']} ok, "
        f"{row['rollouts_failed']} failed | {row['rollout_tokens_per_s']:.0f} tok/s | {rate:.1f} s/it | "
        f"ETA {_duration(rate * left)}"
    )


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def mlflow_link(run: Run) -> str:
    """Where to look in MLflow, as a Markdown link: the run's page on the tracking server, or on the local UI that
    `make mlflow-ui` (`lightning mlflow ui`) serves for a local store."""
    from lightning.metrics import LOCAL_UI, is_server, ui_command

    tracker = run.tracker
    uri = run.config.tracking_uri
    if tracker is None:
        return f"MLflow: {uri}" if is_server(uri) else f"MLflow: `{ui_command(uri)}`, then {LOCAL_UI}"
    if is_server(uri):
        return f"[MLflow run {run.name}]({tracker.run_url})"
    return f"[MLflow run {run.name}]({tracker.run_url}) (served by `{ui_command(uri)}`)"


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float]) -> str:
    """`▁▃▅█`: one bar per value, scaled between the smallest and the largest (NaN: a space)."""
    finite = [v for v in values if v == v]
    if not finite:
        return ""
    low, high = min(finite), max(finite)
    span = (high - low) or 1.0
    return "".join(" " if v != v else SPARK[round((v - low) / span * (len(SPARK) - 1))] for v in values)


def summary_markdown(run: Run, summary: dict[str, Any]) -> str:
    """The run's closing summary (a Prefect artifact): held-out rewards, the reward curve, where the weights and the
    MLflow run are."""
    rewards = [row["reward"] for row in run.history if "reward" in row]
    lines = [f"## {run.name}: {run.config.iterations} iterations", "", "| held-out reward | |", "|---|---|"]
    if run.config.warm_start is not None:
        lines.append(f"| initial (before the warm start) | {summary['reward_initial']:.3f} |")
    lines.append(f"| before training | {summary['reward_before']:.3f} |")
    lines.append(f"| after training | {summary['reward_after']:.3f} |")
    if rewards:
        lines += ["", f"Training reward by iteration: `{sparkline(rewards)}` ({rewards[0]:.3f} -> {rewards[-1]:.3f})"]
    checkpoint = summary.get("checkpoint")
    lines += ["", f"Final checkpoint: `{Path(checkpoint).resolve() if checkpoint else 'none'}`", "", mlflow_link(run)]
    return "\n".join(lines) + "\n"


def finish(
    run: Run, before: dict[str, Any], after: dict[str, Any], initial: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Register the final model if asked, its held-out reward as a tag and in its description; the run's summary."""
    from lightning.checkpoint import latest_checkpoint

    final = latest_checkpoint(run.checkpoints_dir)
    version = None
    if run.config.checkpoint.register_model and final is not None:
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
        "mlflow_run_id": run.tracker.run_id,
        "tracking_uri": run.config.tracking_uri,
        "registered_model": (
            None if version is None else {"name": run.config.checkpoint.register_model, "version": version}
        ),
    }
