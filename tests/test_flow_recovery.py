"""A training run killed mid-iteration (the flow process, its inference server and its trainer, SIGKILL) and started
again under the same run name finishes, with every rollout run once to success and nothing lost or doubled."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect_server import PrefectServer, start_logged, stop_process_group, tail

from lightning.config import TrainConfig, validate_config
from lightning.run import checkpoints_dir, latest_step, recorded_history

pytest_plugins = ["prefect_server"]

RUN_TIMEOUT = 240.0


def crash_config(tmp_path: Path) -> dict[str, Any]:
    """Three iterations of 64 rollouts, two at a time: iteration 1's rollouts take a few seconds, the window for
    the kill."""
    return {
        "run_name": "crashed", "iterations": 3, "batch_size": 16, "samples_per_task": 4, "n_runners": 2,
        "runner_concurrency": 1, "sampling": {"temperature": 1.0, "max_tokens": 2},
        "eval_sampling": {"temperature": 0.0, "max_tokens": 2}, "max_prompt_length": 64, "max_response_length": 4,
        "algorithm": {"lr": 1e-3, "kl_coef": 0.0, "micro_batch_size": 64}, "checkpoint": {"keep_last": 5},
        "store_url": f"sqlite:///{tmp_path / 'store.db'}", "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "output_dir": str(tmp_path / "runs"),
    }  # fmt: skip


@pytest.mark.slow
def test_a_run_killed_mid_iteration_resumes_and_runs_each_rollout_once(
    prefect_server: PrefectServer, tmp_path: Path
) -> None:
    config = validate_config(crash_config(tmp_path))
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(crash_config(tmp_path)))
    command = [sys.executable, "-m", "flows.train", str(config_path)]
    log = tmp_path / "train.log"

    first = start_logged(command, log, env=prefect_server.env, cwd=tmp_path)
    try:
        progress = asyncio.run(wait_until_iteration_1_is_half_done(config, first, log))
        os.killpg(first.pid, signal.SIGKILL)  # the flow, its inference server and its trainer
        first.wait(30)
        wait_until_group_is_gone(first.pid, log)
    finally:
        stop_process_group(first)

    with open(log, "a") as separator:
        separator.write(f"\n=== killed at {progress}; started again ===\n")
    second = start_logged(command, log, env=prefect_server.env, cwd=tmp_path)
    try:
        code = second.wait(RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the resumed run did not finish within {RUN_TIMEOUT:g}s\n{tail(log)}")
    finally:
        stop_process_group(second)
    assert code == 0, f"the resumed run exited with {code}\n{tail(log)}"

    asyncio.run(assert_each_rollout_ran_once_to_success(config))
    assert latest_step(config) == 3
    assert [row["iteration"] for row in recorded_history(config)] == [0, 1, 2]
    with SyncPrefectClient(prefect_server.api_url) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["crashed"])))
    assert "COMPLETED" in [run.state.type.value for run in runs], [run.state for run in runs]


async def wait_until_iteration_1_is_half_done(config: TrainConfig, process: Any, log: Path) -> str:
    """Once iteration 0 is checkpointed, poll the store until some of iteration 1's rollouts have finished and
    some have not; how far they got."""
    from lightning.store import SqlLightningStore

    deadline = time.monotonic() + RUN_TIMEOUT
    checkpoint = checkpoints_dir(config) / "step-000001"
    while not checkpoint.is_dir():
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no checkpoint of iteration 0 (exit code {process.poll()})\n{tail(log)}")
        await asyncio.sleep(0.2)
    store = SqlLightningStore(config.store_url, watchdog_interval=None)
    try:
        while time.monotonic() < deadline and process.poll() is None:
            rollouts = [r for r in await store.query_rollouts(mode="train") if r.metadata["iteration"] == 1]
            statuses = Counter(rollout.status for rollout in rollouts)
            if 0 < statuses["succeeded"] < config.batch_size * config.samples_per_task:
                return f"iteration 1 rollouts {dict(statuses)}"
            await asyncio.sleep(0.05)
    finally:
        await store.close()
    pytest.fail(f"never saw iteration 1 half done (exit code {process.poll()})\n{tail(log)}")


def wait_until_group_is_gone(pgid: int, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"processes of the killed run outlived SIGKILL for {timeout:g}s\n{tail(log)}")


async def assert_each_rollout_ran_once_to_success(config: TrainConfig) -> None:
    """One rollout per (iteration, task, sample), each succeeded (a rollout cut short by the kill was requeued and
    finished by the resumed run: a second attempt of the same rollout, not a second rollout)."""
    from lightning.store import SqlLightningStore

    store = SqlLightningStore(config.store_url, watchdog_interval=None)
    try:
        rollouts = await store.query_rollouts(mode="train")
    finally:
        await store.close()
    assert len(rollouts) == config.iterations * config.batch_size * config.samples_per_task
    assert Counter(rollout.status for rollout in rollouts) == {"succeeded": len(rollouts)}
    groups = Counter((rollout.metadata["iteration"], rollout.metadata["task_index"]) for rollout in rollouts)
    expected = {(i, t) for i in range(config.iterations) for t in range(config.batch_size)}
    assert set(groups) == expected and set(groups.values()) == {config.samples_per_task}, groups
