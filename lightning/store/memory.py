"""agent-lightning's `InMemoryLightningStore`, by its name: our store on an in-memory SQLite database; and
`AglSqlLightningStore`, the store by URL that `Trainer` hands an agl `Algorithm`. Both answer unknown rollout ids as
agl's stores do (lightning.store.agl_answers)."""

from __future__ import annotations

from typing import Any

from lightning.store.agl_answers import AglUnknownIds
from lightning.store.sql import SqlLightningStore


class AglSqlLightningStore(AglUnknownIds, SqlLightningStore):
    """A SqlLightningStore that answers unknown rollout ids as agl's stores do: `query_spans` with an empty page,
    `wait_for_rollouts` by leaving them out."""


class InMemoryLightningStore(AglSqlLightningStore):
    """A store held in this process's memory (tests, debugging an agent with a Runner), gone when it closes: a
    SqlLightningStore on `sqlite://`, with its semantics, except that unknown rollout ids are answered as agl's
    store answers them (`query_spans`: an empty page; `wait_for_rollouts`: left out). Processes cannot share it;
    give a run a SQLite file or a PostgreSQL URL instead.

    agl's keywords: `thread_safe` is accepted either way (this store is always thread-safe), `tracker` (None) and
    `scan_debounce_seconds` change nothing; `eviction_memory_threshold` / `safe_memory_threshold` are refused: this
    store keeps every span until it closes."""

    def __init__(
        self,
        *,
        thread_safe: bool = False,
        eviction_memory_threshold: float | None = None,
        safe_memory_threshold: float | None = None,
        tracker: Any = None,
        scan_debounce_seconds: float = 10.0,
        watchdog_interval: float | None = 1.0,
    ) -> None:
        if eviction_memory_threshold is not None or safe_memory_threshold is not None:
            raise ValueError(
                "InMemoryLightningStore: this store keeps every span until it closes (no eviction); for a long run, "
                "give a SQLite file or a PostgreSQL URL: lightning.SqlLightningStore('sqlite:///path.db')"
            )
        if tracker is not None:
            raise ValueError("InMemoryLightningStore(tracker=): a store here has no metrics tracker; leave it out")
        super().__init__("sqlite://", watchdog_interval=watchdog_interval)

    def __repr__(self) -> str:
        return "InMemoryLightningStore()"
