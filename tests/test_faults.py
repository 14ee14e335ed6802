"""Kill anything at any moment: a training run (`python -m flows.train`, three iterations, on a real Prefect server)
has its flow process killed with SIGKILL at a point of an iteration chosen from outside (the test watches the run's
files and store and sends the signal), or its newest checkpoint damaged, and is started again where the flow died;
one run of five iterations has a part killed in each of iterations 1-4 (its inference server, its LLM proxy, a
runner process, its trainer) and gets over each in flight. Whatever was killed, at the end:

- no rollout was lost: one rollout per (iteration, task, sample), each succeeded;
- none was trained on twice: the optimizer took exactly one step per iteration;
- the history is complete: every iteration once in the checkpoint's record and in MLflow;
- no process was left behind: none of the run's processes outlives it, even after its flow was killed;
- the run finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from mlflow.tracking import MlflowClient
from prefect_server import PrefectServer, prefect_env, start_logged, stop_process_group, tail

from lightning.checkpoint import latest_checkpoint, load_checkpoint
from lightning.config import TrainConfig, validate_config
from lightning.run import recorded_history
from lightning.store import SqlLightningStore

pytest_plugins = ["prefect_server"]
pytestmark = pytest.mark.slow

ITERATIONS = 3
BATCH, SAMPLES = 8, 4
RUN_TIMEOUT = 240.0


def fault_config(tmp_path: Path, name: str) -> dict[str, Any]:
    """Three small iterations, the rollouts two at a time (a window for the kill), eight held-out tasks."""
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"letters": c * 4, "target": c}) + "\n" for c in "bdfgjkmp"))
    return {
        "agent": "examples.copy_task.agent:copy_agent",
        "train_data": "examples.copy_task.data:train_tasks",
        "run_name": name, "iterations": ITERATIONS, "batch_size": BATCH, "samples_per_task": SAMPLES,
        "n_runners": 1, "runner_concurrency": 2, "val_data": str(val),
        "sampling": {"temperature": 1.0, "max_tokens": 2}, "eval_sampling": {"temperature": 0.0, "max_tokens": 2},
        "max_prompt_length": 64, "max_response_length": 4,
        "algorithm": {"lr": 1e-3, "kl_coef": 0.0, "micro_batch_size": 64, "entropy_coef": 0.01},
        "checkpoint": {"keep_last": 5, "log_every": 100},
        "rollout": {"timeout_seconds": 60, "max_attempts": 3, "retry_condition": ["failed", "timeout", "unresponsive"]},
        "store_url": f"sqlite:///{tmp_path / 'store.db'}", "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "output_dir": str(tmp_path / "runs"),
    }  # fmt: skip


@dataclass
class Scenario:
    target: str
    """flow, trainer, inference server, LLM proxy, or checkpoint (damaged, not killed)."""
    point: str
    """rollouts (iteration 1's, part done; 1+k's with max_staleness k), ppo_step (iteration 1's batch written),
    checkpoint (step 2 saved)."""
    resumes: bool
    """The flow itself dies, so the run is started again; else the run recovers in flight."""
    staleness: int = 0
    """algorithm.max_staleness: 1 kills the flow while the next iteration's rollouts overlap the update."""
    task_runner: str = "default"
    """processes: the runners and agents in runner processes of the run (killed with the flow, or alone)."""


SCENARIOS = [
    Scenario("flow", "ppo_step", resumes=True, staleness=1),
    Scenario("flow", "rollouts", resumes=True, task_runner="processes"),
]
IN_FLIGHT = [("inference server", "rollouts"), ("LLM proxy", "rollouts"), ("runner process", "rollouts"),
             ("trainer", "ppo_step")]  # fmt: skip
"""The parts a run gets over without a restart, killed in this order in one run, one in each of iterations 1-4 (each
was a run of its own: three minutes of a CI worker apiece, mostly the same start-up)."""
RESUMED = [("flow", "rollouts"), ("flow", "ppo_step"), ("flow", "checkpoint"), ("checkpoint", "checkpoint")]
"""The faults the run is started again after, in this order in one run, one in each of iterations 1-4: the flow
killed in the rollouts, in the PPO step (the batch written), just after the checkpoint; the flow killed just after
the checkpoint and that checkpoint damaged."""
ASYNC = int(os.environ.get("LIGHTNING_FAULTS_MAX_STALENESS", "0"))
"""`LIGHTNING_FAULTS_MAX_STALENESS=1 pytest tests/test_faults.py -k survives`: every scenario with
algorithm.max_staleness 1 (CI runs the one above; the whole suite in async mode by hand, docs/operations.md)."""
if ASYNC:
    SCENARIOS = [
        Scenario(s.target, s.point, s.resumes, staleness=ASYNC, task_runner=s.task_runner)
        for s in SCENARIOS
        if not s.staleness
    ]


def scenario_id(scenario: Scenario) -> str:
    async_mode = f"-max_staleness-{scenario.staleness}" if scenario.staleness else ""
    processes = "-task_runner-processes" if scenario.task_runner == "processes" else ""
    return f"{scenario.target}@{scenario.point}{async_mode}{processes}".replace(" ", "-")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=scenario_id)
