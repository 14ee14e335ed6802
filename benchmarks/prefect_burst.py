"""Does the Prefect server answer 503 under a burst of task events? The same bounded bursts against
`prefect server start` on its default SQLite database, then on PostgreSQL, one server at a time, on 127.0.0.1:

- `flow`: a real flow fans out N tiny tasks at once on a thread pool of C (as the train flow fans out its
  runner tasks: results persisted as JSON, retries, a log line each). Prefect 3 sends task-run states as events
  over a websocket, recorded by the server in the background; the REST calls (flow-run states, logs) are
  counted in the flow's process.
- `api`: the REST writes of N task runs (create, RUNNING, COMPLETED, one log line: 4 requests each), C at a
  time, through PrefectClient with its default retries (503s and dropped connections are retried with backoff,
  up to 5 times); every answer the server gives is counted, retried or not.

Columns: wall s (the burst, retries included), tasks/s, 503s (answers, including those a retry then got
past), other errors (other 5xx, dropped connections, calls that still failed after their retries), recorded
(task runs the server holds for the burst's flow run afterwards: N when nothing was lost). Below the table:
the 503s each server logged, and its tracebacks that end in `database is locked`.

    .venv/bin/python benchmarks/prefect_burst.py [--tasks 300] [--concurrency 50] [--modes flow,api]
        [--databases sqlite,postgresql] [--pg-url postgresql://postgres@127.0.0.1:5432/test]

PostgreSQL: a fresh database `prefect_burst_<random>` on --pg-url's server, dropped at the end (needs
CREATE DATABASE; asyncpg comes with prefect). Bounded: --timeout seconds per burst (default 120); a server
takes 10-40 s to start.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from prefect_server import (  # noqa: E402 (tests/prefect_server.py: how the tests start a server)
    PrefectServer,
    running_prefect_server,
)

from benchmarks.machine_load import MachineLoad  # noqa: E402

DEFAULT_PG_URL = os.environ.get("LIGHTNING_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
RETRYABLE = "Encountered retryable exception in request"
"""What the server logs for each request it answers 503 (with PREFECT_SERVER_LOG_RETRYABLE_ERRORS on)."""
LOCKED = "sqlalchemy.exc.OperationalError: (sqlite3.OperationalError) database is locked"
"""The last line of a traceback of a SQLite lock failure."""
DRAIN_SECONDS = 30.0
"""How long to wait, after a burst, for the server to record its task runs (events are written in batches)."""


# --- servers ---------------------------------------------------------------------------------


@contextlib.contextmanager
def postgres_database(server_url: str) -> Iterator[str]:
    """A fresh database on the server at `server_url`, as a postgresql+asyncpg:// URL; dropped at the end."""
    import psycopg

    parts = urlsplit(server_url.replace("postgresql+psycopg://", "postgresql://", 1))
    name = f"prefect_burst_{uuid.uuid4().hex[:12]}"
    admin = urlunsplit(parts)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(("postgresql+asyncpg", parts.netloc, f"/{name}", "", ""))
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --- counting HTTP answers ---------------------------------------------------------------------


class Tally:
    """HTTP answers by status, and transport errors by type."""

    def __init__(self) -> None:
        self.statuses: collections.Counter[int] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()

    def answered(self, response: Any) -> Any:
        self.statuses[response.status_code] += 1
        return response

    def failed(self, exc: Exception) -> None:
        self.errors[type(exc).__name__] += 1

    def as_dict(self) -> dict[str, Any]:
        return {"statuses": dict(self.statuses), "errors": dict(self.errors)}


def count_transport(transport_class: Any, tally: Tally) -> None:
    """Count every answer that an httpx async transport class gets (below Prefect's retries)."""
    send = transport_class.handle_async_request

    async def counted(self: Any, request: Any) -> Any:
        try:
            return tally.answered(await send(self, request))
        except Exception as exc:
            tally.failed(exc)
            raise

    transport_class.handle_async_request = counted


def count_sync_transport(transport_class: Any, tally: Tally) -> None:
    """As count_transport, for a sync transport class (a sync flow's engine uses the sync client)."""
    send = transport_class.handle_request

    def counted(self: Any, request: Any) -> Any:
        try:
            return tally.answered(send(self, request))
        except Exception as exc:
            tally.failed(exc)
            raise

    transport_class.handle_request = counted


