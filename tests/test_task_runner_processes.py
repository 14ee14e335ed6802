"""task_runner `processes`: each runner task's fleet runs in a runner process of the open run, on real parts (a
SQLite file store, the LLM proxy, the embedded inference server on the tiny model). The agents run there, not in
the flow's process; the processes are reused from phase to phase and end with the run; a stop reaches them; one
killed mid-phase fails its runner task and the next call gets a fresh one."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from lightning import stages, stopping
from lightning.config import TrainConfig, load_config
from lightning.run import Run
from lightning.runner.processes import RunnerProcessDied

pytestmark = pytest.mark.slow


def processes_config(tmp_path: Path, **changes: object) -> TrainConfig:
    data = {
        "run_name": "procs", "agent": "support.agents:pid_copy_agent", "task_runner": "processes",
        "train_data": "examples.copy_task.data:train_tasks", "val_data": "examples.copy_task.data:val_tasks",
        "batch_size": 8, "samples_per_task": 4, "n_runners": 2, "runner_concurrency": 4,
        "sampling": {"temperature": 1.0, "max_tokens": 2}, "max_prompt_length": 64, "max_response_length": 4,
        "checkpoint": {"log_to_mlflow": False}, "store_url": f"sqlite:///{tmp_path}/store.db",
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "output_dir": str(tmp_path / "runs"),
    }  # fmt: skip
    return load_config({**data, **changes})


@pytest.fixture
def pid_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "pids.log"
    monkeypatch.setenv("LIGHTNING_TEST_LOG", str(log))
    return log


@pytest.fixture
async def run(tmp_path: Path, pid_log: Path) -> AsyncIterator[Run]:
    opened = await Run.open(processes_config(tmp_path), train=False, track=False)
    try:
        yield opened
    finally:
        await opened.close()


@pytest.fixture(autouse=True)
def no_stop_left_over() -> Iterator[None]:
    yield
    stopping.clear()


async def enqueue(run: Run, iteration: int) -> list[str]:
    return await stages.enqueue_rollouts(run, iteration, await stages.update_resources(run))


async def both_runners(run: Run, ids: list[str]) -> list[dict[str, object]]:
    return list(await asyncio.gather(*(stages.run_runners(run, ids, index) for index in range(2))))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_the_fleets_run_in_runner_processes_reused_from_phase_to_phase(run: Run, pid_log: Path) -> None:
    first = await both_runners(run, ids := await enqueue(run, 0))
    summary = await stages.wait_for_rollouts(run, ids)
    assert summary["succeeded"] == 32 and summary["with_reward"] == 32
    assert sum(int(done["ran"]) for done in first) == 32
    agents = {int(line) for line in pid_log.read_text().split()}
    children = set(run.runner_processes().pids)
    assert len(children) == 2 and os.getpid() not in children
    assert agents <= children, "an agent ran outside the runner processes"

    await both_runners(run, ids := await enqueue(run, 1))
    assert (await stages.wait_for_rollouts(run, ids))["succeeded"] == 32
    assert set(run.runner_processes().pids) == children, "the second phase started new processes"
    await run.close()
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not any(alive(pid) for pid in children), "a runner process outlived its run"


async def test_a_stop_reaches_the_runner_processes(run: Run) -> None:
    ids = await stages.enqueue_rollouts(run, 0, await stages.update_resources(run))
    await stages.run_runners(run, ids[:4], 0)  # the process is up: what follows times the stop, not a start
    more = await enqueue(run, 1)
    asyncio.get_running_loop().call_later(0.5, stopping.request_stop, "SIGINT")
    started = time.monotonic()
    with pytest.raises(stopping.RunStopped, match="runner task 0 stopped"):
        # 32 rollouts, 4 at a time, 50 ms each at least: over a second, so the stop comes in the middle.
        await stages.run_runners(run, more, 0)
    assert time.monotonic() - started < 0.5 + 4 * stopping.POLL_SECONDS


async def test_a_runner_process_killed_mid_phase_fails_its_task_and_the_next_gets_a_fresh_one(run: Run) -> None:
    await stages.run_runners(run, await enqueue(run, 0), 0)
    (child,) = run.runner_processes().pids
    asyncio.get_running_loop().call_later(0.5, os.kill, child, 9)
    with pytest.raises(RunnerProcessDied, match=f"runner process {child} died during run \\(exit code -9\\)"):
        await stages.run_runners(run, await enqueue(run, 1), 0)
    assert run.runner_processes().pids == []
    done = await stages.run_runners(run, ids := await enqueue(run, 2), 0)
    assert done["finished"] == len(ids) == 32
    assert run.runner_processes().pids not in ([], [child])