def test_the_run_survives(scenario: Scenario, prefect_server: PrefectServer, tmp_path: Path) -> None:
    data = fault_config(tmp_path, "faults")
    data["algorithm"]["max_staleness"] = scenario.staleness
    data["task_runner"] = scenario.task_runner
    if scenario.point == "rollouts":  # iteration 1's rollouts must be seen part done, however fast they run
        data["agent"] = PACED_AGENT
    config = validate_config(data)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(data))
    command = [sys.executable, "-m", "flows.train", str(config_path)]
    log = tmp_path / "train.log"
    env = with_support(prefect_server.env)

    first = start_logged(command, log, env=env, cwd=tmp_path)
    try:
        asyncio.run(wait_for(scenario.point, 1, config, first, log))
        family = run_processes(first.pid)
        if scenario.target == "checkpoint":
            os.kill(first.pid, signal.SIGKILL)
            damage_newest_checkpoint(config)
        else:
            victim = first.pid if scenario.target == "flow" else find(family, scenario.target, log, config)
            os.kill(victim, signal.SIGKILL)
        if scenario.resumes:
            first.wait(30)
            assert_gone(family, log)  # the flow's children die with it
        else:
            assert first.wait(RUN_TIMEOUT) == 0, tail(log)
    finally:
        stop_process_group(first)

    if scenario.resumes:
        mark(log, f"{scenario.target} killed at {scenario.point}; started again")
        run_to_the_end(command, log, env, tmp_path)

    assert_invariants(config, log)
    if scenario.staleness:  # every iteration counted its stale decisions, the resumed ones too
        assert all("stale_dropped" in row for row in recorded_history(config)), recorded_history(config)
    print_outcome(log, f"{scenario.target} @ {scenario.point}")


def test_the_run_survives_its_parts_killed_in_flight(prefect_server: PrefectServer, tmp_path: Path) -> None:
    """The inference server killed in iteration 1's rollouts, the LLM proxy in iteration 2's, a runner process in
    iteration 3's, the trainer in iteration 4's PPO step (task_runner processes): the run restarts or retries each
    part and finishes without a restart of its own, nothing lost or trained twice."""
    iterations = 1 + len(IN_FLIGHT) + ASYNC
    data = {**fault_config(tmp_path, "in-flight"), "iterations": iterations, "agent": PACED_AGENT}
    data["algorithm"]["max_staleness"] = ASYNC
    data["task_runner"] = "processes"
    config = validate_config(data)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(data))
    log = tmp_path / "train.log"
    command = [sys.executable, "-m", "flows.train", str(config_path)]
    run = start_logged(command, log, env=with_support(prefect_server.env), cwd=tmp_path)
    try:
        for iteration, (target, point) in enumerate(IN_FLIGHT, start=1):
            asyncio.run(wait_for(point, iteration, config, run, log))
            os.kill(find(run_processes(run.pid), target, log, config), signal.SIGKILL)
            print(f"killed the {target} in iteration {iteration}'s {point}")
        assert run.wait(RUN_TIMEOUT) == 0, tail(log)
    finally:
        stop_process_group(run)
    assert_invariants(config, log, iterations)
    print_outcome(log, "in flight")