# --- the bursts --------------------------------------------------------------------------------


def flow_burst_child(tasks: int, concurrency: int) -> None:
    """In a process of its own (PREFECT_API_URL names the server): the flow, then its numbers as JSON."""
    import httpx
    from prefect import flow, get_run_logger, task
    from prefect.task_runners import ThreadPoolTaskRunner

    tally = Tally()
    count_transport(httpx.AsyncHTTPTransport, tally)
    count_sync_transport(httpx.HTTPTransport, tally)

    @task(task_run_name="tiny-{i}", retries=2, persist_result=True, result_serializer="json")
    async def tiny(i: int) -> int:
        get_run_logger().info("task %d", i)
        return i

    @flow(name="burst", task_runner=ThreadPoolTaskRunner(max_workers=concurrency))
    def burst() -> int:
        futures = tiny.map(range(tasks))
        return sum(f.result() for f in futures)

    started = time.perf_counter()
    state = burst(return_state=True)
    wall = time.perf_counter() - started
    failed = 0 if state.is_completed() else 1
    if failed:
        tally.errors[f"flow run {state.type.value}"] += 1
    print(json.dumps({"wall": wall, "failed": failed, "flow_run_id": str(state.state_details.flow_run_id),
                      **tally.as_dict()}))  # fmt: skip


def flow_burst(server: PrefectServer, tasks: int, concurrency: int, timeout: float, home: Path) -> dict[str, Any]:
    env = {**server.env, "PREFECT_HOME": str(home), "PREFECT_LOGGING_LEVEL": "WARNING"}
    command = [sys.executable, __file__, "--child-flow", str(tasks), "--concurrency", str(concurrency)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"wall": timeout, "failed": tasks, "statuses": {}, "errors": {"timeout": 1}, "flow_run_id": None}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"  the flow process failed ({done.returncode}):\n{done.stderr[-3000:]}", file=sys.stderr)
        return {"wall": float("nan"), "failed": tasks, "statuses": {}, "errors": {"crash": 1}, "flow_run_id": None}
    return json.loads(lines[-1])


async def api_burst(server: PrefectServer, tasks: int, concurrency: int, timeout: float) -> dict[str, Any]:
    import httpx
    from prefect import flow, task
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.actions import LogCreate
    from prefect.states import Completed, Running

    @flow(name="burst-api")
    def burst_api() -> None: ...

    @task(name="tiny")
    def tiny() -> None: ...

    tally = Tally()

    class Counted(httpx.AsyncHTTPTransport):
        pass

    count_transport(Counted, tally)
    transport = Counted(limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency))
    failed = 0
    async with PrefectClient(server.api_url, httpx_settings={"transport": transport, "timeout": 60}) as client:
        flow_run = await client.create_flow_run(burst_api, name=f"burst-api-{uuid.uuid4().hex[:6]}", state=Running())
        flow_run_id = flow_run.id
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            nonlocal failed
            async with gate:
                try:
                    run = await client.create_task_run(tiny, flow_run_id, dynamic_key=str(i), name=f"tiny-{i}")
                    await client.set_task_run_state(run.id, Running(), force=True)
                    await client.set_task_run_state(run.id, Completed(), force=True)
                    log = LogCreate(name="burst", level=20, message=f"task {i}", timestamp=run.created,
                                    flow_run_id=flow_run_id, task_run_id=run.id)  # fmt: skip
                    await client.create_logs([log])
                except Exception as exc:
                    failed += 1
                    tally.errors[f"failed:{type(exc).__name__}"] += 1

        started = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(tasks))), timeout)
        except TimeoutError:
            tally.errors["timeout"] += 1
        wall = time.perf_counter() - started
    return {"wall": wall, "failed": failed, "flow_run_id": str(flow_run_id), **tally.as_dict()}


async def recorded(server: PrefectServer, flow_run_id: str | None, tasks: int) -> int:
    """Task runs the server holds for the flow run, once it has them all or DRAIN_SECONDS have passed."""
    if flow_run_id is None:
        return 0
    import httpx

    deadline = time.monotonic() + DRAIN_SECONDS
    body = {"flow_runs": {"id": {"any_": [flow_run_id]}}}
    async with httpx.AsyncClient(base_url=server.api_url, timeout=30) as client:
        while True:
            count = (await client.post("/task_runs/count", json=body)).raise_for_status().json()
            if count >= tasks or time.monotonic() > deadline:
                return count
            await asyncio.sleep(1)


