"""Prefect tasks: each a thin wrapper over one `lightning.stages` call (or `Run.open`), with its retries, cache key
and result persistence declared on the decorator, and its timeout from the run's config (`timed`)."""

from tasks.prefect_clients import share_tls_contexts
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

share_tls_contexts()  # each task run's Prefect clients: one TLS context, not a CA bundle loaded for each

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