def test_the_run_survives_its_flow_killed_and_resumes_each_time(prefect_server: PrefectServer, tmp_path: Path) -> None:
    """One run's flow process SIGKILLed in iteration 1's rollouts, in iteration 2's PPO step, just after iteration
    3's checkpoint, and just after iteration 4's with that checkpoint then damaged (its weights cut in half): each
    time its children die with it, and the same command started again resumes where it stopped (from checkpoint 4
    after the damage) and finishes, nothing lost or trained twice."""
    iterations = 2 + len(RESUMED) + ASYNC
    data = {**fault_config(tmp_path, "resumed"), "iterations": iterations, "agent": PACED_AGENT}
    data["algorithm"]["max_staleness"] = ASYNC
    config = validate_config(data)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(data))
    log = tmp_path / "train.log"
    command = [sys.executable, "-m", "flows.train", str(config_path)]
    # Slower rollouts (0.3 s each, two at a time): an iteration's rollouts then take 7 s or more. At the default
    # pace their window of about 3 s once passed unseen by the watcher on CI's loaded machine, and the run went on
    # to its end.
    env = {**with_support(prefect_server.env), "LIGHTNING_TEST_PACE_SECONDS": "0.3"}
    for iteration, (target, point) in enumerate(RESUMED, start=1):
        run = start_logged(command, log, env=env, cwd=tmp_path)
        try:
            asyncio.run(wait_for(point, iteration, config, run, log))
            family = run_processes(run.pid)
            os.kill(run.pid, signal.SIGKILL)
            run.wait(30)
            if target == "checkpoint":
                damage_newest_checkpoint(config)
            assert_gone(family, log)  # the flow's children die with it
        finally:
            stop_process_group(run)
        mark(log, f"{target} killed in iteration {iteration}'s {point}; started again")
    run_to_the_end(command, log, env, tmp_path)
    assert_invariants(config, log, iterations)
    print_outcome(log, "resumed")


# --- points and victims -------------------------------------------------------------------------------


async def wait_for(point: str, iteration: int, config: TrainConfig, process: Any, log: Path) -> None:
    """Return when the run reaches `point` of `iteration`: its rollouts part done (with max_staleness k, iteration
    i + k's, which run beside iteration i's update), its PPO step (its batch written), or just after its checkpoint
    (iteration i's is step i + 1)."""
    if point == "rollouts":
        await wait_for_rollouts(config, iteration + config.algorithm.max_staleness, process, log)
    elif point == "ppo_step":
        await wait_for_file(config.run_dir / "batches" / f"iteration-{iteration:06d}", process, log)
    else:
        await wait_for_file(config.run_dir / "checkpoints" / f"step-{iteration + 1:06d}", process, log)


