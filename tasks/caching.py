"""Cache keys of the stages: (train flow run, run queue, iteration, stage, other inputs).

The key holds the id of the *train* flow run, not of the iteration subflow: when a failed train run is retried
(from the UI or `prefect flow-run retry`), Prefect starts a fresh subflow run for the iteration that failed, and
its finished stages must still come back Cached. A new train run (a resumed run name) gets new keys; there the
store's idempotency keys and the checkpoints on disk make the stages skip finished work.
"""

from __future__ import annotations

import hashlib
import json
from contextvars import ContextVar
from typing import Any

TRAIN_FLOW_RUN_ID: ContextVar[str | None] = ContextVar("train_flow_run_id", default=None)
"""Set by the top-level flow; Prefect copies context variables into the threads that run tasks (not into Ray
workers, which ask Prefect for the root flow run instead)."""


def stage_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """The run enters the key by its queue (its name, or a dev/evaluate queue of its own), not by its endpoints:
    a retried flow run is a new process, whose servers listen on other ports."""
    run = parameters["run"]
    root = TRAIN_FLOW_RUN_ID.get() or _root_flow_run_id() or str(context.task_run.flow_run_id)
    rest = {name: value for name, value in parameters.items() if name != "run"}
    digest = hashlib.sha256(json.dumps(rest, sort_keys=True, default=_plain).encode()).hexdigest()[:16]
    iteration = parameters.get("iteration", parameters.get("step", "-"))
    return f"{root}-{run.queue}-{iteration}-{context.task.name}-{digest}"


_roots: dict[str, str | None] = {}
"""Flow run id -> its top-level flow run's id, which never changes: asked of the API once per flow run, not once
per task (two round trips, made while the flow's event loop waits)."""


def _root_flow_run_id() -> str | None:
    """The top-level flow run's id from Prefect's API: for tasks in processes the context variable does not reach
    (runner tasks on Ray workers)."""
    from prefect.runtime import flow_run

    try:
        current = flow_run.id
        if current not in _roots:
            _roots[current] = flow_run.root_flow_run_id or None
        return _roots[current]
    except Exception:  # no flow run context, or the API is unreachable: the subflow's id still makes a valid key
        return None


def _plain(value: Any) -> Any:
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else str(value)


def ppo_step_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """A stage's key plus the trainer process: the update lives in that process until it is checkpointed, so where
    the trainer is another process (a retried flow run is a new process; a crashed trainer was restarted), the
    update is taken again rather than taken for done."""
    trainer = parameters["run"].trainer
    return f"{stage_cache_key(context, parameters)}-trainer{getattr(trainer, 'pid', None) or 'remote'}"
