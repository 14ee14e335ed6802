"""One run, one owner (the run directory's lock), the free-space check before a checkpoint, and the pieces of a
graceful stop that need no run: a stop asked for ends a wait for rollouts within its poll, and a rollout phase's
time leaves out the break of a stopped run. The runs themselves are stopped in tests/test_faults.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning import owner, stopping
from lightning.config import load_config
from lightning.diskspace import NoSpaceLeft, check_free_space, checkpoint_bytes
from lightning.reporting import busy_seconds
from lightning.run import Run
from lightning.runner.fleet import wait_unless_stopped
from lightning.store import SqlLightningStore
from lightning.types import EnqueueRolloutRequest

HOLDER = """
import sys, time
from pathlib import Path
from lightning import owner
owner.acquire(Path(sys.argv[1]), "twin")
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen]:
    """Another live process holding the lock of `tmp_path / "run"`."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )  # fmt: skip
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    yield process
    process.kill()
    process.wait()


@pytest.fixture(autouse=True)
def no_stop_left_over() -> Iterator[None]:
    yield
    stopping.clear()


def test_a_run_held_by_a_live_process_is_refused_naming_it(tmp_path: Path, holder: subprocess.Popen) -> None:
    with pytest.raises(owner.RunLocked) as refused:
        owner.acquire(tmp_path / "run", "twin")
    message = str(refused.value)
    assert f"run 'twin' is being trained by pid {holder.pid} on {socket.gethostname()}" in message
    assert "kill -TERM" in message and "--set run_name=" in message


HEAVY_MODULES = ("sqlalchemy", "torch", "prefect", "pydantic", "transformers", "mlflow", "lightning.config")
"""What a twin of a live run must not import before it is refused: each took seconds on a loaded machine."""


def test_a_twin_python_m_flows_train_is_refused_before_any_heavy_import(
    tmp_path: Path, holder: subprocess.Popen
) -> None:
    """A second `python -m flows.train` of a live run (named here by its --set override) is refused in one line
    before it imports the config's model, the store (SQLAlchemy), Prefect or torch: importing lightning.config
    first made a twin wait 5.9 to 11.5 s at load 8 to 10 (issue 40, item 6)."""
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps({"run_name": "other", "agent": "no_such_module:agent", "output_dir": str(tmp_path)}))
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "flows.train", str(path), "--set", "run_name=run"],
        cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    # (The message's last part, the holder's command, spans the lines of its script.)
    assert f"error: run 'run' is being trained by pid {holder.pid} on " in done.stderr
    # -X importtime writes one line per module imported: "import time: self | cumulative | module".
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")}
    assert imported, done.stderr  # the listing is there to look at
    heavy = [m for m in HEAVY_MODULES if any(name == m or name.startswith(f"{m}.") for name in imported)]
    assert not heavy, f"a twin imported {heavy} before it was refused"


async def test_a_deployment_run_of_a_live_run_name_is_refused_before_anything_starts(
    tmp_path: Path, holder: subprocess.Popen
) -> None:
    """`Run.open` (what a deployment's flow run calls) takes the same lock."""
    config = load_config(
        {"run_name": "run", "agent": "examples.copy_task.agent:copy_agent", "output_dir": str(tmp_path)}
        | {"train_data": "examples.copy_task.data:train_tasks", "store_url": f"sqlite:///{tmp_path}/s.db"}
    )
    started = time.monotonic()
    with pytest.raises(owner.RunLocked, match=f"pid {holder.pid}"):
        await Run.open(config)
    assert time.monotonic() - started < 5
    assert not (tmp_path / "run" / "model").exists()  # nothing was built or started


def test_a_lock_whose_process_is_gone_is_taken_over_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / owner.LOCK_NAME).write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname()}))
    with caplog.at_level(logging.WARNING, logger="lightning.owner"):
        lock = owner.acquire(run_dir, "stale")
    assert lock is not None
    assert f"taking over the lock {run_dir / owner.LOCK_NAME} of pid {gone.pid}" in caplog.text
    assert json.loads((run_dir / owner.LOCK_NAME).read_text())["pid"] == os.getpid()
    assert owner.acquire(run_dir, "stale") is None  # this process holds it already
    lock.release()
    assert not (run_dir / owner.LOCK_NAME).exists()