async def wait_for_file(path: Path, process: Any, log: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while not path.exists():
        _still_running(process, deadline, log, f"never wrote {path.name}")
        await asyncio.sleep(0.01)


def _still_running(process: subprocess.Popen, deadline: float, log: Path, failure: str) -> None:
    if process.poll() is not None or time.monotonic() > deadline:
        pytest.fail(f"{failure} (exit code {process.poll()})\n{tail(log)}")


def run_processes(flow_pid: int) -> list[psutil.Process]:
    return [psutil.Process(flow_pid), *psutil.Process(flow_pid).children(recursive=True)]


def find(family: list[psutil.Process], target: str, log: Path, config: TrainConfig) -> int:
    # Runner processes are spawned as the trainer is: told apart by the stacks file each registers.
    runners = {int(path.stem.split("-")[-1]) for path in (config.run_dir / "stacks").glob("runner-*.txt")}
    if target == "runner process":
        family = [process for process in family if process.pid in runners]
    elif target == "trainer":
        family = [process for process in family if process.pid not in runners]
    marks = {
        "runner process": "multiprocessing.spawn",
        "trainer": "multiprocessing.spawn",
        "inference server": "lightning.inference",
        "LLM proxy": "proxy serve",
    }
    for process in family:
        with contextlib.suppress(psutil.Error):
            if marks[target] in " ".join(process.cmdline()):
                return process.pid
    pytest.fail(f"no {target} among the run's processes {[p.pid for p in family]}\n{tail(log)}")


def assert_gone(family: list[psutil.Process], log: Path, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.2)
    pytest.fail(f"processes of the killed run outlived it: {[(p.pid, p.cmdline()) for p in alive]}\n{tail(log)}")


def damage_newest_checkpoint(config: TrainConfig) -> None:
    newest = latest_checkpoint(config.run_dir / "checkpoints")
    assert newest is not None
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


TELLING = ("requeued", "restarting", "damaged", "lost its update", "again", "resuming", "Retry ", "TrainerCrashed")
"""Words of the log lines that say how the run got over the fault."""


def _telling(line: str) -> bool:
    return any(word in line for word in TELLING)


def print_outcome(log: Path, title: str) -> None:
    """What the run's log says it did about the faults, for the test's output."""
    outcome = [line for line in log.read_text().splitlines() if _telling(line)]
    print(f"\n{title}: " + " | ".join(sorted(set(outcome)))[:3000])


def mark(log: Path, line: str) -> None:
    """A line between one start of the run and the next in its log."""
    with open(log, "a") as separator:
        separator.write(f"\n=== {line} ===\n")


def run_to_the_end(command: list[str], log: Path, env: dict[str, str], cwd: Path) -> None:
    """Start the run (again) and wait for it to finish well."""
    process = start_logged(command, log, env=env, cwd=cwd)
    try:
        assert process.wait(RUN_TIMEOUT) == 0, tail(log)
    finally:
        stop_process_group(process)


# --- what must hold ---------------------------------------------------------------------------------------


def mlflow_run(config: TrainConfig) -> Any:
    client = MlflowClient(config.tracking_uri)
    [run] = client.search_runs(
        [client.get_experiment_by_name(config.experiment).experiment_id],
        filter_string=f"attributes.run_name = '{config.run_name}'",
    )
    return run


def assert_invariants(config: TrainConfig, log: Path, iterations: int = ITERATIONS) -> None:
    rollouts = asyncio.run(_train_rollouts(config))
    keys = Counter((r.metadata["iteration"], r.metadata["task_index"]) for r in rollouts)
    assert set(keys) == {(i, t) for i in range(iterations) for t in range(BATCH)}, keys
    assert set(keys.values()) == {SAMPLES}, keys
    assert Counter(r.status for r in rollouts) == {"succeeded": len(rollouts)}, Counter(r.status for r in rollouts)

    final = load_checkpoint(latest_checkpoint(config.run_dir / "checkpoints"))
    assert final.step == iterations
    adam_steps = {int(state["step"]) for state in final.trainer_state["optimizer"]["state"].values()}
    assert adam_steps == {iterations}, f"optimizer steps {adam_steps}: an iteration trained twice or not at all"

    assert [row["iteration"] for row in recorded_history(config)] == list(range(iterations))
    client = MlflowClient(config.tracking_uri)
    [run] = client.search_runs(
        [client.get_experiment_by_name(config.experiment).experiment_id],
        filter_string=f"attributes.run_name = '{config.run_name}'",
    )
    steps = [metric.step for metric in client.get_metric_history(run.info.run_id, "reward")]
    assert sorted(steps) == list(range(iterations)), f"MLflow has reward at steps {steps}\n{tail(log)}"


async def _train_rollouts(config: TrainConfig) -> list[Any]:
    async with SqlLightningStore(config.store_url, watchdog_interval=None) as store:
        return await store.query_rollouts(mode="train", queue=config.run_name)


# --- stopping: Ctrl-C in a terminal, SIGINT and SIGTERM at three points, a twin ---------------------------------

PACED_AGENT = "support.agents:paced_copy_agent"
"""The copy agent 50 ms slower per rollout, for the kills during rollouts."""
SLOW_AGENT = "support.agents:slow_copy_agent"
"""The copy agent a quarter of a second slower per rollout: iteration 0's rollouts take a few seconds to stop in."""
TWIN_REFUSED_SECONDS = 5.0


def stop_config(tmp_path: Path, name: str) -> tuple[dict[str, Any], TrainConfig, Path]:
    """The fault config with the slow agent and the default rollout policy, one attempt a rollout: a rollout that a
    stop cancelled and that then fails on resume stays failed, where retries would hide it."""
    data = {**fault_config(tmp_path, name), "agent": SLOW_AGENT, "rollout": {"timeout_seconds": 60}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return data, validate_config(data), path


def with_support(env: dict[str, str]) -> dict[str, str]:
    """The environment with tests/ on PYTHONPATH (the slow and paced agents are `support.agents`)."""
    tests = str(Path(__file__).resolve().parent)
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [tests, env.get("PYTHONPATH")]))}


