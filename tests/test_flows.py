"""The Prefect flows on real parts, under Prefect's test harness (a real temporary Prefect server): the train
flow's two iterations end to end, resuming a finished run for more iterations, the evaluate and dev flows, a
stage that passes its hard deadline, and the command line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterName,
    LogFilter,
    LogFilterFlowRunId,
)

from examples.copy_task import data as copy_data
from flows.dev import dev
from flows.evaluate import evaluate
from flows.train import train
from lightning.checkpoint import latest_checkpoint, load_checkpoint
from lightning.config import TrainConfig, load_config
from lightning.run import recorded_history
from lightning.store import SqlLightningStore

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def prefect_server() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness  # here: Prefect's server code costs 4 s to import

    with prefect_test_harness(server_startup_timeout=180):
        yield


# The two longest tests of this module (two runs each) on a worker of their own, with a Prefect harness of their own:
# on one worker with the rest, this module was the suite's longest chain (about 1,000 s of `make test`'s 2,200 at load).
SECOND_WORKER = pytest.mark.xdist_group("test_flows_second_worker")


def small_config(tmp_path: Path, **changes: Any) -> TrainConfig:
    data = {
        "run_name": "t",
        "agent": "examples.copy_task.agent:copy_agent",
        "train_data": "examples.copy_task.data:train_tasks",
        "val_data": "examples.copy_task.data:val_tasks",
        "iterations": 2,
        "batch_size": 8,
        "samples_per_task": 4,
        "n_runners": 2,
        "runner_concurrency": 16,
        "sampling": {"temperature": 1.0, "max_tokens": 2},
        "eval_sampling": {"temperature": 0.0, "max_tokens": 2},
        "max_prompt_length": 64,
        "max_response_length": 4,
        "algorithm": {"lr": 1e-3, "kl_coef": 0.0, "micro_batch_size": 64},
        "checkpoint": {"keep_last": 5, "log_every": 1},
        "store_url": f"sqlite:///{tmp_path}/store.db",
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "output_dir": str(tmp_path / "runs"),
    }
    return load_config({**data, **changes})


async def train_rollouts(config: TrainConfig) -> list[Any]:
    async with SqlLightningStore(config.store_url, watchdog_interval=None) as store:
        return await store.query_rollouts(mode="train", queue=config.run_name)


async def val_rollouts(config: TrainConfig) -> dict[int, list[Any]]:
    """The run's held-out rollouts by the checkpoint step they evaluated."""
    async with SqlLightningStore(config.store_url, watchdog_interval=None) as store:
        by_step: dict[int, list[Any]] = {}
        for rollout in await store.query_rollouts(mode="val", queue=config.run_name):
            by_step.setdefault(rollout.metadata["iteration"], []).append(rollout)
        return by_step


