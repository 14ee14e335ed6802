"""Store fixtures: one `store` per backend (SQLite file, SQLite in memory, PostgreSQL).

PostgreSQL tests run against the server named by LIGHTNING_TEST_PG_URL (default
postgresql://postgres@127.0.0.1:5432/test); each test gets a fresh schema, dropped afterwards.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
BACKENDS = ("sqlite_file", "sqlite_memory", "postgres")
SHARED_BACKENDS = ("sqlite_file", "postgres")
"""Backends that several stores (or processes) can open at once."""


def pg_url() -> str:
    return os.environ.get("LIGHTNING_TEST_PG_URL", DEFAULT_PG_URL)


def _psycopg_url(url: str) -> str:
    """The URL as psycopg takes it (no SQLAlchemy driver suffix)."""
    scheme, rest = url.split("://", 1)
    return f"{scheme.split('+', 1)[0]}://{rest}"


def _with_search_path(url: str, schema: str) -> str:
    parts = urlsplit(url)
    option = f"options=-csearch_path%3D{schema}"
    query = f"{parts.query}&{option}" if parts.query else option
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))


@pytest.fixture(scope="session")
def pg_server() -> str:
    """The PostgreSQL URL, after checking that the server answers; fails (never skips) if it does not."""
    import psycopg

    url = pg_url()
    problem = None
    try:
        with psycopg.connect(_psycopg_url(url), connect_timeout=5, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}".strip()
    if problem is not None:
        pytest.fail(
            f"PostgreSQL at {url!r} did not answer ({problem}).\n"
            "Start one with `bash .ci/postgres.sh` (starts or installs a local server, as CI does),\n"
            "or point LIGHTNING_TEST_PG_URL at one, or leave these tests out with: pytest -m 'not postgres'",
            pytrace=False,
        )
    return url


@pytest.fixture
def pg_schema_url(pg_server: str) -> Iterator[str]:
    """A store URL whose search_path is a fresh schema `t_<uuid>`, dropped with CASCADE afterwards."""
    import psycopg

    schema = f"t_{uuid.uuid4().hex}"
    admin = _psycopg_url(pg_server)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield _with_search_path(pg_server, schema)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _backend_url(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> str:
    if backend == "sqlite_file":
        return f"sqlite:///{tmp_path / 'store.db'}"
    if backend == "sqlite_memory":
        return "sqlite://"
    return request.getfixturevalue("pg_schema_url")


@pytest.fixture(
    params=[
        pytest.param("sqlite_file", id="sqlite_file"),
        pytest.param("sqlite_memory", id="sqlite_memory"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty store on each backend."""
    return _backend_url(request, request.param, tmp_path)


@pytest.fixture(
    params=[
        pytest.param("sqlite_file", id="sqlite_file"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty store that several stores or processes can share."""
    return _backend_url(request, request.param, tmp_path)


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[Any]:
    """A SqlLightningStore without the background watchdog (call `run_watchdog()` explicitly)."""
    from lightning.store import SqlLightningStore

    s = SqlLightningStore(store_url, watchdog_interval=None)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def open_store() -> AsyncIterator[Callable[..., Any]]:
    """open_store(url, **kwargs) -> SqlLightningStore, closed after the test."""
    from lightning.store import SqlLightningStore

    opened: list[Any] = []

    def _open(url: str, **kwargs: Any) -> Any:
        kwargs.setdefault("watchdog_interval", None)
        s = SqlLightningStore(url, **kwargs)
        opened.append(s)
        return s

    try:
        yield _open
    finally:
        for s in reversed(opened):
            await s.close()
