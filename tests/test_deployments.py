"""prefect.yaml and deployments/: the demo deployments agree with the demo config, and a deployment run on a real
Prefect server and process worker that fails in its PPO step, retried with `prefect flow-run retry`, redoes only
that step and ends where an unfailed run would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
import torch
import yaml
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterName,
    TaskRunFilter,
    TaskRunFilterFlowRunId,
)
from prefect.client.schemas.objects import FlowRun
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect_server import (
    PREFECT,
    REPO_ROOT,
    PrefectServer,
    running_prefect_server,
    start_logged,
    stop_process_group,
    tail,
)
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
        "agent": "examples.copy_task.agent:copy_agent",
        "train_data": "examples.copy_task.data:train_tasks", "val_data": "examples.copy_task.data:val_tasks",
        "run_name": "retried", "iterations": 2, "batch_size": 8, "samples_per_task": 4, "n_runners": 2,
        "runner_concurrency": 16, "sampling": {"temperature": 1.0, "max_tokens": 2},
        "eval_sampling": {"temperature": 0.0, "max_tokens": 2}, "max_prompt_length": 64, "max_response_length": 4,
        "algorithm": {"lr": 1e-3, "kl_coef": 0.0, "micro_batch_size": 64, "entropy_coef": 0.01},
        "checkpoint": {"keep_last": 5}, "trainer_threads": 1,
        # The demo's dynamic sampling draws extra tasks for flat groups, a number that depends on the sampled
        # rewards; off here, so every enqueued rollout can be counted against iterations x batch x samples.
        "dynamic_sampling": False,
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
            # The retry (a new process, the same flow run) updated the table the first attempt made.
            training = ArtifactFilter(key=ArtifactFilterKey(any_=["retried-training"]))
            [table] = client.read_artifacts(artifact_filter=training)
            assert [row["iteration"] for row in json.loads(table.data)] == [0, 1]
            # ... and moved the progress card the first attempt left at 50%, instead of making a second one.
            progress = ArtifactFilter(key=ArtifactFilterKey(any_=["retried-progress"]))
            assert [float(card.data) for card in client.read_artifacts(artifact_filter=progress)] == [100.0]
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


# --- the documented deployment commands, as a user runs them -------------------------------------------------

BURN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"
LOADED_RUN_TIMEOUT = 1200.0


@contextlib.contextmanager
def cpu_load(busy: int = 2, seconds: float = LOADED_RUN_TIMEOUT) -> Iterator[None]:
    """At least `busy` cores' worth of other work beside the test, as other users' jobs on the machine: CPU-bound
    processes make up what the load average lacks (none inside the full suite, whose other workers keep the load at
    5-6 on two cores: there the burners only took CPU from the other tests). Each ends by itself after `seconds`, and
    is killed at the end of the block."""
    load = os.getloadavg()[0]
    processes = max(0, busy - int(load))
    print(f"load {load:.1f}: {processes} CPU burner(s) beside the run")
    burners = [subprocess.Popen([sys.executable, "-c", BURN, str(seconds)]) for _ in range(processes)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


@pytest.fixture(scope="module")
def deployed(prefect_server: PrefectServer) -> PrefectServer:
    """prefect.yaml's deployments on the session's server (`python -m deployments.deploy`)."""
    done = subprocess.run(
        [sys.executable, "-m", "deployments.deploy"], cwd=REPO_ROOT, env=prefect_server.env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"deploy failed:\n{done.stdout}\n{done.stderr}"
    return prefect_server


@contextlib.contextmanager
def process_worker(server: PrefectServer, log: Path, **env: str) -> Iterator[None]:
    """`prefect worker start --pool lightning-process`, as the README starts it, until the end of the block."""
    worker = start_logged(
        [PREFECT, "worker", "start", "--pool", WORK_POOL], log, env={**server.env, **env}, cwd=log.parent
    )
    try:
        yield
    finally:
        stop_process_group(worker)


def deployment_run(server: PrefectServer, *args: str) -> UUID:
    """`prefect deployment run ARGS`; the flow run's id."""
    started = subprocess.run(
        [PREFECT, "deployment", "run", *args], env=server.env, capture_output=True, text=True, timeout=120
    )
    assert started.returncode == 0, started.stdout + started.stderr
    return UUID(re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1))