async def test_train_runs_two_iterations_of_seven_stages_and_reports_them(tmp_path: Path) -> None:
    config = small_config(tmp_path)
    # As `deployments/setup.py` creates it: with the limit, ppo_step is tagged `gpu` (and takes its slot).
    async with get_client() as client:
        await client.create_concurrency_limit(tag="gpu", concurrency_limit=1)
    try:
        summary = await train(config)
    finally:
        async with get_client() as client:
            await client.delete_concurrency_limit_by_tag("gpu")

    assert summary["run_name"] == "t" and summary["iterations"] == 2
    assert 0 <= summary["reward_before"] <= 1 and 0 <= summary["reward_after"] <= 1
    final = latest_checkpoint(config.run_dir / "checkpoints")
    assert final is not None and load_checkpoint(final).step == 2 and summary["checkpoint"] == str(final)
    rollouts = await train_rollouts(config)
    assert len(rollouts) == 2 * 8 * 4 and {r.status for r in rollouts} == {"succeeded"}
    assert [row["iteration"] for row in recorded_history(config)] == [0, 1]
    # The engine's log-probs of the sampled tokens are the trainer's (float32 both): no train/inference mismatch.
    assert all(row["mismatch_max"] < 1e-3 for row in recorded_history(config)), recorded_history(config)
    # Iteration i samples from checkpoint i (0: the initial model): the proxy records it on every LLM span, and the
    # adapter carries it into each training row.
    for iteration in (0, 1):
        rows = json.loads((config.run_dir / "batches" / f"iteration-{iteration:06d}" / "batch.json").read_text())
        assert {row["weight_version"] for row in rows["metadata"]} == {iteration}
    evaluations = await val_rollouts(config)
    assert sorted(evaluations) == [0, 2] and len(evaluations[2]) == 64

    mlflow = MlflowClient(config.tracking_uri)
    run_id = summary["mlflow_run_id"]
    assert [m.step for m in mlflow.get_metric_history(run_id, "reward")] == [0, 1]
    for plateau_sign in ("zero_adv_groups", "entropy", "clip_frac", "grad_norm", "response_length"):
        assert [m.step for m in mlflow.get_metric_history(run_id, plateau_sign)] == [0, 1], plateau_sign
    assert [m.step for m in mlflow.get_metric_history(run_id, "val.reward_mean")] == [0, 2]
    assert mlflow.get_run(run_id).info.status == "FINISHED"
    assert mlflow.get_run(run_id).data.params["config.run_name"] == "t"
    assert [a.path for a in mlflow.list_artifacts(run_id, "checkpoints")] == [
        "checkpoints/step-000001",
        "checkpoints/step-000002",
    ]

    async with get_client() as client:
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="t")))
        by_name = {run.name: run for run in runs}
        assert by_name["t"].state.is_completed()
        iteration = by_name["t-iteration-1"]
        assert iteration.state.is_completed() and iteration.parent_task_run_id is not None
        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [iteration.id]}))
        assert sorted(t.name for t in tasks) == sorted(
            ["update_resources-train-1", "enqueue_rollouts-train-1", "run_runner-train-1-0", "run_runner-train-1-1",
             "wait_for_rollouts-train-1", "adapt_spans-1", "ppo_step-1", "checkpoint-1"]
        )  # fmt: skip
        assert all(t.state.is_completed() for t in tasks)
        assert next(t for t in tasks if t.name == "ppo_step-1").tags == ["gpu"]
        # Held-out rollouts are named by the checkpoint they evaluate (they were `update_resources-val--1`).
        evaluation = by_name["t-evaluation-2"]
        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [evaluation.id]}))
        assert "update_resources-val-checkpoint-2" in {t.name for t in tasks}
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["t-training"]))
        )
        table = json.loads(max(artifacts, key=lambda a: a.created).data)
        assert [row["iteration"] for row in table] == [0, 1]
        assert {"reward", "pg_loss", "rollouts_ok", "rollouts_failed", "rollout_tokens_per_s"} <= set(table[0])
        assert {"zero_adv_groups", "entropy", "clip_frac", "grad_norm", "response_length"} <= set(table[0])
        assert "kl" not in table[0]  # no KL term in this run: no empty column
        # The final held-out evaluation (after the last iteration's report) is republished: it was missing.
        assert table[1]["val_reward"] == round(summary["reward_after"], 4)
        (progress,) = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["t-progress"]))
        )
        assert progress.type == "progress" and float(progress.data) == 100.0
        (summary_artifact,) = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["t-summary"]))
        )
        assert f"| after training | {summary['reward_after']:.3f} |" in summary_artifact.data
        assert f"`{Path(summary['checkpoint']).resolve()}`" in summary_artifact.data
        assert "Training reward by iteration: `" in summary_artifact.data
        assert {"t-evaluation-0", "t-evaluation-2"} <= set(by_name)


