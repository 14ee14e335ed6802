"""prefect.yaml and deployments/: the demo deployments agree with the demo config, and a deployment run on a real
Prefect server and process worker that fails in its PPO step, retried with `prefect flow-run retry`, redoes only
that step and ends where an unfailed run would."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
import torch
import yaml
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterFlowRunId
from prefect.client.schemas.objects import FlowRun
from prefect_server import PREFECT, REPO_ROOT, PrefectServer, start_logged, stop_process_group, tail
from safetensors.torch import load_file

from deployments.setup import WORK_POOL
from lightning.config import TrainConfig, load_config, validate_config
from lightning.run import latest_step, recorded_history

pytest_plugins = ["prefect_server"]

RUN_TIMEOUT = 240.0
CACHED_STAGES = ("enqueue_rollouts", "run_runner", "wait_for_rollouts", "adapt_spans")
# update_resources is never cached: it points the run's resources at the retry's own proxy (a new process).
RERUN_STAGES = ("update_resources", "ppo_step", "checkpoint")


def small_config(tmp_path: Path) -> dict[str, Any]:
    """Seconds per iteration; an entropy bonus makes every update depend on its batch (the tiny model's rewards
    are mostly 0, which leaves GRPO nothing to learn from); one trainer thread makes updates bit-exact."""
    return {
        "run_name": "retried", "iterations": 2, "batch_size": 8, "samples_per_task": 4, "n_runners": 2,
        "runner_concurrency": 16, "sampling": {"temperature": 1.0, "max_tokens": 2},
        "eval_sampling": {"temperature": 0.0, "max_tokens": 2}, "max_prompt_length": 64, "max_response_length": 4,
        "algorithm": {"lr": 1e-3, "kl_coef": 0.0, "micro_batch_size": 64, "entropy_coef": 0.01},
        "checkpoint": {"keep_last": 5}, "trainer_threads": 1,
        "store_url": f"sqlite:///{tmp_path / 'store.db'}", "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "output_dir": str(tmp_path / "runs"),
    }  # fmt: skip


def test_prefect_yaml_deploys_the_demo_config_on_the_process_pool() -> None:
    spec = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert set(deployments) == {"demo", "nightly", "evaluate", "dev", "room-booking"}
    demo = load_config(REPO_ROOT / "examples" / "copy_task" / "demo.yaml")
    room_booking = load_config(REPO_ROOT / "examples" / "room_booking" / "apo.yaml")
    for name, deployment in deployments.items():
        expected = room_booking if name == "room-booking" else demo
        assert validate_config(deployment["parameters"]["config"]) == expected, name
        assert deployment["work_pool"]["name"] == WORK_POOL, name
        path, flow = deployment["entrypoint"].split(":")
        assert (REPO_ROOT / path).is_file() and f"async def {flow}(" in (REPO_ROOT / path).read_text(), name
    assert [s["active"] for s in deployments["nightly"]["schedules"]] == [False]


@pytest.mark.slow
def test_a_failed_deployment_run_retried_redoes_only_the_failed_stage(
    prefect_server: PrefectServer, tmp_path: Path
) -> None:
    env = prefect_server.env
    results = tmp_path / "shared-results"  # where every worker would find finished stages (a shared mount)
    # setup a second time: it must be idempotent, and it points the pool's flow runs at the shared results
    for command in (["deployments.deploy"], ["deployments.setup", "--result-storage", str(results)]):
        done = subprocess.run(
            [sys.executable, "-m", *command], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"

    worker_log = tmp_path / "worker.log"
    worker = start_logged([PREFECT, "worker", "start", "--pool", WORK_POOL], worker_log, env=env, cwd=tmp_path)
    try:
        config = small_config(tmp_path)
        # `overrides` changes these fields of the deployment's own config (the demo's): a 2-iteration run.
        started = subprocess.run(
            [PREFECT, "deployment", "run", "train/demo", "--param", f"overrides={json.dumps(config)}",
             "--job-variable", 'env={"LIGHTNING_FAULTS": "ppo_step@1"}'],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert started.returncode == 0, started.stdout + started.stderr
        flow_run_id = UUID(re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1))

        with SyncPrefectClient(prefect_server.api_url) as client:
            assert_every_field_has_a_description(client.read_deployment_by_name("train/demo").parameter_openapi_schema)
            failed = wait_for_final_state(client, flow_run_id, worker_log)
            assert failed.state.type.value == "FAILED", f"{failed.state!r}\n{tail(worker_log)}"
            assert "InjectedFault" in (failed.state.message or ""), failed.state.message

            retried = subprocess.run(
                [PREFECT, "flow-run", "retry", str(flow_run_id)], env=env, capture_output=True, text=True, timeout=60
            )
            assert retried.returncode == 0, retried.stdout + retried.stderr
            completed = wait_for_final_state(client, flow_run_id, worker_log, not_before=failed.state.timestamp)
            assert completed.state.type.value == "COMPLETED", f"{completed.state!r}\n{tail(worker_log)}"

            states = retried_iteration_states(client, "retried-iteration-1")
    finally:
        stop_process_group(worker)

    assert len(list(results.iterdir())) >= len(CACHED_STAGES), "the stages' results are not in the shared storage"
    train_config = validate_config(config)
    assert_each_rollout_enqueued_and_run_once(train_config)
    assert latest_step(train_config) == 2
    assert [row["iteration"] for row in recorded_history(train_config)] == [0, 1]
    assert_retried_step_matches_a_recomputation(train_config, tmp_path / "recomputed")
    # Last: a miss here means the retry redid finished stages, though everything above came out right.
    assert {name: states[name] for name in RERUN_STAGES} == dict.fromkeys(RERUN_STAGES, "Completed"), states
    assert {name: states[name] for name in CACHED_STAGES} == dict.fromkeys(CACHED_STAGES, "Cached"), states


def assert_every_field_has_a_description(schema: dict[str, Any]) -> None:
    """The deployment's run form (Prefect renders the parameter schema) explains every field it shows."""
    assert schema["properties"]["overrides"].get("description"), schema["properties"]
    fields = {
        f"{model}.{field}": spec.get("description")
        for model, definition in schema["definitions"].items()
        for field, spec in definition.get("properties", {}).items()
    }
    assert len(fields) > 90 and not [name for name, text in fields.items() if not text]


