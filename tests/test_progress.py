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