async def test_train_with_runner_processes_runs_the_agents_outside_the_flow_s_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "pids.log"
    monkeypatch.setenv("LIGHTNING_TEST_LOG", str(log))
    config = small_config(tmp_path, iterations=1, task_runner="processes", agent="support.agents:pid_copy_agent")
    summary = await train(config)
    assert summary["iterations"] == 1
    rollouts = await train_rollouts(config)
    assert len(rollouts) == 8 * 4 and {r.status for r in rollouts} == {"succeeded"}
    agents = {int(line) for line in log.read_text().split()}  # training and held-out rollouts alike
    assert agents and os.getpid() not in agents


@SECOND_WORKER
async def test_a_finished_run_resumes_for_more_iterations_without_redoing_any(tmp_path: Path) -> None:
    config = small_config(tmp_path, iterations=1)
    first = await train(config)
    more = await train(config.model_copy(update={"iterations": 2}))

    assert more["reward_before"] == first["reward_before"]  # the baseline is not evaluated again
    assert load_checkpoint(more["checkpoint"]).step == 2
    assert more["mlflow_run_id"] == first["mlflow_run_id"]  # one MLflow run for the whole run
    assert len(await train_rollouts(config)) == 2 * 8 * 4
    assert [row["iteration"] for row in recorded_history(config)] == [0, 1]
    mlflow = MlflowClient(config.tracking_uri)
    assert [m.step for m in mlflow.get_metric_history(more["mlflow_run_id"], "reward")] == [0, 1]
    assert [m.step for m in mlflow.get_metric_history(more["mlflow_run_id"], "val.reward_mean")] == [0, 1, 2]
    async with get_client() as client:  # no `gpu` limit on this server: ppo_step is not tagged (no slot to ask for)
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["t-iteration-1"]))
        )
        latest = max(runs, key=lambda run: run.created)
        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [latest.id]}))
        parents = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["t"])))
        resumed = max(parents, key=lambda run: run.created)
        logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[resumed.id])))
    assert next(t for t in tasks if t.name == "ppo_step-1").tags == []
    # Numbered as the progress line numbers iterations (it said "at iteration 2 of 2", then "iteration 1 (2/2)").
    assert "resuming run t at iteration 1 (2/2)" in [log.message for log in logs]


async def test_a_warm_start_runs_once_before_iteration_zero_and_is_reported(tmp_path: Path) -> None:
    """Here each step on 4 of the demonstrations, drawn at random (`warm_start.batch_size`)."""
    warm = {"demonstrations": "examples.copy_task.agent:demonstrations", "fraction": 0.05, "steps": 3, "batch_size": 4}
    config = small_config(tmp_path, iterations=1, warm_start=warm)
    summary = await train(config)

    warmed = load_checkpoint(config.run_dir / "checkpoints" / "step-000000").meta["warm_start"]
    assert warmed["steps"] == 3 and warmed["demonstrations"] == int(copy_data.TRAIN * 0.05)
    assert warmed["rows_a_step"] == 4
    assert sorted(await val_rollouts(config)) == [-1, 0, 1]  # initial model, after the warm start, after training
    mlflow = MlflowClient(config.tracking_uri)
    run_id = summary["mlflow_run_id"]
    assert len(mlflow.get_metric_history(run_id, "warm_start.sft_loss")) == 1
    assert [m.value for m in mlflow.get_metric_history(run_id, "val_initial.reward_mean")] == [
        summary["reward_initial"]
    ]
    assert [m.step for m in mlflow.get_metric_history(run_id, "val.reward_mean")] == [0, 1]
    assert mlflow.get_metric_history(run_id, "val.reward_mean")[0].value == summary["reward_before"]
    async with get_client() as client:  # the warm start's progress lines (ten over its steps; here 3, one a step)
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["t"])))
        latest = max(runs, key=lambda run: run.created)  # other tests on this server train runs named t too
        logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[latest.id])))
    lines = [log.message for log in logs if log.message.startswith("warm start: step")]
    assert [line.split(" | ")[0] for line in lines] == [f"warm start: step {n}/3" for n in (1, 2, 3)]
    assert "sft_loss" in lines[-1] and lines[-1].endswith("ETA 0s")

    again = await train(config.model_copy(update={"iterations": 2}))  # resumed: no second warm start
    assert load_checkpoint(config.run_dir / "checkpoints" / "step-000000").meta["warm_start"] == warmed
    assert len(mlflow.get_metric_history(run_id, "warm_start.sft_loss")) == 1
    assert again["reward_initial"] == summary["reward_initial"]


