"""Runner processes against the store server over real HTTP: a fleet drains a queue, and a runner
killed mid-rollout has its rollout retried by another after unresponsive_seconds."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.servers import serving

from lightning.store import SqlLightningStore
from lightning.store.server import create_app
from lightning.types import RolloutConfig

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


@pytest.fixture
def served_store(tmp_path: Path) -> Iterator[tuple[str, SqlLightningStore]]:
    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=0.1)
    with serving(create_app(store)) as url:
        yield url, store
    asyncio.run(store.close())


def start_runner(url: str, worker_id: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{TESTS}", "LIGHTNING_TEST_LOG": str(log)}
    command = [sys.executable, "-m", "lightning.runner", "--store", url, "--agent", "support.agents:counting_agent"]
    command += ["--worker-id", worker_id, "--idle-wait", "0.5", *extra]
    # Output to a file: a pipe nobody reads would fill up and block the runner.
    with open(log.with_name(f"{worker_id}.stderr"), "ab") as output:
        return subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)


def stop_all(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def executions(log: Path) -> Counter[str]:
    return Counter(line.split()[0] for line in log.read_text().splitlines())


@pytest.mark.slow
def test_four_runner_processes_drain_500_rollouts_each_exactly_once(
    served_store: tuple[str, SqlLightningStore], tmp_path: Path
) -> None:
    url, store = served_store
    log = tmp_path / "executions.log"
    log.touch()

    async def enqueue() -> list[str]:
        queued = await store.enqueue_many_rollouts([{"input": {"i": i}} for i in range(500)])
        return [r.rollout_id for r in queued]

    ids = asyncio.run(enqueue())
    runners = [start_runner(url, f"p{i}", log) for i in range(4)]
    try:
        finished = asyncio.run(store.wait_for_rollouts(rollout_ids=ids, timeout=240))
    finally:
        stop_all(runners)
    assert len(finished) == 500 and all(r.status == "succeeded" for r in finished)
    runs = executions(log)
    assert set(runs) == set(ids) and set(runs.values()) == {1}
    attempts = asyncio.run(store.statistics())["attempts"]
    assert attempts == {"succeeded": 500}


@pytest.mark.slow
def test_killed_runner_process_has_its_rollout_retried_by_another(
    served_store: tuple[str, SqlLightningStore], tmp_path: Path
) -> None:
    url, store = served_store
    log = tmp_path / "executions.log"
    log.touch()
    config = RolloutConfig(unresponsive_seconds=1.5, max_attempts=2, retry_condition=["unresponsive"])
    queued = asyncio.run(store.enqueue_rollout({"hang_first_attempt": True}, config=config))
    first = start_runner(url, "victim", log, "--heartbeat-interval", "0.2")
    others: list[subprocess.Popen[bytes]] = []
    try:
        attempt = wait_for(lambda: running_attempt(store, queued.rollout_id), timeout=30)
        assert attempt.worker_id == "victim"
        others.append(start_runner(url, "survivor", log, "--heartbeat-interval", "0.2"))
        time.sleep(2.0)  # the victim's heartbeats keep its silent agent alive well past unresponsive_seconds
        assert running_attempt(store, queued.rollout_id) is not None
        killed_at = time.monotonic()
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        (done,) = asyncio.run(store.wait_for_rollouts(rollout_ids=[queued.rollout_id], timeout=60))
        retried_after = time.monotonic() - killed_at
    finally:
        stop_all([first, *others])
    assert done.status == "succeeded"
    first_attempt, second_attempt = asyncio.run(store.query_attempts(queued.rollout_id))
    assert first_attempt.status == "unresponsive" and first_attempt.worker_id == "victim"
    assert second_attempt.status == "succeeded" and second_attempt.worker_id == "survivor"
    # Silence starts at the victim's last heartbeat, up to one heartbeat interval (0.2 s) before the kill.
    assert 1.5 - 0.2 <= retried_after < 20


def running_attempt(store: SqlLightningStore, rollout_id: str) -> Any:
    attempt = asyncio.run(store.get_latest_attempt(rollout_id))
    return attempt if attempt is not None and attempt.status == "running" else None


def wait_for(probe: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found is not None:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s")


TOKEN = "s3cret-token"


@pytest.fixture
def served_store_with_token(tmp_path: Path) -> Iterator[tuple[str, SqlLightningStore]]:
    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None)
    with serving(create_app(store, token=TOKEN)) as url:
        yield url, store
    asyncio.run(store.close())


def run_runner(url: str, *extra: str, env_token: str | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    """A runner process to its end (bounded: 60 s), and how long it took."""
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_STORE_TOKEN"}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{TESTS}"
    if env_token is not None:
        env["LIGHTNING_STORE_TOKEN"] = env_token
    command = [sys.executable, "-m", "lightning.runner", "--store", url, "--agent", "support.agents:counting_agent"]
    started = time.monotonic()
    done = subprocess.run([*command, *extra], env=env, capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - started


@pytest.mark.parametrize(
    ("where", "told"),
    [
        ("--token", "The token given with --token is not the store server's"),
        ("env", "The token in $LIGHTNING_STORE_TOKEN is not the store server's"),
        ("url", "The token in the --store URL (http://:TOKEN@host:port) is not the store server's"),
        ("none", "No token was given and this store server needs one"),
    ],
)
def test_a_runner_with_a_refused_token_exits_at_once_saying_why(
    served_store_with_token: tuple[str, SqlLightningStore], where: str, told: str
) -> None:
    url, store = served_store_with_token
    asyncio.run(store.enqueue_rollout({"i": 0}))
    extra = ("--token", "WRONG") if where == "--token" else ()
    address = url.replace("http://", "http://:WRONG@") if where == "url" else url
    done, took = run_runner(address, *extra, env_token="WRONG" if where == "env" else None)
    assert done.returncode == 1, done.stderr
    last_lines = done.stderr.strip().splitlines()[-2:]
    assert last_lines[0].startswith(f"python -m lightning.runner: claim_rollouts: the store server at {url} refused")
    assert "HTTP 401" in last_lines[0]
    assert last_lines[1].startswith(told) and "--token" in last_lines[1] and "$LIGHTNING_STORE_TOKEN" in last_lines[1]
    assert "Traceback" not in done.stderr and "retrying" not in done.stderr and "WRONG" not in done.stderr
    assert took < 30  # its start-up; no back-off
    assert asyncio.run(store.statistics())["rollouts"] == {"queuing": 1}  # nothing claimed


def test_a_runner_with_the_right_token_runs(served_store_with_token: tuple[str, SqlLightningStore]) -> None:
    url, store = served_store_with_token
    queued = asyncio.run(store.enqueue_rollout({"i": 0}))
    done, _ = run_runner(url, "--max-rollouts", "1", env_token=TOKEN)
    assert done.returncode == 0, done.stderr
    assert asyncio.run(store.get_rollout_by_id(queued.rollout_id)).status == "succeeded"
