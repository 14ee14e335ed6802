"""The demo's datasets, as entry points for TrainConfig (`train_data: examples.copy_task.data:train_tasks`):
letters-to-last-letter tasks, disjoint between training and held-out."""

from __future__ import annotations

from typing import Any

from examples.copy_task.agent import make_tasks

TRAIN = 4000
"""Training tasks: all 4,096 four-letter tasks but the 64 held out and 32 never used. Each is seen about once in the
demo's 30 iterations, so what the policy can learn is the rule, not the prompts (docs/benchmarks.md, "Learning that
holds")."""
HELD_OUT = 64
FIRST = 192
"""The held-out tasks are the 64 generated after the first 192 (the demo's training set until 2026-11-27): every
held-out figure in docs/benchmarks.md is on the same tasks. `make_tasks(n)` is a prefix of `make_tasks(m > n)`."""


def split(train: int = TRAIN) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`train` training tasks and the 64 held-out ones."""
    tasks = make_tasks(max(train, FIRST) + HELD_OUT, kind="last", seed=0)
    return (tasks[:FIRST] + tasks[FIRST + HELD_OUT :])[:train], tasks[FIRST : FIRST + HELD_OUT]


def train_tasks() -> list[dict[str, Any]]:
    return split()[0]


def val_tasks() -> list[dict[str, Any]]:
    return split()[1]
