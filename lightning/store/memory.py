"""agent-lightning's `InMemoryLightningStore`, by its name: our store on an in-memory SQLite database."""

from __future__ import annotations

from lightning.store.sql import SqlLightningStore


class InMemoryLightningStore(SqlLightningStore):
    """A store held in this process's memory (tests, debugging an agent with a Runner), gone when it closes: a
    SqlLightningStore on `sqlite://`, with its semantics. Processes cannot share it; give a run a SQLite file or a
    PostgreSQL URL instead. agl's tuning arguments (thread_safe, eviction thresholds) have no counterpart: this one is
    always thread-safe and keeps everything until it closes."""

    def __init__(self, *, watchdog_interval: float | None = 1.0) -> None:
        super().__init__("sqlite://", watchdog_interval=watchdog_interval)

    def __repr__(self) -> str:
        return "InMemoryLightningStore()"
