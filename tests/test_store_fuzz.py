"""Requests generated from the store server's own OpenAPI schema (schemathesis, a bounded number per route), on
SQLite and on PostgreSQL: none may get an answer >= 500. A bad request is a 4xx that says why."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from lightning.store import SqlLightningStore
from lightning.store.agl_routes import PREFIX, ROUTES
from lightning.store.server import create_app

pytestmark = pytest.mark.slow
EXAMPLES_PER_ROUTE = 30


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_no_generated_request_makes_the_store_server_fail(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Here, not at the top: every pytest process (each xdist worker) imports the test modules, and these take seconds.
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    url = f"sqlite:///{tmp_path / 'store.db'}" if backend == "sqlite" else request.getfixturevalue("pg_schema_url")
    store = SqlLightningStore(url, watchdog_interval=None)
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(store))
    failures: list[str] = []
    tried = 0
    agl_operations: set[tuple[str, str]] = set()
    try:
        for result in schema.get_all_operations():
            operation = result.ok()
            if operation.path.startswith(PREFIX):
                agl_operations.add((operation.method.upper(), operation.path))

            @given(case=operation.as_strategy())
            @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, suppress_health_check=list(HealthCheck))
            def call(case: Any) -> None:
                nonlocal tried
                tried += 1
                if isinstance(case.body, dict):  # waits are real: keep them short
                    for name in ("wait", "timeout"):
                        if isinstance(case.body.get(name), int | float):
                            case.body[name] = min(case.body[name], 0.05)
                try:
                    response = case.call(timeout=30)
                except Exception as exc:  # recorded, not raised: Hypothesis would spend minutes shrinking it
                    failures.append(f"{case.method} {case.path} {case.body!r} -> {exc!r}")
                    return
                if response.status_code >= 500:
                    failures.append(
                        f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text}"
                    )

            call()
    finally:
        asyncio.run(store.close())
    assert tried > 300
    assert len(agl_operations) == len(ROUTES)  # agent-lightning's routes are in the schema, so fuzzed too
    assert not failures, f"{len(failures)} of {tried} requests got a 5xx:\n" + "\n".join(failures[:10])