def wait_for_final_state(
    client: SyncPrefectClient, flow_run_id: UUID, log: Path, not_before: Any = None, timeout: float = RUN_TIMEOUT
) -> FlowRun:
    """The flow run once it is in a final state (one reached after `not_before`, for a retried run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        flow_run = client.read_flow_run(flow_run_id)
        state = flow_run.state
        if state is not None and state.is_final() and (not_before is None or state.timestamp > not_before):
            return flow_run
        time.sleep(1)
    pytest.fail(f"flow run {flow_run_id} did not finish within {timeout:g}s (state {state!r})\n{tail(log)}")


def retried_iteration_states(client: SyncPrefectClient, name: str) -> dict[str, str]:
    """State names of the stages in the retry's run of the iteration subflow `name` (the first run failed)."""
    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
    assert sorted(run.state.type.value for run in runs) == ["COMPLETED", "FAILED"], [run.state for run in runs]
    retry = next(run for run in runs if run.state.type.value == "COMPLETED")
    task_runs = client.read_task_runs(
        task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[retry.id]))
    )
    states: dict[str, str] = {}
    for task_run in task_runs:  # run_runner-1-0 and run_runner-1-1 must agree
        stage = task_run.name.split("-")[0]
        assert states.setdefault(stage, task_run.state.name) == task_run.state.name, (task_run.name, states)
    return states


def assert_each_rollout_enqueued_and_run_once(config: TrainConfig) -> None:
    from lightning.store import SqlLightningStore

    async def check() -> None:
        store = SqlLightningStore(config.store_url, watchdog_interval=None)
        try:
            rollouts = await store.query_rollouts(mode="train")
            assert len(rollouts) == config.iterations * config.batch_size * config.samples_per_task
            for rollout in rollouts:
                attempts = await store.query_attempts(rollout.rollout_id)
                assert (rollout.status, len(attempts)) == ("succeeded", 1), (rollout, attempts)
        finally:
            await store.close()

    asyncio.run(check())


def assert_retried_step_matches_a_recomputation(config: TrainConfig, root: Path) -> None:
    """Resume a fresh trainer from checkpoint 1, step it on iteration 1's batch: checkpoint 2's weights, bit for bit."""
    from lightning.algorithm.worker import TrainerWorker

    checkpoints = config.run_dir / "checkpoints"
    shutil.copytree(checkpoints / "step-000001", root / "step-000001")
    with TrainerWorker(config.run_dir / "model", config.algorithm, root, threads=1, start_timeout=120) as trainer:
        assert trainer.resumed_from == 1
        trainer.step(config.run_dir / "batches" / "iteration-000001", timeout=120)
        recomputed = load_file(Path(trainer.save_checkpoint(2, timeout=120)) / "model.safetensors")
    before = load_file(checkpoints / "step-000001" / "model.safetensors")
    retried = load_file(checkpoints / "step-000002" / "model.safetensors")
    assert recomputed.keys() == retried.keys()
    assert any(not torch.equal(before[name], retried[name]) for name in retried), "the step changed nothing"
    for name, tensor in retried.items():
        assert torch.equal(tensor, recomputed[name]), name
