"""Runner tasks on Ray: the `train` flow with `task_runner: ray` fans its runner tasks out to the workers of a real
local Ray cluster (`ray start --head`, CPUs only), which reach the run's store over HTTP (`lightning store serve`
with a token) and the run's LLM proxy; and the config check that refuses a store the workers cannot reach (quick,
unmarked; the fan-out is `slow`: about 80 s on 2 cores, most of it starting Prefect, Ray and the run's services)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.settings import PREFECT_SERVER_ANALYTICS_ENABLED, temporary_settings
from prefect_server import free_port, start_logged, stop_process_group, tail

from flows.train import task_runner, train
from lightning import raycluster
from lightning.config import TrainConfig, load_config, ray_store_problem
from lightning.errors import ConfigError
from lightning.run import recorded_history
from lightning.store.client import HttpLightningStore

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TOKEN_ENV = "LIGHTNING_STORE_TOKEN"


def small_config(tmp_path: Path, **changes: Any) -> TrainConfig:
    """One iteration of test_flows' tiny run, without the held-out evaluations (they run in the flow's process)."""
    data = {
        "run_name": "ray",
        "agent": "examples.copy_task.agent:copy_agent",
        "train_data": "examples.copy_task.data:train_tasks",
        "iterations": 1,
        "batch_size": 8,
        "samples_per_task": 4,
        "n_runners": 2,
        "runner_concurrency": 16,
        "val_data": None,
        "sampling": {"temperature": 1.0, "max_tokens": 2},
        "max_prompt_length": 64,
        "max_response_length": 4,
        "algorithm": {"lr": 1e-3, "kl_coef": 0.0, "micro_batch_size": 64},
        "store_url": f"sqlite:///{tmp_path}/store.db",
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "output_dir": str(tmp_path / "runs"),
    }
    return load_config({**data, **changes})


# --- the config check (no Ray needed) ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "store_url", ["sqlite://", "sqlite:///:memory:", "sqlite:///.lightning/store.db", "sqlite+pysqlite:///store.db"]
)
def test_ray_refuses_a_store_its_workers_cannot_reach(tmp_path: Path, store_url: str) -> None:
    problem = ray_store_problem("ray", store_url)
    assert problem is not None and store_url in problem and "http://" in problem
    with pytest.raises(ConfigError, match="store_url: .*Ray workers are other processes"):
        small_config(tmp_path, task_runner="ray", store_url=store_url)


@pytest.mark.parametrize(
    "store_url", ["http://10.0.0.5:4747", "postgresql://postgres@10.0.0.5:5432/test", "sqlite:////shared/store.db"]
)
def test_ray_takes_a_store_its_workers_can_reach(tmp_path: Path, store_url: str) -> None:
    assert ray_store_problem("ray", store_url) is None
    assert small_config(tmp_path, task_runner="ray", store_url=store_url).task_runner == "ray"
    assert ray_store_problem("default", "sqlite://") is None  # threads: no Ray


def test_ray_workers_get_the_tokens_and_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = small_config(tmp_path, task_runner="ray", store_url="http://10.0.0.5:4747", ray_address="10.0.0.5:6379")
    assert task_runner(config).address == "10.0.0.5:6379"
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    monkeypatch.delenv("LIGHTNING_PROXY_TOKEN", raising=False)
    env = raycluster.worker_env()
    assert env[TOKEN_ENV] == "s3cret" and "LIGHTNING_PROXY_TOKEN" not in env
    assert str(Path.cwd()) in env["PYTHONPATH"].split(os.pathsep)
    monkeypatch.delenv(TOKEN_ENV)
    assert TOKEN_ENV not in raycluster.worker_env()


# --- the runner fan-out on a Ray cluster ------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefect_harness() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness  # here: Prefect's server code costs 4 s to import

    # Without telemetry: its heartbeat fails offline and races the new server's database ("database is locked").
    quiet = temporary_settings({PREFECT_SERVER_ANALYTICS_ENABLED: False})
    with quiet, prefect_test_harness(server_startup_timeout=180):
        yield


@dataclass
class RayCluster:
    address: str
    temp_dir: Path

    def worker_pids(self) -> set[int]:
        """The processes that ran as Ray workers of this cluster (each leaves python-core-worker-<id>_<pid>.log)."""
        logs = self.temp_dir / "session_latest" / "logs"
        return {int(log.stem.rsplit("_", 1)[1]) for log in logs.glob("python-core-worker-*_*.log")}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """A one-node Ray cluster of 2 CPUs: `ray start --head --block` in a session of its own. Its workers import
    the repo (PYTHONPATH, as on a cluster whose nodes have the code) but do not get the store's token from it: the
    flow passes that on."""
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's sockets live under it
    port = free_port()
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    env.pop(TOKEN_ENV, None)
    command = [
        str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
        "--disable-usage-stats", "--object-store-memory=100000000", f"--ray-client-server-port={free_port()}",
        f"--temp-dir={temp_dir}",
    ]  # fmt: skip
    log = temp_dir / "ray-start.log"
    process = start_logged(command, log, env=env, cwd=temp_dir)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in (log.read_text(errors="replace") if log.is_file() else ""):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start did not come up (exit {process.poll()}):\n{tail(log)}")
            time.sleep(0.5)
        yield RayCluster(f"127.0.0.1:{port}", temp_dir)
    finally:
        # SIGTERM to the leader only: it drains the node through the GCS, then stops what it started.
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def store_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """`lightning store serve` on 127.0.0.1 with a SQLite file and a token: its URL and the token."""
    home = tmp_path_factory.mktemp("store")
    token = uuid.uuid4().hex
    port = free_port()
    command = [str(BIN / "lightning"), "store", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--db", f"sqlite:///{home}/store.db", "--log-level", "warning"]
    process = start_logged(command, home / "server.log", env={**os.environ, TOKEN_ENV: token})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", headers={"authorization": f"Bearer {token}"}).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the store server did not come up:\n{tail(home / 'server.log')}")
            time.sleep(0.2)
        yield url, token
    finally:
        stop_process_group(process)


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["default", "ray"])
async def test_the_runner_fan_out_runs_where_the_task_runner_puts_it(
    runner: str,
    tmp_path: Path,
    prefect_harness: None,
    store_server: tuple[str, str],
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same tiny iteration against the store server: with `ray`, each runner task in a Ray worker process of
    its own; with `default` (the control), on threads of the flow's process."""
    url, token = store_server
    monkeypatch.setenv(TOKEN_ENV, token)  # the flow's process (and its proxy) and, through the flow, the Ray workers
    name = f"fanout-{runner}"  # one store for both runs: a run name of its own each
    # Two iterations: the second shows the cost of the Ray path once its workers are up (one connection per run).
    changes: dict[str, Any] = {"run_name": name, "task_runner": runner, "store_url": url, "iterations": 2}
    if runner == "ray":
        # prefect-ray would take a Ray connection this process already has, whatever cluster it is to.
        assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
        cluster: RayCluster = request.getfixturevalue("ray_cluster")
        changes["ray_address"] = cluster.address
    config = small_config(tmp_path, **changes)
    started = time.perf_counter()
    summary = await train(config)
    seconds = time.perf_counter() - started

    assert summary["run_name"] == name and summary["checkpoint"].endswith("step-000002")
    store = HttpLightningStore(url, token=token)
    try:
        rollouts = [r for r in await store.query_rollouts(mode="train") if r.metadata["run_name"] == name]
    finally:
        await store.close()
    assert len(rollouts) == 2 * 8 * 4 and {r.status for r in rollouts} == {"succeeded"}

    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"{name}-iteration-0"]))
        )
        assert [run.state.is_completed() for run in runs] == [True]
        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [runs[0].id]}))
        runners = sorted((t for t in tasks if t.name.startswith("run_runner")), key=lambda t: t.name)
        assert [t.name for t in runners] == ["run_runner-train-0-0", "run_runner-train-0-1"]
        assert all(t.state.is_completed() for t in tasks), [(t.name, t.state) for t in tasks]
        results = [await t.state.result() for t in runners]
        # Cached by the *train* run's id, on Ray workers too: a retried train run finds its finished runner tasks.
        train_run = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
        keys = [Path(t.state.data.storage_key).name for t in runners]  # results persist under their cache keys
        assert all(key.startswith(f"{train_run[0].id}-{name}-0-run_runner-") for key in keys), keys
    assert [r["runner"] for r in results] == [0, 1] and all(r["finished"] == 32 for r in results)
    pids = {r["pid"] for r in results}
    if runner == "ray":  # each in a Ray worker process of the cluster, none in the flow's process
        assert len(pids) == 2 and os.getpid() not in pids
        assert pids <= cluster.worker_pids(), (pids, cluster.worker_pids())
    else:
        assert pids == {os.getpid()}
    times = ", ".join(f"rollouts {row['rollout_seconds']:.1f}s" for row in recorded_history(config))
    print(f"\n{runner}: flow {seconds:.1f}s; iterations {times}")
