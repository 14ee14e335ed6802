"""The PostgreSQL deployment, end to end on real processes: a Prefect server whose database is PostgreSQL, a
store server (`lightning store serve --db postgresql://...`) behind a bearer token, and the `train` flow
(`python -m flows.train`) run against both, with `store_url: http://127.0.0.1:PORT` and the token in
LIGHTNING_STORE_TOKEN. Each gets a fresh PostgreSQL database, dropped at the end.

The Prefect server on its default SQLite database answers 503 under bursts of task events
(benchmarks/prefect_burst.py measures it); this is the configuration that the README recommends instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import yaml
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterFlowRunId
from prefect_server import REPO_ROOT, PrefectServer, running_prefect_server
from support.store_server import TOKEN_ENV, StoreServer, store_server_on

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

RUN_NAME = "pg"
ITERATIONS = 1
BATCH_SIZE = 8
SAMPLES_PER_TASK = 4
TRAIN_TIMEOUT = 300.0


def _psycopg_url(url: str) -> str:
    """The URL as psycopg takes it (no SQLAlchemy driver suffix)."""
    scheme, rest = url.split("://", 1)
    return f"{scheme.split('+', 1)[0]}://{rest}"


def database_url(server_url: str, name: str) -> str:
    """`server_url` (postgresql[+driver]://user@host:port/db?query) with database `name` instead."""
    parts = urlsplit(_psycopg_url(server_url))
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, ""))