def completed(server: PrefectServer, flow_run_id: UUID, log: Path, timeout: float = RUN_TIMEOUT) -> FlowRun:
    with SyncPrefectClient(server.api_url) as client:
        flow_run = wait_for_final_state(client, flow_run_id, log, timeout=timeout)
    assert flow_run.state.type.value == "COMPLETED", f"{flow_run.state!r}\n{tail(log)}"
    return flow_run


@pytest.mark.slow
def test_the_readme_deployment_commands_run_on_a_loaded_machine(deployed: PrefectServer, tmp_path: Path) -> None:
    """`prefect deployment run 'train/demo' --param overrides=...` through a process worker while other work keeps
    both cores busy (`cpu_load`): on such a machine the inference server took about 70 s to start, and a 120 s
    constant ended the run in open_run. Then `--param config=...`, which replaces the deployment's config whole."""
    log = tmp_path / "worker.log"
    short = {**small_config(tmp_path / "short"), "run_name": "loaded"}
    whole = {**small_config(tmp_path / "whole"), "run_name": "whole-config", "iterations": 1}
    with process_worker(deployed, log):
        with cpu_load():
            started = time.monotonic()
            loaded = deployment_run(deployed, "train/demo", "--param", f"overrides={json.dumps(short)}")
            completed(deployed, loaded, log, timeout=LOADED_RUN_TIMEOUT)
            print(f"the loaded run took {time.monotonic() - started:.0f} s")  # (pytest -s shows it)
        completed(deployed, deployment_run(deployed, "train/demo", "--param", f"config={json.dumps(whole)}"), log)

    short_config, whole_config = validate_config({**short}), validate_config(whole)
    assert latest_step(short_config) == 2 and latest_step(whole_config) == 1
    # overrides change a few fields of the deployment's config (the demo's warm start stays); config replaces it.
    assert (short_config.run_dir / "batches" / "warm-start").exists()
    assert not (whole_config.run_dir / "batches" / "warm-start").exists()
    from mlflow import MlflowClient

    client = MlflowClient(short_config.tracking_uri, registry_uri=short_config.tracking_uri)
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("lightning").experiment_id])
    assert mlflow_run.info.status == "FINISHED"
    assert f"/runs/flow-run/{loaded}" in mlflow_run.data.tags["mlflow.note.content"]  # a link to the flow run
    assert mlflow_run.data.tags["mlflow.source.name"] == "flows.train"
    # The overrides gave a checkpoint section without register_model: nothing registered.
    assert client.search_registered_models() == []


@pytest.mark.slow
def test_prompt_optimisation_runs_from_its_deployment(deployed: PrefectServer, tmp_path: Path) -> None:
    """`prefect deployment run 'optimize_prompt/room-booking'`, its models pointed at a local stand-in for OpenAI
    (overrides), the worker holding the key as the README says."""
    from support.scripted_apo import OPTIMIZER, scripted_apo_app
    from support.servers import serving

    log = tmp_path / "worker.log"
    with serving(scripted_apo_app()) as url, process_worker(deployed, log, OPENAI_API_KEY="sk-test"):
        overrides = {
            "run_name": "room-booking-test", "inference.endpoint": f"{url}/v1", "apo.api_base": f"{url}/v1",
            "apo.gradient_model": f"openai/{OPTIMIZER}", "apo.apply_edit_model": f"openai/{OPTIMIZER}",
            "apo.beam_rounds": 1, "apo.beam_width": 1, "apo.branch_factor": 1, "apo.gradient_batch_size": 2,
            "apo.val_batch_size": 4, "store_url": f"sqlite:///{tmp_path}/store.db",
            "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "output_dir": str(tmp_path / "runs"),
        }  # fmt: skip
        flow_run = deployment_run(
            deployed, "optimize_prompt/room-booking", "--param", f"overrides={json.dumps(overrides)}"
        )
        completed(deployed, flow_run, log)
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db", registry_uri=f"sqlite:///{tmp_path}/mlflow.db")
    assert client.load_prompt("prompts:/room-booking-test/1").template


