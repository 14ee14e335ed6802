"""The lookup example's datasets, as entry points for TrainConfig: training tasks and held-out tasks on tables of
their own (held-out tables never occur in training)."""

from __future__ import annotations

from typing import Any

from examples.lookup.agent import make_tasks

TRAIN = 4000
HELD_OUT = 64


def train_tasks() -> list[dict[str, Any]]:
    return make_tasks(TRAIN, first_table=0, seed=0)


def val_tasks() -> list[dict[str, Any]]:
    return make_tasks(HELD_OUT, first_table=1_000_000, seed=1)