class Terminal:
    """A command in a pseudo-terminal of its own, as a user's shell runs it: Ctrl-C (`interrupt`) makes the terminal
    send SIGINT to its whole foreground process group. What it prints goes to `log`."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path, log: Path) -> None:
        import pty

        self.log = log
        self.returncode: int | None = None
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: exec the command, the terminal its controlling one
            os.chdir(cwd)
            os.execve(command[0], command, env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log, "ab") as out:
            while True:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:  # the terminal closed: the command ended
                    return
                if not data:
                    return
                out.write(data)
                out.flush()

    def interrupt(self) -> None:
        os.write(self.fd, b"\x03")

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("terminal", timeout)
            time.sleep(0.05)
        self._reader.join(5)
        os.close(self.fd)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.wait(10)


async def wait_for_rollouts(config: TrainConfig, iteration: int, process: Any, log: Path) -> None:
    """Return when the run's training rollouts of `iteration` are part done."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while not Path(config.store_url.removeprefix("sqlite:///")).exists():
        _still_running(process, deadline, log, "no store")
        await asyncio.sleep(0.1)
    async with SqlLightningStore(config.store_url, watchdog_interval=None) as store:
        while True:
            rollouts = await store.query_rollouts(mode="train", queue=config.run_name)
            done = Counter(r.status for r in rollouts if r.metadata["iteration"] == iteration)["succeeded"]
            if 0 < done < BATCH * SAMPLES:
                return
            _still_running(process, deadline, log, f"never saw iteration {iteration} part done")
            await asyncio.sleep(0.02)


def assert_trained_every_rollout(config: TrainConfig, log: Path) -> None:
    """Every iteration, the interrupted ones included, trained on all its batch_size * samples_per_task rollouts
    (its row of the history: what it trained on), none failed, and no round of running failed rollouts again was
    needed (at the default min_success_fraction, 29 of 32 would have started none)."""
    rows = recorded_history(config)
    trained = {row["iteration"]: (row["rollouts_ok"], row["rollouts_failed"]) for row in rows}
    assert trained == {i: (BATCH * SAMPLES, 0) for i in range(ITERATIONS)}, f"(trained, failed): {trained}\n{tail(log)}"
    assert " rollouts again" not in log.read_text(errors="replace"), tail(log)


def resume_command(log: Path) -> str:
    """The command the stopped run's last line says resumes it."""
    last = log.read_text(errors="replace").strip().splitlines()[-1]
    assert "Resume with: " in last, f"the last line does not say how to resume: {last!r}\n{tail(log)}"
    return last.split("Resume with: ", 1)[1].strip()


def assert_stopped(code: int, took: float, number: int, config: TrainConfig, log: Path) -> None:
    assert code == 128 + number, f"exit code {code}\n{tail(log)}"
    limit = config.timeouts.stop
    assert took < limit, f"the run took {took:.1f} s to stop (timeouts.stop {limit:g})\n{tail(log)}"
    assert "did not stop within" not in log.read_text(errors="replace"), tail(log)


def test_ctrl_c_in_a_terminal_stops_the_run_and_the_same_command_resumes_it(tmp_path: Path) -> None:
    """The run as a user starts it (a terminal, Prefect's temporary server); Ctrl-C in iteration 1's rollouts."""
    _, config, config_path = stop_config(tmp_path, "ctrl-c")
    command = [sys.executable, "-m", "flows.train", str(config_path)]
    env = with_support(prefect_env(tmp_path / "prefect"))
    env.pop("PREFECT_API_URL", None)
    log = tmp_path / "train.log"
    terminal = Terminal(command, env, tmp_path, log)
    try:
        asyncio.run(wait_for_rollouts(config, 1, terminal, log))
        family = run_processes(terminal.pid)
        stopped_at = time.monotonic()
        terminal.interrupt()
        code = terminal.wait(config.timeouts.stop + 30)
        took = time.monotonic() - stopped_at
    finally:
        terminal.kill()
    assert_stopped(code, took, signal.SIGINT, config, log)
    assert_gone(family, log, timeout=2.0)  # every server stopped by the run itself, the temporary Prefect one last
    assert mlflow_run(config).info.status == "KILLED"
    resume = resume_command(log)
    assert resume == shlex.join(command)
    mark(log, f"Ctrl-C; stopped in {took:.1f} s; resumed with the command it printed")
    run_to_the_end(shlex.split(resume), log, env, tmp_path)
    resumed_after = time.monotonic() - stopped_at
    assert_invariants(config, log)
    assert_trained_every_rollout(config, log)
    interrupted = recorded_history(config)[1]
    # The break (the stop, the new process's start-up) is not the rollouts' time.
    assert interrupted["rollout_seconds"] < resumed_after / 2, (interrupted, resumed_after)
    print(f"\nCtrl-C: stopped in {took:.1f} s (exit {code}); iteration 1's rollout_seconds after the resume "
          f"{interrupted['rollout_seconds']:.1f} s")  # fmt: skip


