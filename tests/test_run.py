"""The run as one object: stages refuse a run that is not open, a run sent to another process arrives as its
config and endpoints, and a wait that times out cancels its leftovers so no later stage runs them."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import pickle
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from lightning import reporting, semconv, stages
from lightning.config import TrainConfig, load_config
from lightning.run import Endpoints, Run, RunNotOpen


@contextlib.asynccontextmanager
async def opened(tmp_path: Path, **changes: Any) -> AsyncIterator[Run]:
    """A run of `small_config`, open without a trainer, closed at the end."""
    run = await Run.open(small_config(tmp_path, **changes), train=False)
    try:
        yield run
    finally:
        await run.close()


def small_config(tmp_path: Path, **changes: Any) -> TrainConfig:
    data = {
        "run_name": "r",
        "agent": "examples.copy_task.agent:copy_agent",
        "train_data": "examples.copy_task.data:train_tasks",
        "val_data": "examples.copy_task.data:val_tasks",
        "batch_size": 4,
        "samples_per_task": 2,
        "n_runners": 1,
        "runner_concurrency": 8,
        "sampling": {"temperature": 1.0, "max_tokens": 2},
        "store_url": f"sqlite:///{tmp_path}/store.db",
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "output_dir": str(tmp_path / "runs"),
    }
    return load_config({**data, **changes})


async def test_a_stage_given_a_run_that_is_not_open_says_so(tmp_path: Path) -> None:
    config = small_config(tmp_path)
    closed = Run(config=config, endpoints=Endpoints(proxy_url="http://127.0.0.1:9", model_name="policy"), queue="r")
    with pytest.raises(RunNotOpen, match=r"run 'r' is not open in this process: open it with `await Run.open"):
        await stages.update_resources(closed, "train")
    with pytest.raises(RunNotOpen):
        await stages.ppo_step(closed, 0, "batch")


@pytest.mark.slow
async def test_leftovers_of_a_timed_out_wait_are_cancelled_and_never_run_later(tmp_path: Path) -> None:
    async with opened(tmp_path) as run:
        resources_id = await stages.update_resources(run, "train")
        stranded = await stages.enqueue_rollouts(run, 0, resources_id)
        impatient = run.model_copy(update={"config": run.config.model_copy(update={"timeouts": _rollouts(0.2)})})
        summary = await stages.wait_for_rollouts(impatient, stranded)  # nobody runs them
        assert summary["cancelled"] == summary["rollouts"] == 4 * 2 and summary["succeeded"] == 0

        later, done = await stages.collect_rollouts(run, 1)
        assert done["succeeded"] == len(later) == 4 * 2
        for rollout_id in stranded:
            assert (await run.store.get_rollout_by_id(rollout_id)).status == "cancelled"
            assert await run.store.query_attempts(rollout_id) == []
        # Enqueuing iteration 0 again (a retry) hands back the cancelled rollouts; nothing runs them.
        assert await stages.enqueue_rollouts(run, 0, resources_id) == stranded


@pytest.mark.slow
async def test_a_run_sent_to_another_process_arrives_as_its_config_and_endpoints(tmp_path: Path) -> None:
    async with opened(tmp_path) as run:
        copy = pickle.loads(pickle.dumps(run))
        assert not copy.is_open and copy.config == run.config and copy.endpoints == run.endpoints
        assert copy.model_dump(mode="json")["queue"] == "r"
        async with copy.connect_store() as store:  # where the run is not open: a connection of its own
            assert store is not run.store and await store.query_rollouts(queue="r") == []
    assert not run.is_open
    with pytest.raises(RunNotOpen):
        run.store  # noqa: B018


@pytest.mark.slow
async def test_a_run_opened_without_mlflow_trains_and_checkpoints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """track=False: no MLflow run (a GPU machine without MLflow installed, a benchmark); the iteration's row goes to
    the checkpoint's history alone. The run's log says in which device and dtype the inference server serves. While
    it is open, what its process held is out of the collector's full passes; closed, it is the collector's again."""
    config = small_config(tmp_path, algorithm={"lr": 1e-3, "kl_coef": 0.0}, max_response_length=4)
    with caplog.at_level("INFO", logger="lightning.run"):
        run = await Run.open(config, track=False)
    try:
        assert gc.get_freeze_count() > 0
        assert run.tracker is None
        assert f"serves {run.model_dir} on cpu in float32" in caplog.text
        ids, summary = await stages.collect_rollouts(run, 0)
        batch = await stages.adapt_spans(run, 0, ids)
        metrics = await stages.ppo_step(run, 0, batch["batch_path"])
        row = reporting.iteration_row(0, summary, batch, metrics, rollout_seconds=1.0)
        saved = await stages.checkpoint(run, 0, row)
        history = list(run.history)
    finally:
        await run.close()
    assert gc.get_freeze_count() == 0
    assert saved["step"] == 1 and [entry["iteration"] for entry in history] == [0]
    assert not (tmp_path / "mlflow.db").exists()
    with pytest.raises(ValueError, match="checkpoint.register_model registers the final model in MLflow"):
        await Run.open(small_config(tmp_path, checkpoint={"register_model": "m"}), track=False)


def _rollouts(seconds: float) -> Any:
    from lightning.config import StageTimeouts

    return StageTimeouts(rollouts=seconds)


@pytest.mark.slow
@pytest.mark.parametrize("with_proxy", [False, True], ids=["apart", "with-proxy"])
async def test_a_dead_server_or_proxy_is_restarted_and_the_rollouts_go_on(tmp_path: Path, with_proxy: bool) -> None:
    """The inference server and the proxy in processes of their own, or in one (`inference.with_proxy`)."""
    async with opened(tmp_path, inference={"with_proxy": with_proxy}) as run:
        stack = run._parts.stack  # the run's own processes
        names = [child.name for child in stack.processes]
        assert names == (["inference server and LLM proxy"] if with_proxy else ["inference server", "LLM proxy"])
        for child in stack.processes:  # the inference server, then the proxy
            child.process.kill()
            await _until(lambda child=child: child.restarts == 1 and child.answers(), f"{child.name} restarted")
        ids, summary = await stages.collect_rollouts(run, 0)
        assert summary["succeeded"] == len(ids) == 4 * 2
        assert run.restarts() == len(names)
        # The restarted proxy records the weights served (the supervisor resumes it on them).
        spans = await run.store.query_spans(ids[0])
        assert any(span.attributes.get(semconv.LLM_WEIGHT_VERSION) is not None for span in spans)


@pytest.mark.slow
async def test_a_run_whose_proxy_serves_in_the_inference_server_s_process_trains_on_its_token_ids(
    tmp_path: Path,
) -> None:
    """`inference.with_proxy`: one process serves the model and the proxy, whose calls reach the model without HTTP;
    the spans carry the token ids the update trains on, and new weights reach the server."""
    config = small_config(tmp_path, inference={"with_proxy": True}, algorithm={"lr": 1e-3}, max_response_length=4)
    run = await Run.open(config, track=False)
    try:
        [server] = run._parts.stack.processes
        assert run.endpoints.proxy_url != run._parts.stack.inference_url
        ids, summary = await stages.collect_rollouts(run, 0)
        assert summary["succeeded"] == len(ids) == 4 * 2
        batch = await stages.adapt_spans(run, 0, ids)
        assert batch["rows"] == 4 * 2
        metrics = await stages.ppo_step(run, 0, batch["batch_path"])
        saved = await stages.checkpoint(run, 0, reporting.iteration_row(0, summary, batch, metrics, 1.0))
        assert run._parts.stack.serving()["version"] == saved["step"] == 1
    finally:
        await run.close()
    log = (config.run_dir / "logs" / "inference.log").read_text()
    assert "lightning.stack: the LLM proxy on http://127.0.0.1:" in log
    assert not (config.run_dir / "logs" / "proxy.log").exists()


@pytest.mark.slow
async def test_a_server_past_its_restarts_fails_the_next_rollout_phase_naming_it(tmp_path: Path) -> None:
    from lightning.run import ServingError

    async with opened(tmp_path, inference={"max_restarts": 0}) as run:
        server = run._parts.stack.processes[0]
        server.process.kill()
        await _until(lambda: run._parts.supervisor.failure is not None, "the supervisor gave up")
        with pytest.raises(ServingError, match=r"the inference server at http://127\.0\.0\.1:\d+ died or hung again"):
            await stages.collect_rollouts(run, 0)


@pytest.mark.slow
async def test_a_run_that_makes_no_progress_logs_the_stacks_of_its_processes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning.diagnose import collect_stacks

    async with opened(tmp_path, timeouts={"stall_warning": 2}) as run:
        dumped = collect_stacks(run.run_dir / "stacks")
        for component in ("flow", "inference-server", "llm-proxy"):
            assert f"== {component} (pid " in dumped, dumped[:2000]
        assert "Thread 0x" in dumped and "File " in dumped
        with caplog.at_level("WARNING", logger="lightning.run"):
            await _until(lambda: "nothing has finished for" in caplog.text, "the stall warning")
        assert "lightning debug stacks" in caplog.text and "== inference-server" in caplog.text


@pytest.mark.slow
async def test_a_finished_rollout_is_progress(tmp_path: Path) -> None:
    async with opened(tmp_path) as run:
        resources_id = await stages.update_resources(run, "train")
        ids = await stages.enqueue_rollouts(run, 0, resources_id)
        run.made_progress("nothing since")
        await stages.run_runners(run, ids)
        assert run._parts.progress_note == "a rollout"  # what the stall warning waits for


@pytest.mark.slow
async def test_a_server_that_does_not_start_in_time_fails_naming_it_and_what_it_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up is bounded by `timeouts.startup`, each wait reported as it goes; the error names the process, its pid
    and the end of its log; the MLflow run is left FAILED, saying why."""
    from mlflow import MlflowClient

    import lightning.stack

    monkeypatch.setattr(lightning.stack, "REPORT_EVERY", 1.0)
    # The inference server sleeps 60 s before it starts: on a fast machine the real one can answer within 4 s.
    start_process = lightning.stack.LocalStack._start_process

    def slow_inference(self: Any, name: str, command: list[str], *args: Any) -> str:
        if name == "inference server":
            command = [command[0], "-c", SLOW_START, "60", *command[1:]]
        return start_process(self, name, command, *args)

    monkeypatch.setattr(lightning.stack.LocalStack, "_start_process", slow_inference)
    config = small_config(tmp_path, timeouts={"startup": 4})
    reported: list[str] = []
    with pytest.raises(TimeoutError) as failed:
        await Run.open(config, train=False, track=True, report=reported.append)
    message = str(failed.value)
    assert re.search(r"^the inference server \(pid \d+\) did not answer on http://127\.0\.0\.1:\d+ after 4 s", message)
    assert "timeouts.startup (4 s; raise it on a slow or loaded machine)" in message
    log = config.run_dir / "logs" / "inference.log"
    assert f"the end of its log {log}:" in message and "starting inference server on http://127.0.0.1:" in message
    assert message.rstrip().endswith(log.read_text().strip().splitlines()[-1].strip()), (message, log.read_text())
    assert reported and all("waiting for the inference server (pid " in line for line in reported), reported
    assert "s so far (timeouts.startup: 4 s); its log's last line: " in reported[-1]

    client = MlflowClient(config.tracking_uri)
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name(config.experiment).experiment_id])
    assert mlflow_run.info.status == "FAILED"
    assert mlflow_run.data.tags["error"].startswith("opening the run failed: TimeoutError('the inference server")


