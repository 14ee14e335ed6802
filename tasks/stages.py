"""A run's stages as Prefect tasks. Each body is one `lightning.stages` call (or `Run.open`); what Prefect adds is
declared on the decorator:

- retries with backoff on the stages that can fail transiently (the store or the inference server restarting);
  none on `ppo_step`, whose failures are not transient (a retried flow run re-runs it);
- results persisted as JSON under a (train run, run name, iteration, stage) cache key, so retrying a failed
  flow run skips the stages that finished. Not cached: `open_run` and `update_resources`, which bring up and point
  at this process's servers (a retried flow run is a new process);
- `ppo_step` takes a slot of the concurrency limit on the tag `gpu` where Prefect's server has one
  (`prefect concurrency-limit create gpu 1`, done by `deployments/setup.py`): one update per GPU at a time,
  whatever the number of runs. Where the server has none, it is not tagged at all (`gpu_limited` says why);
- a timeout on every stage, declared beside it (`stage(name, deadline)`: seconds from the run's config) and set
  when the flow calls it (`timed`): Prefect's is the outer bound, a minute past the deadline the library enforces
  inside (it kills the trainer process at `timeouts.ppo_step`, stops waiting for rollouts at `timeouts.rollouts`),
  whose error names the stage.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any, TypeVar

from prefect import Task, get_client, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import ObjectNotFound
from prefect.runtime import task_run

from lightning import stages
from lightning.algorithm.worker import TrainerCrashed, UpdateLost
from lightning.config import TrainConfig
from lightning.diskspace import NoSpaceLeft
from lightning.environment import FAULTS, PREFECT_UI
from lightning.metrics import PREFECT_FLOW_RUN_ID, PREFECT_FLOW_RUN_URL, SOURCE_NAME
from lightning.run import Run
from lightning.stages import Mode
from lightning.stopping import RunStopped
from tasks.caching import TRAIN_FLOW_RUN_ID, ppo_step_cache_key, stage_cache_key

FAULTS_ENV = FAULTS
"""Fault drills: `stage@iteration[,stage@iteration...]` (e.g. `ppo_step@1`, `wait_for_rollouts@2`, `checkpoint@0`)
makes that stage's task fail once per run (a marker file in the run directory remembers it), so that retrying the
failed flow run goes through. Every task below takes part; for evaluations the iteration is the step evaluated."""

STAGE = {"persist_result": True, "result_serializer": "json", "cache_key_fn": stage_cache_key}
MARGIN_SECONDS = 60.0
"""Prefect's timeout comes this long after the library's own deadline for the stage."""
GPU_TAG = "gpu"
"""The tag whose concurrency limit, where the server has one, lets one `ppo_step` at a time use the GPU."""

T = TypeVar("T", bound=Task[Any, Any])


def _phase_name(stage: str, *more: str) -> Callable[[], str]:
    """The task run name of a rollout phase's stage: `update_resources-train-3` in iteration 3, and for held-out
    rollouts the checkpoint they evaluate, `update_resources-val-checkpoint-5` (`-val-initial`: the model before the
    warm start); `more` names parameters added at the end (`run_runner-train-3-0`: its index)."""

    def name() -> str:
        parameters = task_run.parameters
        mode, iteration = parameters["mode"], parameters["iteration"]
        held_out = "initial" if iteration < 0 else f"checkpoint-{iteration}"
        where = str(iteration) if mode == "train" else held_out
        return "-".join([stage, mode, where, *(str(parameters[field]) for field in more)])

    return name


class InjectedFault(RuntimeError):
    """Raised by a task that LIGHTNING_FAULTS names."""


def drill(run: Run, stage: str, iteration: int) -> None:
    """Fail once if LIGHTNING_FAULTS names `stage@iteration`."""
    name = f"{stage}@{iteration}"
    if name not in {item.strip() for item in os.environ.get(FAULTS_ENV, "").split(",")}:
        return
    marker = run.run_dir / "faults" / name
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("fired\n")
    raise InjectedFault(f"injected fault {name} ({FAULTS_ENV}); it fires once per run, so a retry goes through")


def _retry_unless(*kinds: type[BaseException]) -> Any:
    """A retry condition: retry, unless the failure is one of `kinds` (which a retry would only repeat)."""

    def condition(task: Any, task_run: Any, state: Any) -> bool:
        return not isinstance(state.data, kinds)

    return condition


def _retry_only(*kinds: type[BaseException]) -> Any:
    def condition(task: Any, task_run: Any, state: Any) -> bool:
        return isinstance(state.data, kinds)

    return condition


NOT_TRANSIENT = (RunStopped, NoSpaceLeft, stages.NoTrainingRows)
"""Failures a retry would only repeat: the run was asked to stop; the disk is full; the rollouts left no row."""
TRANSIENT = {
    "retries": 2, "retry_delay_seconds": [2, 10], "retry_jitter_factor": 0.5,
    "retry_condition_fn": _retry_unless(*NOT_TRANSIENT),
}  # fmt: skip

Deadline = Callable[[TrainConfig], float]
_deadlines: dict[str, Deadline] = {}
"""Each stage task's deadline, by task name: filled by `stage`, beside each task."""


