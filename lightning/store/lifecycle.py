"""The rollout lifecycle in one place: how attempt statuses move rollouts, workers and end times.

Every status change in the store goes through these functions; nothing else decides.

Rollout:  queuing -> preparing -> running -> succeeded | failed | cancelled
          failed/timeout/unresponsive attempt -> requeuing -> (dequeue) -> preparing
Attempt:  preparing -> running -> succeeded | failed | timeout | unresponsive
          unresponsive -> running again when a late span or heartbeat arrives
"""

from __future__ import annotations

from lightning.types import AttemptStatus, RolloutConfig, RolloutStatus, WorkerStatus

QUEUED_ROLLOUT: frozenset[RolloutStatus] = frozenset({"queuing", "requeuing"})
ACTIVE_ROLLOUT: frozenset[RolloutStatus] = frozenset({"preparing", "running"})
FINISHED_ROLLOUT: frozenset[RolloutStatus] = frozenset({"succeeded", "failed", "cancelled"})

ACTIVE_ATTEMPT: frozenset[AttemptStatus] = frozenset({"preparing", "running"})
"""Attempts the watchdog watches."""
ENDED_ATTEMPT: frozenset[AttemptStatus] = frozenset({"succeeded", "failed", "timeout", "unresponsive"})
"""Attempt statuses that stamp end_time (unresponsive may still come back to running)."""
REVIVABLE_ATTEMPT: frozenset[AttemptStatus] = frozenset({"preparing", "unresponsive"})
"""Statuses that a span or heartbeat turns into running."""


def rollout_status_after_attempt(
    attempt_status: AttemptStatus,
    attempt_sequence_id: int,
    is_latest_attempt: bool,
    rollout_status: RolloutStatus,
    config: RolloutConfig,
) -> RolloutStatus | None:
    """The rollout's new status after its attempt moved to `attempt_status`; None leaves it as is.

    - Only the latest attempt moves its rollout; a superseded attempt changes nothing.
    - A cancelled rollout stays cancelled.
    - running: the rollout runs (this also takes back a rollout that was requeued or failed
      because this attempt looked unresponsive and has now spoken again).
    - succeeded: the rollout succeeded.
    - failed, timeout, unresponsive: the rollout is requeued if that status is in
      `config.retry_condition` and fewer than `config.max_attempts` attempts were made,
      otherwise it fails.
    """
    if not is_latest_attempt or rollout_status == "cancelled":
        return None
    if attempt_status == "preparing":
        return None
    if attempt_status == "running":
        return "running" if rollout_status != "succeeded" else None
    if attempt_status == "succeeded":
        return "succeeded"
    if attempt_status in config.retry_condition and attempt_sequence_id < config.max_attempts:
        return "requeuing"
    return "failed"


def attempt_status_on_heartbeat(attempt_status: AttemptStatus) -> AttemptStatus:
    """A span or heartbeat proves the attempt alive: preparing and unresponsive become running."""
    return "running" if attempt_status in REVIVABLE_ATTEMPT else attempt_status


def watchdog_verdict(
    attempt_status: AttemptStatus,
    start_time: float,
    last_heartbeat_time: float | None,
    config: RolloutConfig,
    now: float,
) -> AttemptStatus | None:
    """timeout if the attempt ran past timeout_seconds; unresponsive if it has been silent for
    unresponsive_seconds (since its last heartbeat, or since it started if it never beat); else None."""
    if attempt_status not in ACTIVE_ATTEMPT:
        return None
    if config.timeout_seconds is not None and now - start_time > config.timeout_seconds:
        return "timeout"
    silent_since = last_heartbeat_time if last_heartbeat_time is not None else start_time
    if config.unresponsive_seconds is not None and now - silent_since > config.unresponsive_seconds:
        return "unresponsive"
    return None


def worker_status_after_attempt(attempt_status: AttemptStatus) -> WorkerStatus:
    """succeeded/failed free the worker (idle); timeout/unresponsive leave it unknown; else busy."""
    if attempt_status in ("succeeded", "failed"):
        return "idle"
    if attempt_status in ("timeout", "unresponsive"):
        return "unknown"
    return "busy"


def ends_rollout(status: RolloutStatus) -> bool:
    return status in FINISHED_ROLLOUT


def ends_attempt(status: AttemptStatus) -> bool:
    return status in ENDED_ATTEMPT