def test_a_lock_of_another_host_is_refused_saying_how_to_clear_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / owner.LOCK_NAME).write_text(json.dumps({"pid": 1234, "host": "elsewhere"}))
    with pytest.raises(owner.RunLocked, match=f"if that process is gone, delete {run_dir / owner.LOCK_NAME}"):
        owner.acquire(run_dir, "remote")


def test_a_checkpoint_that_would_not_fit_fails_naming_the_directory_and_the_numbers(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 2 * 1024 * 1024)
    needed = checkpoint_bytes(None, model)
    assert needed == 3 * 2 * 1024 * 1024  # the weights and Adam's two moments
    check_free_space(tmp_path / "checkpoints", needed)  # this disk has 6 MB
    with pytest.raises(NoSpaceLeft) as full:
        check_free_space(tmp_path / "checkpoints", needed, reserve_mb=1e12)
    assert str(full.value).startswith(f"no space left on {tmp_path / 'checkpoints'}: ")
    assert " MB needed, " in str(full.value) and " free " in str(full.value)


def test_busy_seconds_leave_out_the_time_nothing_ran() -> None:
    # Two rollouts before a stop, one overlapping them, one after a break of 100 s.
    assert busy_seconds([(0.0, 2.0), (1.0, 3.0), (103.0, 104.5)]) == pytest.approx(4.5)


async def test_a_stop_ends_a_wait_for_rollouts_within_its_poll(tmp_path: Path) -> None:
    async with SqlLightningStore(f"sqlite:///{tmp_path}/store.db", watchdog_interval=None) as store:
        [rollout] = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"x": 1})])
        asyncio.get_running_loop().call_later(0.3, stopping.request_stop, "SIGINT")
        started = time.monotonic()
        finished = await wait_unless_stopped(store, [rollout.rollout_id], timeout=60)
    assert finished == [] and time.monotonic() - started < 0.3 + 2 * stopping.POLL_SECONDS
    with pytest.raises(stopping.RunStopped, match=r"ppo_step \(3\) not started: the run was asked to stop \(SIGINT\)"):
        stopping.check("ppo_step (3)")


STUCK = """
import sys, time
from flows.cli import GracefulStop
stop = GracefulStop(float(sys.argv[1]), "python -m flows.train run.yaml")
with stop.handling_signals():
    print("running", flush=True)
    stop.run(lambda: time.sleep(120))  # a flow that never notices the stop
"""


def stuck_command(grace: float) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", STUCK, str(grace)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )  # fmt: skip
    assert process.stdout is not None and process.stdout.readline().strip() == "running"
    return process


@pytest.mark.slow  # imports Prefect in a subprocess, twice
@pytest.mark.parametrize("how", ["a second SIGINT", "timeouts.stop"])
def test_a_command_that_does_not_stop_ends_at_once_on_a_second_signal_or_past_the_setting(how: str) -> None:
    process = stuck_command(grace=60 if how == "a second SIGINT" else 1)
    try:
        started = time.monotonic()
        process.send_signal(signal.SIGINT)
        if how == "a second SIGINT":
            time.sleep(0.5)
            process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=20)
    finally:
        process.kill()
    took = time.monotonic() - started
    assert process.returncode == 130, err
    assert took < 5, f"{how}: ended {took:.1f} s after the first signal"
    last = err.strip().splitlines()[-1]
    ending = "SIGINT again: ending now." if how == "a second SIGINT" else "the run did not stop within 1 s"
    assert last.startswith(ending) and last.endswith("Resume with: python -m flows.train run.yaml"), last
