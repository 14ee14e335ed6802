"""How far a run has got, read from its two records of progress: the checkpoints (iterations done) and the store
(rollouts of its queue enqueued and finished). For a terminal progress bar beside a CLI run, or any other watcher;
it changes nothing."""

from __future__ import annotations

from dataclasses import dataclass

from lightning.checkpoint import latest_checkpoint
from lightning.config import TrainConfig
from lightning.run import checkpoints_dir
from lightning.store.base import LightningStore

FINISHED = ["succeeded", "failed", "cancelled"]


@dataclass(frozen=True)
class Snapshot:
    iterations_done: int
    rollouts_enqueued: int
    rollouts_finished: int

    @property
    def rollouts_in_flight(self) -> int:
        return self.rollouts_enqueued - self.rollouts_finished


async def snapshot(config: TrainConfig, store: LightningStore) -> Snapshot:
    """Two counts from the store (no rows read) and the name of the latest checkpoint directory (`step-000042`)."""
    enqueued = await store.query_rollouts(queue=config.run_name, limit=0)
    finished = await store.query_rollouts(queue=config.run_name, status_in=FINISHED, limit=0)
    latest = latest_checkpoint(checkpoints_dir(config))
    return Snapshot(
        iterations_done=int(latest.name.rsplit("-", 1)[-1]) if latest is not None else 0,
        rollouts_enqueued=enqueued.total,
        rollouts_finished=finished.total,
    )
