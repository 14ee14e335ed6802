"""The Prefect flows on real parts, under Prefect's test harness (a real temporary Prefect server): the train
flow's two iterations end to end, resuming a finished run for more iterations, the evaluate and dev flows, a
stage that passes its hard deadline, and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterName
from prefect.testing.utilities import prefect_test_harness

from flows.dev import dev
from flows.evaluate import evaluate
from flows.train import train
from lightning.checkpoint import latest_checkpoint, load_checkpoint
from lightning.config import TrainConfig, load_config
from lightning.store import SqlLightningStore

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def prefect_server() -> Iterator[None]:
    with prefect_test_harness(server_startup_timeout=180):
        yield


def small_config(tmp_path: Path, **changes: Any) -> TrainConfig:
    data = {
        "run_name": "t",
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
    store = SqlLightningStore(config.store_url, watchdog_interval=None)
    try:
        return [r for r in await store.query_rollouts(mode="train") if r.metadata["run_name"] == config.run_name]
    finally:
        await store.close()


async def test_train_runs_two_iterations_of_seven_stages_and_reports_them(tmp_path: Path) -> None:
    config = small_config(tmp_path)
    summary = await train(config)

    assert summary["run_name"] == "t" and summary["iterations"] == 2
    assert 0 <= summary["reward_before"] <= 1 and 0 <= summary["reward_after"] <= 1
    final = latest_checkpoint(config.run_dir / "checkpoints")
    assert final is not None and load_checkpoint(final).step == 2 and summary["checkpoint"] == str(final)
    rollouts = await train_rollouts(config)
    assert len(rollouts) == 2 * 8 * 4 and {r.status for r in rollouts} == {"succeeded"}
    state = json.loads((config.run_dir / "run.json").read_text())
    assert [row["iteration"] for row in state["history"]] == [0, 1]
    # Iteration i samples from checkpoint i (0: the initial model): the proxy records it on every LLM span, and the
    # adapter carries it into each training row.
    for iteration in (0, 1):
        rows = json.loads((config.run_dir / "batches" / f"iteration-{iteration:06d}" / "batch.json").read_text())
        assert {row["weight_version"] for row in rows["metadata"]} == {iteration}
    assert set(state["evaluations"]) == {"0", "2"} and state["evaluations"]["2"]["rollouts"] == 64

    mlflow = MlflowClient(config.tracking_uri)
    run_id = summary["mlflow_run_id"]
    assert [m.step for m in mlflow.get_metric_history(run_id, "reward")] == [0, 1]
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
            ["update_resources-1", "enqueue_rollouts-1", "run_runner-1-0", "run_runner-1-1", "wait_for_rollouts-1",
             "adapt_spans-1", "ppo_step-1", "checkpoint-1"]
        )  # fmt: skip
        assert all(t.state.is_completed() for t in tasks)
        assert next(t for t in tasks if t.name == "ppo_step-1").tags == ["gpu"]
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["t-training"]))
        )
        table = json.loads(max(artifacts, key=lambda a: a.created).data)
        assert [row["iteration"] for row in table] == [0, 1]
        assert {"reward", "pg_loss", "rollouts_ok", "rollouts_failed", "rollout_tokens_per_s"} <= set(table[0])


async def test_a_finished_run_resumes_for_more_iterations_without_redoing_any(tmp_path: Path) -> None:
    config = small_config(tmp_path, iterations=1)
    first = await train(config)
    more = await train(config.model_copy(update={"iterations": 2}))

    assert more["reward_before"] == first["reward_before"]  # the baseline is not evaluated again
    assert load_checkpoint(more["checkpoint"]).step == 2
    assert more["mlflow_run_id"] == first["mlflow_run_id"]  # one MLflow run for the whole run
    assert len(await train_rollouts(config)) == 2 * 8 * 4
    history = json.loads((config.run_dir / "run.json").read_text())["history"]
    assert [row["iteration"] for row in history] == [0, 1]


async def test_a_warm_start_runs_once_before_iteration_zero_and_is_reported(tmp_path: Path) -> None:
    warm = {"demonstrations": "examples.copy_task.agent:demonstrations", "fraction": 0.25, "steps": 3}
    config = small_config(tmp_path, iterations=1, warm_start=warm)
    summary = await train(config)

    state = json.loads((config.run_dir / "run.json").read_text())
    assert state["warm_start"]["steps"] == 3 and state["warm_start"]["demonstrations"] == 192 // 4
    assert set(state["evaluations"]) == {"-1", "0", "1"}  # initial model, after the warm start, after training
    assert summary["reward_initial"] == state["evaluations"]["-1"]["reward_mean"]
    assert summary["reward_before"] == state["evaluations"]["0"]["reward_mean"]
    mlflow = MlflowClient(config.tracking_uri)
    assert len(mlflow.get_metric_history(summary["mlflow_run_id"], "warm_start.sft_loss")) == 1
    assert len(mlflow.get_metric_history(summary["mlflow_run_id"], "val_initial.reward_mean")) == 1

    again = await train(config.model_copy(update={"iterations": 2}))  # resumed: no second warm start
    assert json.loads((config.run_dir / "run.json").read_text())["warm_start"] == state["warm_start"]
    assert again["reward_initial"] == summary["reward_initial"]


async def test_evaluate_and_dev_flows(tmp_path: Path) -> None:
    config = small_config(tmp_path, iterations=1)
    await train(config)
    result = await evaluate(config)
    assert result["step"] == 1 and result["rollouts"] == 64 and result["succeeded"] == 64
    initial = await evaluate(config, checkpoint=None)
    assert initial["step"] == 1

    dry = await dev(config)
    assert dry["rollouts"]["rollouts"] == 8 * 4 and dry["batch"]["rows"] == 8 * 4
    assert latest_checkpoint(tmp_path / "runs" / "t-dev" / "checkpoints") is None  # nothing trained


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
    assert "iterations: Input should be greater than or equal to 1" in done.stderr
    assert "algorithm.lr: Input should be greater than or equal to 0" in done.stderr
    assert "Traceback" not in done.stderr
