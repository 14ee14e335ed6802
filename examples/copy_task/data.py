"""The demo's datasets, as entry points for TrainConfig (`train_data: examples.copy_task.data:train_tasks`):
letters-to-last-letter tasks, disjoint between training and held-out."""

from __future__ import annotations

from typing import Any

from examples.copy_task.agent import make_tasks

TRAIN = 192
HELD_OUT = 64


def train_tasks() -> list[dict[str, Any]]:
    return make_tasks(TRAIN + HELD_OUT, kind="last", seed=0)[:TRAIN]


def val_tasks() -> list[dict[str, Any]]:
    return make_tasks(TRAIN + HELD_OUT, kind="last", seed=0)[TRAIN:]
