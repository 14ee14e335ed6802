"""An agent that blocks its runner's event loop (`time.sleep` inside `async def`), run by a runner task's fleet on a
real SQLite store: its rollout fails with the line that blocked, the other rollouts finish, a loop blocked for good
is given up, and a stop ends the fleet whatever the agent does."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow.tracking import MlflowClient
from prefect_server import PrefectServer, start_logged, stop_process_group, tail

from lightning import stopping
from lightning.agent import rollout
from lightning.config import TrainConfig, validate_config
from lightning.run import recorded_history
from lightning.runner.blocking import STOP_GRACE_SECONDS, EventLoopBlocked
from lightning.runner.fleet import run_fleet_until
from lightning.store import SqlLightningStore
from lightning.tracing import find_final_reward
from lightning.types import AttemptedRollout, RolloutConfig

pytest_plugins = ["prefect_server"]

QUEUE = "blocked"
HERE = Path(__file__).name


def line_of(text: str) -> int:
    """The line of this file that holds `text` (the blocking call a test expects named)."""
    return next(n for n, line in enumerate(Path(__file__).read_text().splitlines(), 1) if text in line)


@rollout
async def sleeping_agent(task: dict[str, Any], rollout: AttemptedRollout) -> float:
    """Blocks the loop for `block` seconds on its first attempt (in a task it starts, with `gathered`); else a
    well-behaved agent's 0.2 s."""
    if task.get("block") and rollout.attempt.sequence_id == 1:
        if task.get("gathered"):
            await asyncio.gather(blocking_tool(task["block"]), asyncio.sleep(0))
        else:
            time.sleep(task["block"])  # the agent's blocking call
    await asyncio.sleep(0.2)
    return 1.0


async def blocking_tool(seconds: float) -> None:
    time.sleep(seconds)  # the tool's blocking call


@pytest.fixture
async def store(tmp_path: Path) -> Any:
    store = SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=0.1)
    yield store
    await store.close()


@pytest.fixture(autouse=True)
def no_stop_left_over() -> Any:
    yield
    stopping.clear()


async def enqueue(store: Any, tasks: list[dict[str, Any]], config: RolloutConfig) -> list[str]:
    queued = await store.enqueue_many_rollouts([{"input": task, "config": config, "queue": QUEUE} for task in tasks])
    return [rollout.rollout_id for rollout in queued]


async def fleet(store: Any, ids: list[str], *, blocked_after: float, timeout: float = 60) -> dict[str, Any]:
    return await run_fleet_until(
        sleeping_agent, store, ids, queue=QUEUE, concurrency=4, index=0, timeout=timeout, blocked_after=blocked_after,
        on_rollout_end=lambda: None,
    )  # fmt: skip


async def fleet_threads_ended() -> None:
    """The fleets left behind end once their agents' blocking calls return (before the store closes): their threads
    end, or go back to the process's idle loops under another name."""
    deadline = time.monotonic() + 20
    while any(thread.name.startswith(f"{QUEUE}-fleet") for thread in threading.enumerate()):
        assert time.monotonic() < deadline, "a fleet left behind did not end within 20 s of its block"
        await asyncio.sleep(0.1)


async def exception_of(store: Any, rollout_id: str, attempt_id: str) -> dict[str, Any]:
    spans = await store.query_spans(rollout_id, attempt_id)
    (event,) = [event for span in spans for event in span.events if event.name == "exception"]
    return event.attributes


@pytest.mark.parametrize(
    ("gathered", "blocking_call"), [(False, "# the agent's blocking call"), (True, "# the tool's")]
)
async def test_an_agent_that_blocks_the_loop_fails_its_rollout_naming_the_line_and_the_others_finish(
    store: Any, caplog: pytest.LogCaptureFixture, gathered: bool, blocking_call: str
) -> None:
    config = RolloutConfig(timeout_seconds=60, max_attempts=2, retry_condition=["failed", "timeout"])
    ids = await enqueue(store, [{"block": 2.5, "gathered": gathered}] + [{} for _ in range(7)], config)
    caplog.set_level(logging.INFO, logger="lightning.runner")
    started = time.monotonic()
    done = await fleet(store, ids, blocked_after=1.0)
    took = time.monotonic() - started

    rollouts = {rollout.rollout_id: rollout for rollout in await store.query_rollouts(rollout_id_in=ids)}
    assert done["finished"] == 8 and {rollout.status for rollout in rollouts.values()} == {"succeeded"}
    attempts = await store.query_attempts(ids[0])
    assert [attempt.status for attempt in attempts] == ["failed", "succeeded"]  # retried at once, not at its timeout
    exception = await exception_of(store, ids[0], attempts[0].attempt_id)
    where = f"{HERE}:{line_of(blocking_call)} in {'blocking_tool' if gathered else 'sleeping_agent'}"
    assert exception["exception.type"] == "EventLoopBlocked"
    assert "the agent blocked its runner's event loop for 1." in exception["exception.message"]
    assert where in exception["exception.message"], exception["exception.message"]
    assert [find_final_reward(await store.query_spans(rollout_id, "latest")) for rollout_id in ids] == [1.0] * 8
    line = next(record for record in caplog.records if "blocked its runner's event loop" in record.getMessage())
    # The attempt started, and blocked, within milliseconds of its claim.
    print(f"\nthe failure line {line.created - attempts[0].start_time:.1f} s into the block: {line.getMessage()}")
    assert line.created - attempts[0].start_time < 5
    assert took < 20, f"the fleet took {took:.1f} s with one 2.5 s block"