async def _until(condition: Any, what: str, timeout: float = 60.0) -> None:
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        await asyncio.sleep(0.2)


SLOW_START = (
    "import os, sys, time; time.sleep(float(sys.argv[1])); os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)
"""Runs the rest of the command line after sleeping: a server that takes that long to start."""


@pytest.mark.slow
async def test_a_slow_restart_is_one_restart_not_a_crash_loop(tmp_path: Path) -> None:
    """A proxy whose restart takes 4 s (a loaded machine) answers again as one restart: the supervisor neither
    counts its start-up as more failures nor gives up on it, and the rollouts go on."""
    async with opened(tmp_path, inference={"max_restarts": 1}) as run:
        proxy = next(child for child in run._parts.stack.processes if child.name == "LLM proxy")
        proxy.command[1:1] = ["-c", SLOW_START, "4"]  # python -c SLOW_START 4 -m lightning.cli proxy serve ...
        proxy.process.kill()
        await _until(lambda: proxy.restarts == 1 and proxy.answers(), "the proxy restarted", timeout=60)
        await asyncio.sleep(3)  # a few more supervisor checks after the slow start
        assert run._parts.supervisor.failure is None and proxy.restarts == 1
        ids, summary = await stages.collect_rollouts(run, 0)
        assert summary["succeeded"] == len(ids) == 4 * 2
        assert run.restarts() == 1
