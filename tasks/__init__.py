"""Prefect tasks: each a thin wrapper over one `lightning.pipeline` call, with its retries, timeouts, cache key
and result persistence declared on the decorator."""

from tasks.stages import (
    adapt_spans,
    checkpoint,
    enqueue_rollouts,
    evaluate,
    ppo_step,
    run_runner,
    start_run,
    update_resources,
    wait_for_rollouts,
    warm_start,
)

__all__ = [
    "adapt_spans",
    "checkpoint",
    "enqueue_rollouts",
    "evaluate",
    "ppo_step",
    "run_runner",
    "start_run",
    "update_resources",
    "wait_for_rollouts",
    "warm_start",
]