async def test_a_warm_start_ends_once_its_demonstrations_are_fit(tmp_path: Path) -> None:
    """`warm_start.stop_at_loss`: the first step at or below it is the last (here the first step, at a loss no
    model is above), recorded as the steps taken, and the progress line says why it stopped."""
    warm = {"demonstrations": "examples.copy_task.agent:demonstrations", "fraction": 0.05, "steps": 50}
    config = small_config(tmp_path, iterations=1, warm_start={**warm, "stop_at_loss": 1000.0}, run_name="fit")
    await train(config)
    warmed = load_checkpoint(config.run_dir / "checkpoints" / "step-000000").meta["warm_start"]
    assert warmed["steps"] == 1 and warmed["sft_loss"] <= 1000.0
    async with get_client() as client:
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["fit"])))
        latest = max(runs, key=lambda run: run.created)
        logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[latest.id])))
    lines = [log.message for log in logs if log.message.startswith("warm start: step")]
    assert len(lines) == 1 and lines[0].startswith("warm start: step 1/50 |") and lines[0].endswith("stopping")


def demo_config(tmp_path: Path, **changes: Any) -> TrainConfig:
    """The demo's config (examples/copy_task/demo.yaml), short: 2 iterations of 8 tasks x 4 samples, 3 warm-start
    steps; results under tmp_path."""
    shorter = {
        "iterations": 2, "batch_size": 8, "samples_per_task": 4, "warm_start.steps": 3, "eval_every": 0,
        "checkpoint.register_model": None, "store_url": f"sqlite:///{tmp_path}/store.db",
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "output_dir": str(tmp_path / "runs"),
    }  # fmt: skip
    return load_config(REPO / "examples/copy_task/demo.yaml", **{**shorter, **changes})


def final_weights(config: TrainConfig) -> dict[str, Any]:
    from safetensors.torch import load_file

    final = latest_checkpoint(config.run_dir / "checkpoints")
    assert final is not None
    return load_file(str(final / "model.safetensors"))


@SECOND_WORKER
async def test_deterministic_runs_of_one_seed_learn_exactly_the_same(tmp_path: Path) -> None:
    """`deterministic: true`: two runs of the demo's config with one seed give the same per-iteration rewards and
    bit-identical weights, though their rollouts batch differently in the inference server (two runners, 128
    concurrent rollouts each, arriving in whatever order the machine's load makes)."""
    histories, weights = [], []
    for name in ("first", "second"):
        config = demo_config(tmp_path / name, deterministic=True)
        summary = await train(config)
        histories.append(
            [(row["reward"], row.get("pg_loss"), row.get("entropy")) for row in recorded_history(config)]
            + [(summary["reward_initial"], summary["reward_before"], summary["reward_after"])]
        )
        weights.append(final_weights(config))
    assert histories[0] == histories[1]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


async def test_evaluate_and_dev_flows(tmp_path: Path) -> None:
    config = small_config(tmp_path, iterations=1)
    await train(config)
    result = await evaluate(config)
    assert result["step"] == 1 and result["rollouts"] == 64 and result["succeeded"] == 64
    initial = await evaluate(config, checkpoint=None)
    assert initial["step"] == 1

    dry = await dev(config)
    assert dry["rollouts"]["rollouts"] == 8 * 4 and dry["batch"]["rows"] == 8 * 4
    assert load_checkpoint(latest_checkpoint(config.run_dir / "checkpoints")).step == 1  # nothing trained