async def test_a_loop_blocked_past_its_rollouts_timeouts_is_given_up_and_the_runner_task_fails_with_the_line(
    store: Any,
) -> None:
    config = RolloutConfig(timeout_seconds=2, max_attempts=2, retry_condition=["failed", "timeout"])
    ids = await enqueue(store, [{"block": 6.0}] + [{} for _ in range(3)], config)
    started = time.monotonic()
    with pytest.raises(EventLoopBlocked) as blocked:
        await fleet(store, ids, blocked_after=1.0)
    took = time.monotonic() - started
    message = str(blocked.value)
    assert message.startswith("runner task 0: the agent blocked its runner's event loop for 1."), message
    assert f"{HERE}:{line_of('# the agent' + chr(39) + 's blocking call')} in sleeping_agent" in message
    assert re.search(r"the loop was given up after \d+ s blocked", message), message
    assert took < 8, f"the runner task gave up its blocked loop after {took:.1f} s (rollout timeout 2 s)"
    attempts = await store.query_attempts(ids[0])
    assert attempts[0].status == "failed"  # by the watchdog, with the line; retried by a fresh fleet
    left = await fleet(store, ids, blocked_after=1.0)
    assert left["finished"] == 4
    statuses = {rollout.status for rollout in await store.query_rollouts(rollout_id_in=ids)}
    assert statuses == {"succeeded"}, statuses
    await fleet_threads_ended()


async def test_a_stop_ends_a_fleet_whose_loop_an_agent_blocks(store: Any) -> None:
    config = RolloutConfig(timeout_seconds=60)
    ids = await enqueue(store, [{"block": 5.0}, {}], config)

    async def stop_soon() -> None:
        await asyncio.sleep(1.5)  # the agent is blocking the fleet's loop by then
        stopping.request_stop("a test")

    asyncio.get_running_loop().create_task(stop_soon())
    started = time.monotonic()
    with pytest.raises(stopping.RunStopped):
        await fleet(store, ids, blocked_after=30.0)
    took = time.monotonic() - started
    assert took < 1.5 + stopping.POLL_SECONDS + STOP_GRACE_SECONDS + 2.0, f"stopped {took - 1.5:.1f} s after the stop"
    await fleet_threads_ended()


# --- a training run (`python -m flows.train` on a real Prefect server) ------------------------------------------

RUN_TIMEOUT = 300.0
BLOCKS = next(
    n for n, text in enumerate((Path(__file__).parent / "support" / "misbehaving.py").read_text().splitlines(), 1)
    if "# BLOCKS" in text
)  # fmt: skip
"""The line of `support.misbehaving` whose `time.sleep` blocks the loop."""


def run_config(tmp_path: Path, name: str, block_attempts: int, **changes: Any) -> tuple[TrainConfig, list[str]]:
    """One iteration of four tasks, two samples each: the first task's agent blocks the loop for 10 minutes on its
    first `block_attempts` attempts; `timeouts.blocked_loop` 2 s. The command that trains it."""
    tasks = [{"letters": letters, "target": letters[-1]} for letters in ("bdfg", "jkmp", "gfdb", "pmkj")]
    tasks[0] |= {"misbehave": "block", "block_seconds": 600, "block_attempts": block_attempts}
    data_path, val_path = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    data_path.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    val_path.write_text("".join(json.dumps(task) + "\n" for task in tasks[1:]))
    data = {
        "run_name": name, "agent": "support.misbehaving:misbehaving_agent", "train_data": str(data_path),
        "val_data": str(val_path), "iterations": 1, "batch_size": 4, "samples_per_task": 2, "n_runners": 1,
        "runner_concurrency": 4, "sampling": {"temperature": 1.0, "max_tokens": 2},
        "eval_sampling": {"temperature": 0.0, "max_tokens": 2}, "max_prompt_length": 64, "max_response_length": 4,
        "algorithm": {"lr": 1e-3, "kl_coef": 0.0, "micro_batch_size": 64}, "checkpoint": {"log_every": 100},
        "timeouts": {"blocked_loop": 2}, "store_url": f"sqlite:///{tmp_path / 'store.db'}",
        "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "output_dir": str(tmp_path / "runs"), **changes,
    }  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return validate_config(data), [sys.executable, "-m", "flows.train", str(path)]


