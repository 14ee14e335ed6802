"""The pure status rules of lightning.store.lifecycle against hand-written cases."""

from __future__ import annotations

import pytest

from lightning.store.lifecycle import (
    ACTIVE_ATTEMPT,
    ENDED_ATTEMPT,
    FINISHED_ROLLOUT,
    QUEUED_ROLLOUT,
    attempt_status_on_heartbeat,
    ends_attempt,
    ends_rollout,
    rollout_status_after_attempt,
    watchdog_verdict,
    worker_status_after_attempt,
)
from lightning.types import ATTEMPT_STATUSES, ROLLOUT_STATUSES, RolloutConfig

NO_RETRY = RolloutConfig()
RETRY_FAILED_2 = RolloutConfig(max_attempts=2, retry_condition=["failed"])
RETRY_ALL_3 = RolloutConfig(max_attempts=3, retry_condition=["failed", "timeout", "unresponsive"])

# (attempt status, attempt sequence id, is latest, rollout status, config, expected rollout status)
ROLLOUT_CASES = [
    # a superseded attempt changes nothing
    ("succeeded", 1, False, "preparing", NO_RETRY, None),
    ("failed", 1, False, "running", RETRY_ALL_3, None),
    ("running", 1, False, "requeuing", NO_RETRY, None),
    # a cancelled rollout stays cancelled
    ("succeeded", 1, True, "cancelled", NO_RETRY, None),
    ("failed", 1, True, "cancelled", RETRY_ALL_3, None),
    ("running", 1, True, "cancelled", NO_RETRY, None),
    # preparing leaves the rollout alone
    ("preparing", 1, True, "preparing", NO_RETRY, None),
    ("preparing", 2, True, "requeuing", NO_RETRY, None),
    # running: the rollout runs, and is taken back from requeuing/failed
    ("running", 1, True, "preparing", NO_RETRY, "running"),
    ("running", 1, True, "running", NO_RETRY, "running"),
    ("running", 1, True, "failed", NO_RETRY, "running"),
    ("running", 1, True, "requeuing", RETRY_ALL_3, "running"),
    ("running", 1, True, "succeeded", NO_RETRY, None),
    # succeeded
    ("succeeded", 1, True, "running", NO_RETRY, "succeeded"),
    ("succeeded", 3, True, "preparing", RETRY_ALL_3, "succeeded"),
    # failed: retried while attempts remain and the status is in retry_condition
    ("failed", 1, True, "running", NO_RETRY, "failed"),
    ("failed", 1, True, "running", RETRY_FAILED_2, "requeuing"),
    ("failed", 2, True, "running", RETRY_FAILED_2, "failed"),
    ("failed", 3, True, "running", RETRY_FAILED_2, "failed"),
    ("failed", 1, True, "running", RolloutConfig(max_attempts=5), "failed"),
    ("failed", 1, True, "running", RolloutConfig(max_attempts=1, retry_condition=["failed"]), "failed"),
    # timeout and unresponsive follow the same rule, each by its own name
    ("timeout", 1, True, "running", RETRY_FAILED_2, "failed"),
    ("timeout", 2, True, "running", RETRY_ALL_3, "requeuing"),
    ("timeout", 3, True, "running", RETRY_ALL_3, "failed"),
    ("unresponsive", 1, True, "preparing", RETRY_ALL_3, "requeuing"),
    ("unresponsive", 1, True, "running", NO_RETRY, "failed"),
    ("unresponsive", 1, True, "running", RolloutConfig(max_attempts=2, retry_condition=["timeout"]), "failed"),
]


@pytest.mark.parametrize(
    ("attempt_status", "sequence_id", "is_latest", "rollout_status", "config", "expected"), ROLLOUT_CASES
)
def test_rollout_status_after_attempt(
    attempt_status: str,
    sequence_id: int,
    is_latest: bool,
    rollout_status: str,
    config: RolloutConfig,
    expected: str | None,
) -> None:
    got = rollout_status_after_attempt(attempt_status, sequence_id, is_latest, rollout_status, config)
    assert got == expected


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ("preparing", "running"),
        ("unresponsive", "running"),
        ("running", "running"),
        ("succeeded", "succeeded"),
        ("failed", "failed"),
        ("timeout", "timeout"),
    ],
)
def test_attempt_status_on_heartbeat(status: str, expected: str) -> None:
    assert attempt_status_on_heartbeat(status) == expected


