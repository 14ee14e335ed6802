"""The store's tables, declared with SQLModel; column names are the field names of lightning.types.

Besides the public fields, a few bookkeeping columns make the store's rules cheap in SQL:
queue order, the latest attempt, the per-rollout span counter and the watchdog's deadlines.
Nested values (inputs, configs, metadata, resources) are stored as JSON text, the same bytes on
SQLite and PostgreSQL.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Column, Index, String, Text, UniqueConstraint, inspect, text
from sqlmodel import Field, SQLModel


class RolloutRow(SQLModel, table=True):
    __tablename__ = "rollouts"
    __table_args__ = (
        # Only queued rollouts are in this index, so a queue's head is its first entry under the queue's name.
        Index(
            "ix_rollouts_queue_head",
            "queue",
            "queued_at",
            "seq",
            sqlite_where=text("queued_at IS NOT NULL"),
            postgresql_where=text("queued_at IS NOT NULL"),
        ),
        Index(
            "uq_rollouts_idempotency_key",
            "idempotency_key",
            unique=True,
            sqlite_where=text("idempotency_key IS NOT NULL"),
            postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
    )

    seq: int | None = Field(default=None, primary_key=True)
    """Insertion order; breaks ties in queue order."""
    rollout_id: str = Field(unique=True, max_length=64)
    input: str = Field(sa_column=Column(Text, nullable=False))
    start_time: float
    end_time: float | None = None
    mode: str | None = Field(default=None, max_length=16)
    resources_id: str | None = Field(default=None, max_length=64)
    status: str = Field(max_length=16)
    config: str = Field(sa_column=Column(Text, nullable=False))
    metadata_: str | None = Field(default=None, sa_column=Column("metadata", Text))
    idempotency_key: str | None = Field(default=None, max_length=255)
    """Unique among rollouts that have one (a partial index: rows without a key cost nothing)."""
    queue: str = Field(sa_column=Column(String(255), nullable=False, server_default="default"))
    """The queue the rollout waits in, and goes back to on a retry; runners take from one queue."""
    queued_at: float | None = None
    """When the rollout last entered the queue (FIFO order); NULL whenever it is not queued."""
    attempt_count: int = 0
    latest_attempt_id: str | None = Field(default=None, max_length=64)
    next_span_sequence_id: int = 1


class AttemptRow(SQLModel, table=True):
    __tablename__ = "attempts"
    __table_args__ = (
        UniqueConstraint("rollout_id", "sequence_id", name="uq_attempts_rollout_sequence"),
        Index("ix_attempts_status", "status"),
    )

    attempt_id: str = Field(primary_key=True, max_length=64)
    rollout_id: str = Field(max_length=64)
    sequence_id: int
    start_time: float
    end_time: float | None = None
    status: str = Field(max_length=16)
    worker_id: str | None = Field(default=None, max_length=255)
    last_heartbeat_time: float | None = None
    metadata_: str | None = Field(default=None, sa_column=Column("metadata", Text))
    timeout_at: float | None = None
    """start_time + the rollout's timeout_seconds, for the watchdog."""
    unresponsive_seconds: float | None = None
    """The rollout's unresponsive_seconds, copied so the watchdog needs no join."""


class SpanRow(SQLModel, table=True):
    __tablename__ = "spans"
    __table_args__ = (
        # Also the index for "spans of a rollout": a second one on (rollout_id, sequence_id) would
        # cost a page write per span and save only sorting one rollout's spans.
        UniqueConstraint("rollout_id", "attempt_id", "span_id", name="uq_spans_identity"),
    )

    pk: int | None = Field(default=None, primary_key=True)
    rollout_id: str = Field(max_length=64)
    attempt_id: str = Field(max_length=64)
    sequence_id: int
    trace_id: str = Field(max_length=64)
    span_id: str = Field(max_length=64)
    parent_id: str | None = Field(default=None, max_length=64)
    name: str = Field(sa_column=Column(Text, nullable=False))
    start_time: float | None = None
    end_time: float | None = None
    payload: str = Field(sa_column=Column(Text, nullable=False))
    """The whole Span as JSON; the columns above are copies for filtering and sorting."""


class ResourcesRow(SQLModel, table=True):
    __tablename__ = "resources"

    resources_id: str = Field(primary_key=True, max_length=64)
    create_time: float
    update_time: float
    version: int
    resources: str = Field(sa_column=Column(Text, nullable=False))
    latest_order: int = Field(index=True)
    """Grows on every add or update; the highest is the latest resources."""


class WorkerRow(SQLModel, table=True):
    __tablename__ = "workers"

    worker_id: str = Field(primary_key=True, max_length=255)
    status: str = Field(default="unknown", max_length=16)
    heartbeat_stats: str | None = Field(default=None, sa_column=Column(Text))
    last_heartbeat_time: float | None = None
    last_dequeue_time: float | None = None
    last_busy_time: float | None = None
    last_idle_time: float | None = None
    current_rollout_id: str | None = Field(default=None, max_length=64)
    current_attempt_id: str | None = Field(default=None, max_length=64)


rollouts = RolloutRow.__table__
attempts = AttemptRow.__table__
spans = SpanRow.__table__
resources = ResourcesRow.__table__
workers = WorkerRow.__table__
metadata = SQLModel.metadata


def migrate(conn: Any) -> None:
    """Bring a store written by an earlier version up to these tables: add the columns and indexes it lacks (its
    rows keep their data; rollouts from before queues existed are in the default queue). Idempotent."""
    columns = {column["name"] for column in inspect(conn).get_columns("rollouts")}
    if "queue" not in columns:
        conn.execute(text("ALTER TABLE rollouts ADD COLUMN queue VARCHAR(255) NOT NULL DEFAULT 'default'"))
        conn.execute(text("DROP INDEX IF EXISTS ix_rollouts_queue"))
    for index in RolloutRow.__table__.indexes:
        index.create(conn, checkfirst=True)