# --- the table ---------------------------------------------------------------------------------


def row(database: str, mode: str, tasks: int, result: dict[str, Any], stored: int) -> dict[str, Any]:
    statuses = {int(code): n for code, n in result["statuses"].items()}
    other = sum(n for code, n in statuses.items() if code >= 500 and code != 503) + sum(result["errors"].values())
    wall = result["wall"]
    return {
        "database": database, "mode": mode, "tasks": tasks, "wall s": f"{wall:.1f}",
        "tasks/s": f"{tasks / wall:.0f}" if wall == wall and wall > 0 else "-",
        "503s": statuses.get(503, 0), "other errors": other, "recorded": stored,
    }  # fmt: skip


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print("| " + " | ".join(c.ljust(widths[c]) for c in columns) + " |")
    print("|" + "|".join("-" * (widths[c] + 2) for c in columns) + "|")
    for r in rows:
        print("| " + " | ".join(str(r[c]).rjust(widths[c]) for c in columns) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=300, help="tasks per burst (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=50, help="tasks in flight at once (default: %(default)s)")
    parser.add_argument("--modes", default="flow,api", help="flow, api or both (default: %(default)s)")
    parser.add_argument("--databases", default="sqlite,postgresql", help="(default: %(default)s)")
    parser.add_argument("--pg-url", default=DEFAULT_PG_URL, help="PostgreSQL server (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per burst (default: %(default)s)")
    parser.add_argument("--child-flow", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    load = MachineLoad()
    if args.child_flow is not None:
        flow_burst_child(args.child_flow, args.concurrency)
        return
    if not 1 <= args.tasks <= 5000 or not 1 <= args.concurrency <= 500:
        parser.error("--tasks must be 1..5000 and --concurrency 1..500 (the bursts are bounded)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    databases = [d.strip() for d in args.databases.split(",") if d.strip()]
    if not set(modes) <= {"flow", "api"} or not set(databases) <= {"sqlite", "postgresql"}:
        parser.error("--modes takes flow,api and --databases sqlite,postgresql")

    rows: list[dict[str, Any]] = []
    locked: dict[str, tuple[int, int]] = {}
    work = Path(tempfile.mkdtemp(prefix="prefect-burst-"))
    print(f"{args.tasks} tasks, {args.concurrency} at a time; servers' homes and logs under {work}", flush=True)
    for database in databases:
        with contextlib.ExitStack() as stack:
            url = stack.enter_context(postgres_database(args.pg_url)) if database == "postgresql" else None
            started = time.perf_counter()
            # Log the 503s' causes too (Prefect leaves out SQLite's `database is locked` by default).
            logged = {"PREFECT_SERVER_LOG_RETRYABLE_ERRORS": "true"}
            server = stack.enter_context(running_prefect_server(work / database, database_url=url, env=logged))
            print(f"{database}: server up in {time.perf_counter() - started:.0f} s at {server.api_url}", flush=True)
            for mode in modes:
                if mode == "flow":
                    home = work / f"{database}-flow-client"
                    result = flow_burst(server, args.tasks, args.concurrency, args.timeout, home)
                else:
                    result = asyncio.run(api_burst(server, args.tasks, args.concurrency, args.timeout))
                stored = asyncio.run(recorded(server, result["flow_run_id"], args.tasks))
                rows.append(row(database, mode, args.tasks, result, stored))
                print(f"  {mode}: {json.dumps({k: v for k, v in result.items() if k != 'flow_run_id'})}", flush=True)
            log = server.log_path.read_text(errors="replace")
            locked[database] = (log.count(RETRYABLE), log.count(LOCKED))
    print()
    print_table(rows)
    print()
    for database, (retryable, n) in locked.items():
        print(f"{database} server log: {retryable} requests answered 503 ('{RETRYABLE}'), {n} tracebacks ending in "
              "'database is locked' (a request's is logged twice: by Prefect and by uvicorn)")  # fmt: skip
    print(f"\n{load.line()}")


if __name__ == "__main__":
    main()
