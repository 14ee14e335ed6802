"""agent-lightning's `n_runners` is how many rollouts run at once: each of agl's runners awaits one rollout before it
takes the next. Our runner tasks run `runner_concurrency` (32 by default) each, so an agl script's `n_runners=10`
would be 320 rollouts at once: found running agl 0.3.0's calc_x `train_calc_agent.py` by hand, where each rollout
starts its own MCP calculator server (a subprocess) and most of 32 at once timed out starting on two cores. A Trainer
given agl's runner count runs one rollout per runner unless `runner_concurrency` is given."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning import TrainConfig, Trainer
from lightning.agl_execution import SharedMemoryExecutionStrategy
from lightning.litagent import rollout

TASKS = [{"n": i} for i in range(6)]


@rollout
def noop_agent(task: dict[str, Any]) -> float:
    return 1.0


@pytest.mark.parametrize(
    "trainer",
    [
        pytest.param(lambda: Trainer(n_runners=10), id="n_runners"),
        pytest.param(lambda: Trainer(n_workers=10), id="n_workers"),
        pytest.param(lambda: Trainer(strategy=SharedMemoryExecutionStrategy(n_runners=10)), id="strategy"),
        pytest.param(lambda: Trainer(strategy="shm", n_runners=10), id="strategy-name"),
    ],
)
def test_agl_s_runner_count_is_the_rollouts_at_once(trainer: Any) -> None:
    config = trainer().build_config(noop_agent, TASKS)
    assert (config.n_runners, config.runner_concurrency) == (10, 1)


def test_a_given_runner_concurrency_is_kept(tmp_path: Path) -> None:
    assert Trainer(n_runners=2, runner_concurrency=8).build_config(noop_agent, TASKS).runner_concurrency == 8
    given = Trainer(n_runners=2, config={"runner_concurrency": 4})
    assert given.build_config(noop_agent, TASKS).runner_concurrency == 4
    yaml = tmp_path / "run.yaml"
    yaml.write_text("runner_concurrency: 3\n")
    assert Trainer(n_runners=2, config=yaml).build_config(noop_agent, TASKS).runner_concurrency == 3


def test_without_agl_s_runner_count_our_defaults_hold() -> None:
    config = Trainer(config={"n_runners": 3}).build_config(noop_agent, TASKS)
    assert (config.n_runners, config.runner_concurrency) == (3, TrainConfig().runner_concurrency)
    assert Trainer().build_config(noop_agent, TASKS).runner_concurrency == TrainConfig().runner_concurrency


class InFlight:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0


IN_FLIGHT = InFlight()


@rollout
async def slow_agent(task: dict[str, Any]) -> float:
    with IN_FLIGHT.lock:
        IN_FLIGHT.now += 1
        IN_FLIGHT.most = max(IN_FLIGHT.most, IN_FLIGHT.now)
    await asyncio.sleep(0.5)
    with IN_FLIGHT.lock:
        IN_FLIGHT.now -= 1
    return 1.0


@pytest.fixture
def prefect_server() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.mark.slow
def test_a_dev_run_with_two_runners_runs_two_rollouts_at_once(
    prefect_server: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    report = Trainer(n_runners=2).dev(slow_agent, TASKS)
    assert report["rollouts"]["succeeded"] == len(TASKS)
    assert IN_FLIGHT.most == 2