def test_sigterm_at_three_points_stops_the_run_and_it_resumes(prefect_server: PrefectServer, tmp_path: Path) -> None:
    """One run stopped three times by SIGTERM (what a Prefect worker, a container runtime or `kill` sends), then
    finished: in iteration 0's rollouts (with a twin refused meanwhile), in iteration 1's PPO step (its batch written),
    and while its servers start; each stop ends within timeouts.stop with its resume command, and the run ends with
    nothing lost or trained twice. SIGINT goes to the same handler (flows.cli); the Ctrl-C test above sends it from
    a terminal. (A SIGINT twin of this test cost CI about three minutes and covered no other line.)"""
    number = signal.SIGTERM
    _, config, config_path = stop_config(tmp_path, f"stop-{signal.Signals(number).name}")
    command = [sys.executable, "-m", "flows.train", str(config_path)]
    env = with_support(prefect_server.env)
    log = tmp_path / "train.log"
    timings = []

    def stop_at(reach: Callable[[subprocess.Popen], None], twin: bool = False) -> None:
        process = start_logged(command, log, env=env, cwd=tmp_path)
        try:
            reach(process)
            if twin:
                check_twin_refused(command, env, tmp_path, process.pid)
            stopped_at = time.monotonic()
            process.send_signal(number)
            code = process.wait(config.timeouts.stop + 30)
            took = time.monotonic() - stopped_at
        finally:
            stop_process_group(process)
        assert_stopped(code, took, number, config, log)
        assert resume_command(log) == shlex.join(command)
        timings.append(took)
        mark(log, f"{signal.Signals(number).name}; stopped in {took:.1f} s; started again")

    def in_rollouts(process: subprocess.Popen) -> None:
        asyncio.run(wait_for_rollouts(config, 0, process, log))

    def in_ppo_step(process: subprocess.Popen) -> None:
        deadline = time.monotonic() + RUN_TIMEOUT
        while not (config.run_dir / "batches" / "iteration-000001").exists():
            _still_running(process, deadline, log, "never reached iteration 1's PPO step")
            time.sleep(0.01)

    def starting(process: subprocess.Popen) -> None:
        deadline, proxy_log = time.monotonic() + RUN_TIMEOUT, config.run_dir / "logs" / "proxy.log"
        starts = proxy_log.read_text().count("starting LLM proxy") if proxy_log.exists() else 0
        while not (proxy_log.exists() and proxy_log.read_text().count("starting LLM proxy") > starts):
            _still_running(process, deadline, log, "never started its LLM proxy")
            time.sleep(0.01)

    stop_at(in_rollouts, twin=True)
    stop_at(in_ppo_step)
    stop_at(starting)
    run_to_the_end(command, log, env, tmp_path)
    assert_invariants(config, log)
    assert_trained_every_rollout(config, log)
    print(f"\n{signal.Signals(number).name} in rollouts, PPO step, start-up: stopped in "
          + ", ".join(f"{took:.1f} s" for took in timings))  # fmt: skip


def check_twin_refused(command: list[str], env: dict[str, str], cwd: Path, owner_pid: int) -> None:
    """A second `train` of the live run's name is refused in seconds, in one line naming the owner."""
    started = time.monotonic()
    twin = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert twin.returncode == 1, twin.stderr[-3000:]
    last = twin.stderr.strip().splitlines()[-1]
    assert last.startswith("error: run ") and f"is being trained by pid {owner_pid} on " in last, last
    assert took < TWIN_REFUSED_SECONDS, f"the twin took {took:.1f} s to be refused"
    print(f"\ntwin refused in {took:.1f} s: {last}")