async def test_a_train_and_a_dev_run_on_one_store_never_touch_each_other_s_rollouts(tmp_path: Path) -> None:
    """Both at once, same run name, same store file: each runs exactly its own queue's rollouts."""
    config = small_config(tmp_path, iterations=2)
    trained, dry = await asyncio.gather(train(config), dev(config))
    assert trained["iterations"] == 2 and dry["rollouts"]["succeeded"] == 8 * 4

    async with SqlLightningStore(config.store_url, watchdog_interval=None) as store:
        counts = {}
        for queue in ("t", "t.dev"):
            rollouts = await store.query_rollouts(queue=queue)
            counts[queue] = len(rollouts)
            assert {rollout.status for rollout in rollouts} == {"succeeded"}
            for rollout in rollouts:
                workers = {attempt.worker_id for attempt in await store.query_attempts(rollout.rollout_id)}
                assert all(worker.startswith(f"{queue}-runner") for worker in workers), (queue, workers)
    # Two iterations of 8 x 4 and two evaluations (before, after) of 64 for the training; 8 x 4 for the dry run.
    assert counts == {"t": 2 * 8 * 4 + 2 * 64, "t.dev": 8 * 4}


async def test_a_ppo_step_past_its_deadline_is_killed_and_fails_the_run(tmp_path: Path) -> None:
    config = small_config(tmp_path, iterations=1, timeouts={"ppo_step": 0.001})
    state = await train(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(TimeoutError, match="trainer step did not answer within 0.001s"):
        await state.result()
    assert latest_checkpoint(config.run_dir / "checkpoints") is None


def test_the_command_line_reports_config_errors_without_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("iterations: 0\n")
    done = subprocess.run(
        [sys.executable, "-m", "flows.train", str(bad), "--set", "algorithm.lr=-1"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"{bad} with its overrides is not a valid TrainConfig" in done.stderr
    assert "iterations: Input should be greater than or equal to 1 (got 0)\n" in done.stderr  # the file's
    # A bad --set value is blamed on the --set, not the file.
    assert "algorithm.lr: Input should be greater than or equal to 0 (got -1) (set by the override algorithm.lr)" in (
        done.stderr
    )
    assert "Traceback" not in done.stderr


def test_every_stage_task_declares_its_deadline_beside_it() -> None:
    """A task's Prefect timeout comes from the deadline declared with it (`tasks.stages.stage`); a task declared
    without one is named when a flow asks for its timeout, not a KeyError."""
    from prefect import Task, task

    import tasks.stages
    from tasks.stages import timed

    config = TrainConfig(timeouts={"ppo_step": 100, "checkpoint": 10}, warm_start={"demonstrations": "a:b", "steps": 3})
    stage_tasks = [value for value in vars(tasks.stages).values() if isinstance(value, Task)]
    assert len(stage_tasks) == 11
    for each in stage_tasks:
        assert timed(each, config).timeout_seconds > 60, each.name
    assert timed(tasks.stages.ppo_step, config).timeout_seconds == 100 + 60
    assert timed(tasks.stages.warm_start, config).timeout_seconds == 3 * 100 + 10 + 60

    @task(name="a_new_stage")
    def undeclared() -> None: ...

    with pytest.raises(TypeError, match="task 'a_new_stage' has no deadline: declare it with tasks.stages.stage"):
        timed(undeclared, config)


@pytest.mark.parametrize(("given", "expected"), [(None, "False"), ("true", "True")])
def test_prefect_telemetry_is_off_unless_the_user_turns_it_on(given: str | None, expected: str) -> None:
    """Offline, Prefect's temporary server logged "Failed to send telemetry" every 10 minutes of a run."""
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_SERVER_ANALYTICS_ENABLED"}
    if given is not None:
        env["PREFECT_SERVER_ANALYTICS_ENABLED"] = given
    code = "import flows; from prefect.settings import get_current_settings as s; print(s().server.analytics_enabled)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == expected, done.stderr[-2000:]