def stage(name: str, deadline: Deadline, **options: Any) -> Callable[[Callable[..., Any]], Task[Any, Any]]:
    """`@task(name=name, **options)` with the stage's deadline beside it: seconds from the run's config, which
    `timed` makes Prefect's timeout (a minute later)."""

    def declare(function: Callable[..., Any]) -> Task[Any, Any]:
        _deadlines[name] = deadline
        return task(name=name, **options)(function)

    return declare


def timed(stage: T, run: Run | TrainConfig) -> T:
    """`stage` with its Prefect timeout from the run's config: its deadline (declared with `stage`) plus a margin."""
    config = run.config if isinstance(run, Run) else run
    deadline = _deadlines.get(stage.name)
    if deadline is None:
        raise TypeError(f"task {stage.name!r} has no deadline: declare it with tasks.stages.stage(name, deadline=...)")
    return stage.with_options(timeout_seconds=deadline(config) + MARGIN_SECONDS)


def _rollouts(config: TrainConfig) -> float:
    """A rollout phase's deadline: training's or evaluation's, whichever is longer (the task serves both)."""
    return max(config.timeouts.rollouts, config.timeouts.evaluate)


def _warm_start(config: TrainConfig) -> float:
    steps = config.warm_start.steps if config.warm_start else 1
    return config.timeouts.ppo_step * steps + config.timeouts.checkpoint


async def gpu_limited(stage: T) -> T:
    """`stage` tagged `gpu` if Prefect's server has a concurrency limit on that tag, else `stage` as it is.

    Why not tag it always: for every tag a task carries, Prefect's task engine asks the server for a slot before the
    task starts (POST /v2/concurrency_limits/increment-with-lease), limit or not. That is a write transaction on
    the server's database, and on SQLite (the temporary server, a small deployment) it waits behind the task-run
    events the server is writing: measured 1.8-2 s before each `ppo_step`, which follows a burst of task runs.
    Prefect remembers a tag without a limit for 5 s only, less than an iteration. Whether the limit exists is a
    read, which does not wait; it is asked each time, so a limit created during a run applies from the next call.
    """
    async with get_client() as client:
        try:
            await client.read_concurrency_limit_by_tag(GPU_TAG)
        except ObjectNotFound:
            return stage
    return stage.with_options(tags=[*stage.tags, GPU_TAG])


@stage(
    "open_run", lambda config: config.timeouts.startup, task_run_name="open_run-{config.run_name}",
    cache_policy=NO_CACHE,
)  # fmt: skip
async def open_run(
    config: TrainConfig,
    train: bool = True,
    weights: str | None = None,
    queue: str | None = None,
    track: bool | None = None,
) -> Run:
    """Bring up the run's store, serving parts, trainer and MLflow run in this process (never cached: a retried
    flow run is a new process and needs its own). The MLflow run is tagged with this flow run's id and URL; while a
    server starts, the task's log says every few seconds how long it has waited and what the server last logged."""
    return await Run.open(
        config, train=train, weights=weights, queue=queue, track=track, mlflow_tags=flow_run_tags(),
        report=get_run_logger().info,
    )  # fmt: skip


def flow_run_tags() -> dict[str, str]:
    """MLflow run tags naming the Prefect flow run that trains (the top-level one): its id and its UI page."""
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_UI_URL

    flow_run_id = TRAIN_FLOW_RUN_ID.get() or flow_run.root_flow_run_id or flow_run.id
    if not flow_run_id:
        return {}
    # The command a user runs for this flow (`python -m flows.train`): MLflow shows it as the run's source.
    tags = {PREFECT_FLOW_RUN_ID: str(flow_run_id), SOURCE_NAME: f"flows.{flow_run.flow_name}"}
    ui = os.environ.get(PREFECT_UI) or PREFECT_UI_URL.value()
    if ui:
        tags[PREFECT_FLOW_RUN_URL] = f"{str(ui).rstrip('/')}/runs/flow-run/{flow_run_id}"
    return tags


@stage(
    "update_resources", lambda config: config.timeouts.update_resources,
    task_run_name=_phase_name("update_resources"), cache_policy=NO_CACHE, **TRANSIENT,
)  # fmt: skip
async def update_resources(run: Run, iteration: int, mode: Mode) -> str:
    drill(run, "update_resources", iteration)
    return await stages.update_resources(run, mode)