@pytest.mark.slow
def test_the_nightly_schedule_is_off_until_resumed_and_results_may_go_to_a_bucket(deployed: PrefectServer) -> None:
    """docs/deployments.md: `prefect deployment schedule ls|resume train/nightly`, and `python -m deployments.setup
    --result-storage s3://...` (a file system block; the bucket is reached only when a flow run writes)."""

    def prefect(*args: str) -> str:
        done = subprocess.run([PREFECT, *args], env=deployed.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def schedule() -> Any:
        with SyncPrefectClient(deployed.api_url) as client:
            [each] = client.read_deployment_by_name("train/nightly").schedules
        return each

    listed = prefect("deployment", "schedule", "ls", "train/nightly")
    assert "0 2 * * *" in listed and str(schedule().id) in listed and not schedule().active
    prefect("deployment", "schedule", "resume", "train/nightly", str(schedule().id))
    assert schedule().active
    prefect("deployment", "schedule", "pause", "train/nightly", str(schedule().id))
    assert not schedule().active

    def pool_env() -> dict[str, str]:
        async def read() -> Any:
            from prefect import get_client

            async with get_client() as client:
                return await client.read_work_pool(WORK_POOL)

        with temporary_settings({PREFECT_API_URL: deployed.api_url}):
            pool = asyncio.run(read())
        return pool.base_job_template["variables"]["properties"]["env"].get("default") or {}

    def setup(where: str) -> dict[str, str]:
        done = subprocess.run(
            [sys.executable, "-m", "deployments.setup", "--result-storage", where], cwd=REPO_ROOT, env=deployed.env,
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return pool_env()

    before = pool_env()
    bucket = setup("s3://bucket/prefect-results")
    assert bucket.get("PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK") == "remote-file-system/lightning-results"
    assert "PREFECT_RESULTS_LOCAL_STORAGE_PATH" not in bucket  # the new place replaces the old one
    again = setup(
        before.get("PREFECT_RESULTS_LOCAL_STORAGE_PATH") or str(Path(deployed.env["PREFECT_HOME"]) / "storage")
    )
    assert "PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK" not in again


@pytest.mark.slow
def test_serve_runs_prefect_yamls_deployments_without_a_worker(tmp_path: Path) -> None:
    """`python -m deployments.serve` serves the deployments prefect.yaml lists (one list for both ways), from one
    process; a `prefect deployment run` of one runs there. On a server of its own: it takes over the names."""
    spec = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
    expected = {f"{d['entrypoint'].rsplit(':', 1)[1]}/{d['name']}" for d in spec["deployments"]}
    with running_prefect_server(tmp_path / "prefect") as server:
        log = tmp_path / "serve.log"
        served = start_logged([sys.executable, "-m", "deployments.serve"], log, env=server.env, cwd=tmp_path)
        try:
            with SyncPrefectClient(server.api_url) as client:
                deadline = time.monotonic() + 180
                while _deployments(client) != expected:
                    assert served.poll() is None and time.monotonic() < deadline, tail(log)
                    time.sleep(1)
            overrides = {**small_config(tmp_path), "run_name": "served", "batch_size": 2, "samples_per_task": 2}
            completed(server, deployment_run(server, "dev/dev", "--param", f"overrides={json.dumps(overrides)}"), log)
        finally:
            stop_process_group(served)
        # SIGTERM leaves the deployments as they were: not paused (Prefect pauses them by default on shutdown).
        with SyncPrefectClient(server.api_url) as client:
            assert not [each.name for each in client.read_deployments() if each.paused]


def _deployments(client: SyncPrefectClient) -> set[str]:
    """`flow/deployment` of every deployment on the server."""
    flows = {flow.id: flow.name for flow in client.read_flows()}
    return {f"{flows.get(each.flow_id, '?')}/{each.name}" for each in client.read_deployments()}
