"""How far a run has got, from its store and checkpoints: what the terminal progress bar of a CLI run shows."""

from __future__ import annotations

import io
from pathlib import Path

from flows.cli import progress_bar
from lightning.config import TrainConfig
from lightning.progress import Snapshot, snapshot
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