@stage(
    "enqueue_rollouts", lambda config: config.timeouts.enqueue_rollouts,
    task_run_name=_phase_name("enqueue_rollouts"), **STAGE, **TRANSIENT,
)  # fmt: skip
async def enqueue_rollouts(
    run: Run, iteration: int, resources_id: str, mode: Mode, refill: int = 0, count: int | None = None
) -> list[str]:
    """`refill` >= 1: `count` more tasks that dynamic sampling asked for."""
    drill(run, "enqueue_rollouts", iteration)
    return await stages.enqueue_rollouts(run, iteration, resources_id, mode, refill, count)


@stage("run_runner", _rollouts, task_run_name=_phase_name("run_runner", "index"), **STAGE, **TRANSIENT)
async def run_runner(
    run: Run, iteration: int, rollout_ids: list[str], index: int, mode: Mode, round_: int = 0
) -> dict[str, Any]:
    """One runner task, on a thread of the flow's process or a Ray worker; its result says where its rollouts ran
    (with task_runner processes, the runner process's id). `round_`: 0, or the round of running failed rollouts
    again."""
    drill(run, "run_runner", iteration)
    done = await stages.run_runners(run, rollout_ids, index, mode)
    return {"host": socket.gethostname(), "pid": os.getpid(), **done}


@stage("wait_for_rollouts", _rollouts, task_run_name=_phase_name("wait_for_rollouts"), **STAGE, **TRANSIENT)
async def wait_for_rollouts(
    run: Run, iteration: int, rollout_ids: list[str], mode: Mode, round_: int = 0
) -> dict[str, Any]:
    drill(run, "wait_for_rollouts", iteration)
    return await stages.wait_for_rollouts(run, rollout_ids, mode)


@stage(
    "requeue_unsuccessful", lambda config: config.timeouts.enqueue_rollouts,
    task_run_name=_phase_name("requeue_unsuccessful"), **STAGE, **TRANSIENT,
)  # fmt: skip
async def requeue_unsuccessful(run: Run, iteration: int, rollout_ids: list[str], mode: Mode, round_: int) -> int:
    drill(run, "requeue_unsuccessful", iteration)
    return await stages.requeue_unsuccessful(run, rollout_ids)


@stage(
    "adapt_spans", lambda config: config.timeouts.adapt_spans, task_run_name="adapt_spans-{iteration}", **STAGE,
    **TRANSIENT,
)  # fmt: skip
async def adapt_spans(run: Run, iteration: int, rollout_ids: list[str]) -> dict[str, Any]:
    drill(run, "adapt_spans", iteration)
    return await stages.adapt_spans(run, iteration, rollout_ids)


@stage(
    "ppo_step", lambda config: config.timeouts.ppo_step, task_run_name="ppo_step-{iteration}",
    **{**STAGE, "cache_key_fn": ppo_step_cache_key}, retries=1, retry_condition_fn=_retry_only(TrainerCrashed),
)  # fmt: skip
async def ppo_step(run: Run, iteration: int, batch_path: str) -> dict[str, float]:
    """Retried once if the trainer process died (it restarts from the latest checkpoint and takes the same step);
    its cache key names the trainer process, whose memory holds the update until `checkpoint` saves it. Called
    through `gpu_limited`, which tags it `gpu` where the server limits that tag."""
    drill(run, "ppo_step", iteration)
    return await stages.ppo_step(run, iteration, batch_path)


@stage(
    "checkpoint", lambda config: config.timeouts.checkpoint, task_run_name="checkpoint-{iteration}", **STAGE,
    **{**TRANSIENT, "retry_condition_fn": _retry_unless(UpdateLost, *NOT_TRANSIENT)},
)  # fmt: skip
async def checkpoint(run: Run, iteration: int, row: dict[str, Any]) -> dict[str, Any]:
    drill(run, "checkpoint", iteration)
    return await stages.checkpoint(run, iteration, row)


@stage("warm_start", _warm_start, task_run_name="warm_start", **STAGE)
async def warm_start(run: Run) -> dict[str, Any]:
    drill(run, "warm_start", 0)
    return await stages.warm_start(run, report=get_run_logger().info)


@stage(
    "log_evaluation", lambda config: config.timeouts.update_resources, task_run_name="log_evaluation-{step}",
    **STAGE, **TRANSIENT,
)  # fmt: skip
async def log_evaluation(
    run: Run, step: int, summary: dict[str, Any], rollout_ids: list[str] | None = None
) -> dict[str, Any]:
    drill(run, "log_evaluation", step)
    return await stages.log_evaluation(run, step, summary, rollout_ids or [])
