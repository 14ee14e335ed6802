"""The store: rollouts, attempts, spans, resources and workers, and the rules of their lifecycle."""

import os
from typing import Any

from lightning.agl_import_paths import missing
from lightning.credentials import expand, split_credentials
from lightning.environment import STORE_TOKEN
from lightning.store import contract
from lightning.store.base import (
    UNSET,
    LightningStore,
    LightningStoreCapabilities,
    LightningStoreStatistics,
    Unset,
)
from lightning.store.contract import DEFAULT_QUEUE
from lightning.store.errors import AuthError, ConflictError, InvalidArgumentError, NotFoundError, StoreError
from lightning.store.memory import InMemoryLightningStore
from lightning.store.sql import DEFAULT_URL, SqlLightningStore


def open_store(
    url: str, *, token: str | None = None, watchdog_interval: float | None = 1.0, agl_answers: bool = False
) -> LightningStore:
    """The store at `url`: `http(s)://host:port` is a store server (`lightning store serve`), anything
    else a database URL for SqlLightningStore. `token`: the server's bearer token (default: env
    LIGHTNING_STORE_TOKEN). A `${VAR}` in the URL (a password) is expanded from the environment here.
    `agl_answers`: unknown rollout ids answered as agent-lightning's stores answer them (lightning.store.agl_answers),
    for code written for agl."""
    if url.startswith(("http://", "https://")):
        from lightning.store.client import HttpLightningStore, LightningStoreClient

        url = expand(url)
        in_url = split_credentials(url)[1]  # `http://:TOKEN@host`: the URL's token comes before the environment's
        token = token or in_url or os.environ.get(STORE_TOKEN)
        return LightningStoreClient(url, token=token) if agl_answers else HttpLightningStore(url, token=token)
    if agl_answers:
        from lightning.store.memory import AglSqlLightningStore

        return AglSqlLightningStore(url, watchdog_interval=watchdog_interval)
    return SqlLightningStore(url, watchdog_interval=watchdog_interval)


def __getattr__(name: str) -> Any:
    if name == "LightningStoreClient":  # (aiohttp, loaded on first use)
        from lightning.store.client import LightningStoreClient

        return LightningStoreClient
    if name in ("LightningStoreServer", "LightningStoreThreaded"):  # agl's names (uvicorn, loaded on first use)
        from lightning.store import agl_server

        return getattr(agl_server, name)
    missing(__name__, name)


__all__ = [
    "DEFAULT_QUEUE",
    "DEFAULT_URL",
    "UNSET",
    "AuthError",
    "ConflictError",
    "InMemoryLightningStore",
    "InvalidArgumentError",
    "LightningStore",
    "LightningStoreCapabilities",
    "LightningStoreStatistics",
    "NotFoundError",
    "SqlLightningStore",
    "StoreError",
    "Unset",
    "contract",
    "open_store",
]