def test_a_full_disk_at_checkpoint_time_fails_in_one_line_and_the_run_resumes_once_freed(
    prefect_server: PrefectServer, tmp_path: Path
) -> None:
    """The disk is full for the first checkpoint (checkpoint.reserve_mb past what is free: a size-capped directory
    that needs no mount); once freed, the same run resumes and finishes."""
    data = {**fault_config(tmp_path, "disk-full"), "iterations": 2}
    config = validate_config(data)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(data))
    command = [sys.executable, "-m", "flows.train", str(config_path)]
    free_mb = shutil.disk_usage(tmp_path).free / 2**20
    full = subprocess.run(
        [*command, "--set", f"checkpoint.reserve_mb={free_mb + 1000:.0f}"], env=prefect_server.env, cwd=tmp_path,
        capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert full.returncode == 1, full.stderr[-5000:]
    last = full.stderr.strip().splitlines()[-1]
    checkpoints = config.run_dir / "checkpoints"
    expected = rf"error: NoSpaceLeft: no space left on {checkpoints}: [\d.]+ MB needed, [\d.]+ free .*"
    assert re.fullmatch(expected, last), last
    assert "Retry 1/" not in full.stdout + full.stderr, "retried: a full disk stays full"
    assert not list(checkpoints.glob("step-*")) and not list(checkpoints.glob(".tmp-*")), "a checkpoint was written"
    log = tmp_path / "train.log"
    log.write_text(full.stdout + full.stderr + "\n=== space freed; started again ===\n")
    run_to_the_end(command, log, prefect_server.env, tmp_path)
    final = load_checkpoint(latest_checkpoint(checkpoints))
    assert final.step == 2 and [row["iteration"] for row in recorded_history(config)] == [0, 1]
    print(f"\ndisk full: {last}")


# --- what a stop cancelled, on resume: the mechanism, in process (seconds, without Prefect) ----------------------


async def test_what_a_stop_cancelled_runs_on_the_resumed_runs_proxy_and_in_its_own_phase(tmp_path: Path) -> None:
    """A stop cancels iteration 0's rollouts; the next process opens the run (a new proxy, on another port, with a
    new token): the run's resources point at it before anything runs, so those rollouts, whoever claims them first,
    call it and succeed; and its first evaluation (done already) starts no runners, so it claims none of them. The
    default rollout config allows one attempt: no retry hides a rollout that failed calling the old proxy."""
    from lightning import stages, stopping
    from lightning.run import Run

    data = {**fault_config(tmp_path, "resume-proxy"), "agent": "examples.copy_task.agent:copy_agent"}
    data.pop("rollout")
    data["inference"], data["proxy_in_process"] = {"in_process": True}, True
    config = validate_config(data)
    first = await Run.open(config, train=False, track=False)
    try:
        val_ids, _ = await stages.collect_rollouts(first, 0, "val")
        train_ids = await stages.enqueue_rollouts(first, 0, await stages.update_resources(first, "train"))
        old_proxy = first.endpoints.proxy_url
        stopping.request_stop("SIGTERM")
        try:
            assert await stages.cancel_for_stop(first) == len(train_ids) == BATCH * SAMPLES
        finally:
            stopping.clear()
    finally:
        await first.close("KILLED")

    second = await Run.open(config, train=False, track=False)
    try:
        assert second.endpoints.proxy_url != old_proxy
        for mode in ("train", "val"):
            stored = await second.store.get_resources_by_id(second.resources_id(mode))
            assert stored is not None
            llm = stored.resources[config.llm_resource_name]
            # The proxy's token is never stored: runners read it from their environment.
            assert (llm.endpoint, llm.api_key) == (f"{second.endpoints.proxy_url}/v1", None), mode
        # The evaluation, summarised again: no runner claims the requeued training rollouts.
        assert await stages.run_runners(second, val_ids, mode="val") == {
            "runner": 0, "ran": 0, "finished": len(val_ids), "seconds": pytest.approx(0, abs=5)
        }  # fmt: skip
        statuses = Counter(r.status for r in await second.store.query_rollouts(rollout_id_in=train_ids))
        assert statuses == {"requeuing": len(train_ids)}, statuses
        # Runners that claim them before this process's update_resources("train") still reach this proxy.
        await stages.run_runners(second, train_ids)
        ids, summary = await stages.collect_rollouts(second, 0, "train")
        assert ids == train_ids
        assert (summary["succeeded"], summary["failed"]) == (len(train_ids), 0), summary
    finally:
        await second.close()
