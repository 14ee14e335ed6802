"""Agents for runner tests; importable by runner subprocesses as `support.agents:<name>`."""

from __future__ import annotations

import os
import time
from typing import Any

from lightning.agent import rollout
from lightning.types import AttemptedRollout


@rollout
def counting_agent(task: dict[str, Any], rollout: AttemptedRollout) -> float:
    """Logs each execution (rollout id, attempt number, pid) to $LIGHTNING_TEST_LOG, sleeps as the
    task says, and hangs on its first attempt when the task says `hang_first_attempt`."""
    log = os.environ.get("LIGHTNING_TEST_LOG")
    if log:
        with open(log, "a") as out:  # O_APPEND: whole lines from several processes
            out.write(f"{rollout.rollout_id} {rollout.attempt.sequence_id} {os.getpid()}\n")
    if task.get("hang_first_attempt") and rollout.attempt.sequence_id == 1:
        time.sleep(600)
    time.sleep(task.get("sleep", 0.0))
    return float(task.get("reward", 1.0))


def half_flat_tasks() -> list[dict[str, Any]]:
    """Eight tasks, two of which `half_flat_agent` scores differently from sample to sample."""
    return [{"name": f"task-{i}", "mixed": i in (2, 5)} for i in range(8)]


@rollout
def half_flat_agent(task: dict[str, Any], rollout: AttemptedRollout) -> float:
    """Reward by the sample's parity on a `mixed` task (its group's rewards differ), 1.0 on any other (a flat
    group: every sample alike)."""
    return float(rollout.metadata["sample"] % 2) if task["mixed"] else 1.0