@contextlib.contextmanager
def fresh_database(server_url: str, prefix: str) -> Iterator[str]:
    """A new, empty database `<prefix>_<random>` on the server (postgresql:// URL), dropped at the end."""
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = _psycopg_url(server_url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield database_url(server_url, name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def small_config(tmp_path: Path, store_url: str) -> dict[str, Any]:
    """As tests/test_flows.py's, one iteration, the store on the store server."""
    return {
        "agent": "examples.copy_task.agent:copy_agent",
        "train_data": "examples.copy_task.data:train_tasks", "val_data": "examples.copy_task.data:val_tasks",
        "run_name": RUN_NAME, "iterations": ITERATIONS, "batch_size": BATCH_SIZE, "samples_per_task": SAMPLES_PER_TASK,
        "n_runners": 2, "runner_concurrency": 16, "sampling": {"temperature": 1.0, "max_tokens": 2},
        "eval_sampling": {"temperature": 0.0, "max_tokens": 2}, "max_prompt_length": 64, "max_response_length": 4,
        "algorithm": {"lr": 1e-3, "kl_coef": 0.0, "micro_batch_size": 64}, "checkpoint": {"keep_last": 5},
        "store_url": store_url, "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "output_dir": str(tmp_path / "runs"),
    }  # fmt: skip


@dataclass
class Deployment:
    prefect: PrefectServer
    prefect_db: str
    store: StoreServer
    store_db: str
    train: subprocess.CompletedProcess[str]
    tmp_path: Path


@pytest.fixture(scope="module")
def deployment(pg_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Both servers on PostgreSQL, and one finished `python -m flows.train` run against them."""
    tmp_path = tmp_path_factory.mktemp("pg_deployment")
    token = secrets.token_urlsafe(24)
    with (
        fresh_database(pg_server, "lightning_prefect") as prefect_db,
        fresh_database(pg_server, "lightning_store") as store_db,
        running_prefect_server(
            tmp_path / "prefect", 180.0, database_url=prefect_db.replace("postgresql://", "postgresql+asyncpg://", 1)
        ) as prefect,
        store_server_on(store_db, token, tmp_path / "store.log") as store,
    ):
        config_path = tmp_path / "config.yaml"
        config_path.write_text(yaml.safe_dump(small_config(tmp_path, store.url)))
        # Only the API URL and the token: nothing tells the flow where either database is.
        env = {**prefect.env, TOKEN_ENV: token}
        env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
        try:
            train = subprocess.run(
                [sys.executable, "-m", "flows.train", str(config_path)],
                cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TRAIN_TIMEOUT,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"the train flow did not finish within {TRAIN_TIMEOUT:g}s:\n{exc.stdout}\n{exc.stderr}")
        yield Deployment(prefect, prefect_db, store, store_db, train, tmp_path)


def test_the_store_server_answers_only_with_its_token(deployment: Deployment) -> None:
    store = deployment.store
    assert httpx.get(f"{store.url}/health").status_code == 401
    assert httpx.get(f"{store.url}/health", headers={"authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(f"{store.url}/v1/store/query_rollouts", json={}).status_code == 401
    assert httpx.get(f"{store.url}/docs").status_code == 401
    answer = httpx.get(f"{store.url}/health", headers={"authorization": f"Bearer {store.token}"})
    assert answer.status_code == 200 and answer.json()["status"] == "ok", answer.text


def test_the_train_flow_completes_on_both_postgres_servers(deployment: Deployment) -> None:
    train = deployment.train
    assert train.returncode == 0, (
        f"{train.stdout}\n{train.stderr}\n{deployment.prefect.log()}\n{deployment.store.log()}"
    )
    start = train.stdout.index("{\n")  # the summary, printed as indented JSON
    summary = json.loads(train.stdout[start : train.stdout.index("\n}", start) + 2])
    assert summary["run_name"] == RUN_NAME and summary["iterations"] == ITERATIONS

    with SyncPrefectClient(deployment.prefect.api_url) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=RUN_NAME)))
        by_name = {run.name: run for run in runs}
        assert by_name[RUN_NAME].state.is_completed(), by_name[RUN_NAME].state
        iteration = by_name[f"{RUN_NAME}-iteration-0"]
        assert iteration.state.is_completed(), iteration.state
        in_iteration = TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[iteration.id]))
        tasks = client.read_task_runs(task_run_filter=in_iteration)
        expected = {"enqueue_rollouts-train-0", "run_runner-train-0-0", "run_runner-train-0-1", "ppo_step-0"}
        assert {t.name for t in tasks} >= expected
        assert all(t.state.is_completed() for t in tasks), [(t.name, t.state) for t in tasks]


def test_the_run_s_rollouts_are_in_the_store_s_postgres_database(deployment: Deployment) -> None:
    import psycopg

    from lightning.store.client import HttpLightningStore

    async def train_rollouts() -> list[Any]:
        store = HttpLightningStore(deployment.store.url, token=deployment.store.token)
        try:
            rollouts = await store.query_rollouts(mode="train")
        finally:
            await store.close()
        return [r for r in rollouts if r.metadata.get("run_name") == RUN_NAME]

    rollouts = asyncio.run(train_rollouts())
    assert len(rollouts) == ITERATIONS * BATCH_SIZE * SAMPLES_PER_TASK, deployment.train.stderr[-5000:]
    assert {r.status for r in rollouts} == {"succeeded"}
    # The same rows, read from PostgreSQL itself.
    with psycopg.connect(deployment.store_db) as conn:
        rows = dict(conn.execute("SELECT status, count(*) FROM rollouts WHERE mode = 'train' GROUP BY status"))
        spans = conn.execute("SELECT count(*) FROM spans").fetchone()[0]
    assert rows == {"succeeded": len(rollouts)}
    assert spans > 0


def test_prefect_keeps_its_runs_in_postgres(deployment: Deployment) -> None:
    import psycopg

    with psycopg.connect(deployment.prefect_db) as conn:
        flow_runs = dict(conn.execute("SELECT name, state_type FROM flow_run"))
        task_runs = conn.execute("SELECT count(*) FROM task_run").fetchone()[0]
    assert flow_runs[RUN_NAME] == "COMPLETED", flow_runs
    assert task_runs > 0
    # The server made no SQLite database of its own.
    assert not list((deployment.tmp_path / "prefect").glob("*.db")), list((deployment.tmp_path / "prefect").iterdir())


def test_the_token_is_never_printed_or_stored(deployment: Deployment) -> None:
    import psycopg

    token = deployment.store.token
    train = deployment.train
    assert train.returncode == 0, train.stderr[-5000:]
    assert "Finished in state Completed" in train.stdout + train.stderr  # the flow's logs were captured
    assert token not in train.stdout and token not in train.stderr
    store_log = deployment.store.log_path.read_text(errors="replace")
    assert "bearer token required" in store_log, store_log  # it did log, just not the token
    assert token not in store_log
    assert token not in deployment.prefect.log_path.read_text(errors="replace")
    # Nor in any file the run or the servers wrote (run state, logs, MLflow's database, Prefect's home) ...
    for path in deployment.tmp_path.rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path
    # ... nor in what Prefect keeps of the run: its parameters and the flow's logs sent to the server.
    with psycopg.connect(deployment.prefect_db) as conn:
        logs = conn.execute("SELECT count(*) FROM log").fetchone()[0]
        leaks = conn.execute(
            "SELECT (SELECT count(*) FROM log WHERE strpos(message, %(t)s) > 0)"
            " + (SELECT count(*) FROM flow_run WHERE strpos(parameters::text, %(t)s) > 0)",
            {"t": token},
        ).fetchone()[0]
    assert logs > 0 and leaks == 0
