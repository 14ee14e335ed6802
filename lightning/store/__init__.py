"""The store: rollouts, attempts, spans, resources and workers, and the rules of their lifecycle."""

from lightning.store.base import UNSET, LightningStore, Unset
from lightning.store.errors import ConflictError, InvalidArgumentError, NotFoundError, StoreError
from lightning.store.sql import DEFAULT_URL, SqlLightningStore

__all__ = [
    "DEFAULT_URL",
    "UNSET",
    "ConflictError",
    "InvalidArgumentError",
    "LightningStore",
    "NotFoundError",
    "SqlLightningStore",
    "StoreError",
    "Unset",
]
