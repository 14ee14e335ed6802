"""How far a run has got, from its store and checkpoints: what the terminal progress bar of a CLI run shows."""

from __future__ import annotations

import io
from pathlib import Path

from flows.cli import progress_bar
from lightning.config import TrainConfig
from lightning.progress import Snapshot, snapshot
from lightning.reporting import warm_start_unfit
from lightning.run import checkpoints_dir
from lightning.store import SqlLightningStore


async def test_a_snapshot_counts_the_runs_rollouts_and_iterations(tmp_path: Path) -> None:
    config = TrainConfig(run_name="watched", output_dir=str(tmp_path), store_url=f"sqlite:///{tmp_path / 's.db'}")
    async with SqlLightningStore(config.store_url, watchdog_interval=None) as store:
        assert await snapshot(config, store) == Snapshot(0, 0, 0)
        for i in range(5):
            await store.enqueue_rollout({"i": i}, queue="watched")
        await store.enqueue_rollout({"other": 1}, queue="another-run")
        for _ in range(3):
            claimed = await store.dequeue_rollout(queue="watched")
            await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")
        (checkpoints_dir(config) / "step-000002").mkdir(parents=True)  # an empty directory is no checkpoint
        now = await snapshot(config, store)
    assert (now.rollouts_enqueued, now.rollouts_finished, now.rollouts_in_flight) == (5, 3, 2)
    assert now.iterations_done == 0


def test_no_bar_when_the_output_is_not_a_terminal(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr("sys.stderr", io.StringIO())
    with progress_bar("train", TrainConfig(output_dir=str(tmp_path))):
        pass
    assert __import__("sys").stderr.getvalue() == ""


def test_the_progress_line_numbers_iterations_as_prefect_the_table_and_mlflow_do() -> None:
    """Iterations count from 0 everywhere (Prefect's subflows, the table, MLflow's steps); the line adds how many
    are done. Checkpoint 10 is the weights after iteration 9, whose row holds its held-out reward."""
    from flows.evaluate import evaluation_label
    from lightning.reporting import progress_line
    from lightning.run import Endpoints, Run

    run = Run(config=TrainConfig(iterations=30), endpoints=Endpoints(proxy_url="", model_name="policy"), queue="demo")
    row = {"iteration": 9, "reward": 0.5, "val_reward": 0.75, "rollouts_ok": 256, "rollouts_failed": 0}
    line = progress_line(run, {**row, "pg_loss": 0.1, "rollout_tokens_per_s": 100.0}, 2, 8.0)
    assert line.startswith("iteration 9 (10/30) | reward 0.500 | val 0.750 |"), line
    assert line.endswith("| 4.0 s/it | ETA 1m20s"), line  # the 20 iterations left at 4 s
    assert evaluation_label(10) == "of checkpoint 10 (after iteration 9)"
    assert evaluation_label(0) == "of checkpoint 0 (before training)"


def test_a_resumed_run_names_its_first_iteration_as_its_progress_line_will() -> None:
    """Issue 40, item 14: `resuming run t at iteration 2 of 2`, then `iteration 1 (2/2) | ...` for the same
    iteration; the resume line now numbers it as the progress line does."""
    from lightning.reporting import progress_line, resume_line
    from lightning.run import Endpoints, Run

    run = Run(config=TrainConfig(iterations=2), endpoints=Endpoints(proxy_url="", model_name="policy"), queue="t")
    row = {"iteration": 1, "reward": 0.5, "rollouts_ok": 32, "rollouts_failed": 0, "rollout_tokens_per_s": 1.0}
    resumed = resume_line("t", 1, 2)
    assert resumed == "resuming run t at iteration 1 (2/2)"
    assert progress_line(run, row, 1, 1.0).startswith(f"{resumed.split(' at ')[1]} | ")


def test_held_out_stages_are_named_by_the_checkpoint_they_evaluate(monkeypatch) -> None:
    """Issue 40, item 14: the stages of the evaluation before the warm start came out as
    `update_resources-val--1`; held-out rollouts are named by the model they evaluate, training ones by iteration."""
    from types import SimpleNamespace

    import tasks.stages

    def name(stage: str, *more: str, **parameters: object) -> str:
        monkeypatch.setattr(tasks.stages, "task_run", SimpleNamespace(parameters=parameters))
        return tasks.stages._phase_name(stage, *more)()

    assert name("update_resources", mode="val", iteration=-1) == "update_resources-val-initial"
    assert name("update_resources", mode="val", iteration=0) == "update_resources-val-checkpoint-0"
    assert name("wait_for_rollouts", mode="val", iteration=2) == "wait_for_rollouts-val-checkpoint-2"
    assert name("update_resources", mode="train", iteration=3) == "update_resources-train-3"
    assert name("run_runner", "index", mode="train", iteration=3, index=1) == "run_runner-train-3-1"


def test_a_warm_start_that_never_fit_its_demonstrations_is_warned_of() -> None:
    """`warm_start.stop_at_loss` set and every step used, the loss still above it: one warning naming the fix."""
    unfit = warm_start_unfit({"steps": 1500, "sft_loss": 0.0298, "demonstrations": 128}, 0.01)
    assert unfit is not None and "not fit after 1500 steps (sft_loss 0.0298, stop_at_loss 0.01)" in unfit
    assert "warm_start.steps" in unfit
    assert warm_start_unfit({"steps": 814, "sft_loss": 0.0097}, 0.01) is None  # it stopped once fit
    assert warm_start_unfit({"steps": 250, "sft_loss": 0.08}, None) is None  # no target: nothing to warn of