def with_tests_on_path(env: dict[str, str]) -> dict[str, str]:
    tests = str(Path(__file__).resolve().parent)
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [tests, env.get("PYTHONPATH")]))}


def mlflow_status(config: TrainConfig) -> str:
    client = MlflowClient(config.tracking_uri)
    experiment = client.get_experiment_by_name(config.experiment)
    assert experiment is not None
    [found] = client.search_runs([experiment.experiment_id], f"attributes.run_name = '{config.run_name}'")
    return found.info.status


def wait_for_line(process: subprocess.Popen[bytes], log: Path, text: str, timeout: float) -> float:
    """When `text` first appears in `log` (time.monotonic)."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        if (process.poll() is not None and text not in log.read_text(errors="replace")) or time.monotonic() > deadline:
            pytest.fail(f"no {text!r} in the log (exit code {process.poll()})\n{tail(log)}")
        time.sleep(0.1)
    return time.monotonic()


@pytest.mark.slow
@pytest.mark.parametrize("task_runner", ["default", "processes"])
def test_a_run_whose_agent_blocks_the_loop_for_good_goes_on_with_the_line(
    prefect_server: PrefectServer, tmp_path: Path, task_runner: str
) -> None:
    """The blocked loop is given up once its rollouts are past their 6 s timeout; the runner task fails with the
    line and Prefect's retry runs them on a fresh fleet (a fresh runner process with task_runner processes)."""
    rollout = {"timeout_seconds": 6, "max_attempts": 3, "retry_condition": ["failed", "timeout", "unresponsive"]}
    config, command = run_config(tmp_path, f"blocked-{task_runner}", 1, task_runner=task_runner, rollout=rollout)
    log = tmp_path / "train.log"
    started = time.monotonic()
    process = start_logged(command, log, env=with_tests_on_path(prefect_server.env), cwd=tmp_path)
    try:
        assert process.wait(RUN_TIMEOUT) == 0, tail(log)
    finally:
        stop_process_group(process)
    took = time.monotonic() - started
    text = log.read_text(errors="replace")
    where = f"support/misbehaving.py:{BLOCKS} in misbehaving_agent"
    assert "the agent blocked its runner's event loop for 2." in text and where in text, tail(log)
    assert "the loop was given up after" in text, tail(log)
    [row] = recorded_history(config)
    assert (row["rollouts_ok"], row["rollouts_failed"]) == (8, 0), row
    assert mlflow_status(config) == "FINISHED"
    given_up = next(line for line in text.splitlines() if "the loop was given up after" in line)
    print(f"\n{task_runner}: the run finished in {took:.0f} s; {given_up[:400]}")


@pytest.mark.slow
def test_sigint_stops_a_run_whose_agent_blocks_the_loop_within_the_stop_time(
    prefect_server: PrefectServer, tmp_path: Path
) -> None:
    """Every attempt of the first task blocks the loop for 10 minutes (rollouts time out at 60 s): the line comes at
    `timeouts.blocked_loop`, and a SIGINT then stops the run within `timeouts.stop`, MLflow's run KILLED."""
    config, command = run_config(tmp_path, "blocked-sigint", 99, rollout={"timeout_seconds": 60})
    log = tmp_path / "train.log"
    process = start_logged(command, log, env=with_tests_on_path(prefect_server.env), cwd=tmp_path)
    try:
        wait_for_line(process, log, f"support/misbehaving.py:{BLOCKS} in misbehaving_agent", RUN_TIMEOUT)
        stopped_at = time.monotonic()
        process.send_signal(signal.SIGINT)
        said = wait_for_line(process, log, "Resume with:", config.timeouts.stop + 30) - stopped_at
        code = process.wait(config.timeouts.stop + 30)
        took = time.monotonic() - stopped_at
    finally:
        stop_process_group(process)
    text = log.read_text(errors="replace")
    assert code == 128 + signal.SIGINT, f"exit code {code}\n{tail(log)}"
    assert took < config.timeouts.stop and "did not stop within" not in text, f"stopped in {took:.1f} s\n{tail(log)}"
    assert mlflow_status(config) == "KILLED"
    print(f"\nSIGINT during the block: its last line {said:.1f} s after, exit {took:.1f} s after: "
          f"{text.strip().splitlines()[-1][:300]}")  # fmt: skip