# (attempt status, start time, last heartbeat, config, now, expected verdict)
WATCHDOG_CASES = [
    # no limits: never
    ("running", 0.0, None, RolloutConfig(), 1e9, None),
    # timeout counts from start_time, strictly past the limit
    ("running", 0.0, 9.0, RolloutConfig(timeout_seconds=10), 11.0, "timeout"),
    ("preparing", 0.0, None, RolloutConfig(timeout_seconds=10), 10.5, "timeout"),
    ("running", 0.0, 9.0, RolloutConfig(timeout_seconds=10), 10.0, None),
    ("running", 0.0, 9.0, RolloutConfig(timeout_seconds=10), 9.5, None),
    # unresponsive counts from the last heartbeat
    ("running", 0.0, 5.0, RolloutConfig(unresponsive_seconds=5), 10.5, "unresponsive"),
    ("running", 0.0, 7.0, RolloutConfig(unresponsive_seconds=5), 10.5, None),
    ("running", 0.0, 5.0, RolloutConfig(unresponsive_seconds=5), 10.0, None),
    # ... or from start_time when it never beat
    ("preparing", 0.0, None, RolloutConfig(unresponsive_seconds=5), 6.0, "unresponsive"),
    ("preparing", 0.0, None, RolloutConfig(unresponsive_seconds=5), 4.0, None),
    # timeout wins when both apply
    ("running", 0.0, 1.0, RolloutConfig(timeout_seconds=10, unresponsive_seconds=5), 20.0, "timeout"),
    ("running", 0.0, 1.0, RolloutConfig(timeout_seconds=10, unresponsive_seconds=5), 7.0, "unresponsive"),
    # only active attempts are watched
    ("succeeded", 0.0, None, RolloutConfig(timeout_seconds=1, unresponsive_seconds=1), 100.0, None),
    ("failed", 0.0, None, RolloutConfig(timeout_seconds=1), 100.0, None),
    ("timeout", 0.0, None, RolloutConfig(timeout_seconds=1), 100.0, None),
    ("unresponsive", 0.0, None, RolloutConfig(unresponsive_seconds=1), 100.0, None),
]


@pytest.mark.parametrize(("status", "start", "heartbeat", "config", "now", "expected"), WATCHDOG_CASES)
def test_watchdog_verdict(
    status: str, start: float, heartbeat: float | None, config: RolloutConfig, now: float, expected: str | None
) -> None:
    assert watchdog_verdict(status, start, heartbeat, config, now) == expected


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ("succeeded", "idle"),
        ("failed", "idle"),
        ("timeout", "unknown"),
        ("unresponsive", "unknown"),
        ("running", "busy"),
        ("preparing", "busy"),
    ],
)
def test_worker_status_after_attempt(status: str, expected: str) -> None:
    assert worker_status_after_attempt(status) == expected


def test_ends_rollout() -> None:
    assert {s for s in ROLLOUT_STATUSES if ends_rollout(s)} == {"succeeded", "failed", "cancelled"}
    assert FINISHED_ROLLOUT.isdisjoint(QUEUED_ROLLOUT)


def test_ends_attempt() -> None:
    assert {s for s in ATTEMPT_STATUSES if ends_attempt(s)} == {"succeeded", "failed", "timeout", "unresponsive"}
    assert ENDED_ATTEMPT.isdisjoint(ACTIVE_ATTEMPT)
    assert set(ATTEMPT_STATUSES) == ENDED_ATTEMPT | ACTIVE_ATTEMPT


def test_status_sets_partition_rollout_statuses() -> None:
    from lightning.store.lifecycle import ACTIVE_ROLLOUT

    assert set(ROLLOUT_STATUSES) == QUEUED_ROLLOUT | ACTIVE_ROLLOUT | FINISHED_ROLLOUT
    assert len(QUEUED_ROLLOUT) + len(ACTIVE_ROLLOUT) + len(FINISHED_ROLLOUT) == len(ROLLOUT_STATUSES)
