"""Prefect tasks: each a thin wrapper over one `lightning.stages` call (or `Run.open`), with its retries, cache key
and result persistence declared on the decorator, and its timeout from the run's config (`timed`)."""

from tasks.stages import (
    adapt_spans,
    checkpoint,
    enqueue_rollouts,
    gpu_limited,
    log_evaluation,
    open_run,
    ppo_step,
    requeue_unsuccessful,
    run_runner,
    timed,
    update_resources,
    wait_for_rollouts,
    warm_start,
)

__all__ = [
    "adapt_spans",
    "checkpoint",
    "enqueue_rollouts",
    "gpu_limited",
    "log_evaluation",
    "open_run",
    "ppo_step",
    "requeue_unsuccessful",
    "run_runner",
    "timed",
    "update_resources",
    "wait_for_rollouts",
    "warm_start",
]
